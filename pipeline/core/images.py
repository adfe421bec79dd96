"""Content parts: the one form a message's list content takes from the prompt set to the request. Pure: no I/O.

A normalised message's `content` is a string (every text prompt, as always) or a list of parts:
- a text part `{"type": "text", "text": str}`;
- an image part `{"type": "image", "sha256": hex64, "media_type": "image/png", "width": int, "height": int,
  "bytes": int}` plus `"path": str` only when the image is referenced in place (`images.store: reference`): the
  absolute path (or object-store URI) its bytes are read from. Without `path` the bytes are in the run directory
  at `stored_image_path(sha256)` (`images.store: copy`, the default; images fetched from http(s), `data:` URLs
  and the `bytes` of a `datasets` Image column are always copied).

The sha256 of an image's bytes is its identity: `prompt_id` hashes an image part as `{"type": "image", "sha256"}`
(`identity_part`), so the same image at another path is the same prompt, and the same text with another image is
another prompt. The Parquet form of parts is store/schema.py's PART; the request's form (`image_url` parts) is made
by the endpoint worker, which reads the bytes and checks their sha256 when it sends them (dispatch/).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

TEXT, IMAGE = "text", "image"
IMAGES_DIR = "images"  # RUN/images/<sha256[:2]>/<sha256>: each image of a prompt set once (images.store: copy)
# The image formats sent (Pillow's format names -> media type): what SGLang's and vLLM's loaders open with Pillow
# and the vision processors take. An animated image (a video in all but name) is refused: video is out of scope.
MEDIA_TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif",
               "BMP": "image/bmp"}
IMAGE_PART_KEYS = ("sha256", "media_type", "width", "height", "bytes", "path")


def text_part(text: str) -> dict[str, Any]:
    return {"type": TEXT, "text": text}


def image_part(sha256: str, media_type: str, width: int, height: int, nbytes: int,
               path: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": IMAGE, "sha256": sha256, "media_type": media_type, "width": width,
                            "height": height, "bytes": nbytes}
    if path is not None:
        part["path"] = path
    return part


def is_parts(content: Any) -> bool:
    return isinstance(content, (list, tuple))


def identity_part(part: Mapping[str, Any]) -> dict[str, Any]:
    """What of a part names the prompt: an image by its bytes' sha256 alone (not where they are), text as it is."""
    if part["type"] == IMAGE:
        return {"type": IMAGE, "sha256": part["sha256"]}
    return {"type": TEXT, "text": part["text"]}


def identity_content(content: Any) -> Any:
    """A message's content as `prompt_id` hashes it: a string as it is, parts by `identity_part`."""
    return [identity_part(p) for p in content] if is_parts(content) else content


def images_of(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every image part of a conversation, in order (an image sent twice is listed twice)."""
    return [p for m in messages if is_parts(m.get("content")) for p in m["content"] if p["type"] == IMAGE]


def has_images(messages: Iterable[Mapping[str, Any]]) -> bool:
    return any(is_parts(m.get("content")) and any(p["type"] == IMAGE for p in m["content"]) for m in messages)


def content_text(content: Any, image_marker: str = "") -> str:
    """A message's text: a string as it is; parts' texts joined by a newline, each image as `image_marker`."""
    if not is_parts(content):
        return content or ""
    pieces = [p["text"] if p["type"] == TEXT else image_marker for p in content]
    return "\n".join(piece for piece in pieces if piece)


def stored_image_path(sha256: str) -> str:
    """Where a copied image's bytes are, relative to the run directory."""
    return f"{IMAGES_DIR}/{sha256[:2]}/{sha256}"
