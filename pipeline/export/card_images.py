"""The dataset card's image figures and its examples (card.py gathers the rows; this counts and renders them).

Image figures, from the records' content parts (records schema 6): images per image prompt, each distinct image's
size (pixels, bytes), and the prompt tokens of image records beside those of text records. An image's token count
is not exact from these: the server's prompt_tokens hold the image's placeholder tokens (their number depends on
the image's size and the model's processor) and the text's together, and a text estimate subtracted from them is
an estimate, so the card shows the two distributions side by side and says so.

Examples: the first records of the run and its first image record, each with its source's own id (`source_ref`),
the prompt's last user turn (an image as `[image WxH]`) and the reply, cut short.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.images import IMAGE, is_parts
from .messages import content_with_labels, message_of

EXAMPLES = 2  # the first records shown, plus the first image record
EXAMPLE_CHARS = 240


@dataclass
class ImageContents:
    images_per_prompt: dict[str, int] = field(default_factory=dict)  # image prompt -> most images in one record
    sizes: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # sha256 -> (width, height, bytes)
    image_parts: int = 0  # image parts in all records' messages (an image sent again in a later turn counts again)
    image_records: int = 0
    prompt_tokens_images: list[int] = field(default_factory=list)
    prompt_tokens_text: list[int] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    image_example: dict[str, Any] | None = None

    def add(self, row: dict[str, Any]) -> None:
        """One record; its `messages` only where the part has content parts (else text only)."""
        images = [p for m in row.get("messages") or () for p in (m.get("parts") or ()) if p.get("type") == IMAGE]
        tokens = row.get("prompt_tokens")
        if images:
            self.image_records += 1
            self.image_parts += len(images)
            pid = row["prompt_id"]
            self.images_per_prompt[pid] = max(self.images_per_prompt.get(pid, 0), len(images))
            for part in images:
                self.sizes.setdefault(part["sha256"], (part.get("width") or 0, part.get("height") or 0,
                                                       part.get("bytes") or 0))
            if tokens is not None:
                self.prompt_tokens_images.append(tokens)
            if self.image_example is None:
                self.image_example = example_of(row)
        elif tokens is not None:
            self.prompt_tokens_text.append(tokens)
        if len(self.examples) < EXAMPLES and row.get("messages") is not None:
            self.examples.append(example_of(row))


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + " ..."


def example_of(row: dict[str, Any]) -> dict[str, Any]:
    messages = [message_of(m) for m in row.get("messages") or ()]
    users = [m for m in messages if m["role"] == "user"]
    prompt = content_with_labels(users[-1]["content"]) if users else ""
    return {"prompt_id": row["prompt_id"], "source": row.get("source"), "source_ref": row.get("source_ref"),
            "prompt": _cut(prompt), "reply": _cut(row.get("content") or ""),
            "images": sum(1 for m in messages if is_parts(m["content"]) for p in m["content"] if p["type"] == IMAGE)}


def image_lines(images: ImageContents, stats_table: Callable[[list], list[str]], stats_of) -> list[str]:
    if not images.image_records:
        return []
    per_prompt = Counter(images.images_per_prompt.values())
    sizes = list(images.sizes.values())
    return [
        "## Images", "",
        f"{len(images.images_per_prompt)} prompts with images ({images.image_records} records, {images.image_parts} "
        f"image parts sent, {len(images.sizes)} distinct images).", "",
        "| images in the prompt | prompts |", "|---:|---:|",
        *[f"| {n} | {count} |" for n, count in sorted(per_prompt.items())], "",
        *stats_table([("image width (pixels)", stats_of([w for w, _, _ in sizes])),
                      ("image height (pixels)", stats_of([h for _, h, _ in sizes])),
                      ("image pixels (width x height)", stats_of([w * h for w, h, _ in sizes])),
                      ("image file (bytes)", stats_of([b for _, _, b in sizes])),
                      ("prompt tokens, image records", stats_of(images.prompt_tokens_images)),
                      ("prompt tokens, text records", stats_of(images.prompt_tokens_text))], "figure"), "",
        "Sizes are of each distinct image once. The prompt tokens of an image record are the server's count, the "
        "image's placeholder tokens included (their number depends on the image's size and the model's processor); "
        "no exact per-image token count can be read from them, so they are shown beside those of the text records, "
        "not as a difference.", ""]


def example_lines(images: ImageContents) -> list[str]:
    shown = list(images.examples)
    if images.image_example is not None and all(e["prompt_id"] != images.image_example["prompt_id"] for e in shown):
        shown.append(images.image_example)
    if not shown:
        return []
    lines = ["## Examples", ""]
    for example in shown:
        ref = f", source id `{example['source_ref']}`" if example["source_ref"] else ""
        lines += [f"- `{example['prompt_id'][:16]}` (source `{example['source']}`{ref}):",
                  f"  - prompt: {example['prompt'] or '(none)'}", f"  - reply: {example['reply'] or '(empty)'}"]
    return lines + [""]
