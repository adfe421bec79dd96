"""The `speculators` export's image rows: natural-language `conversations`, as vLLM speculators 0.9.0 reads image
data. Pure: records in (normalised messages: export/messages.py), rows out.

What speculators reads (speculators/data_generation/, 0.9.0):
- `preprocessing.py` `load_raw_dataset`: a local `.jsonl` through `datasets.load_dataset("json")`, one Arrow schema
  for the whole file (`datasets` before 5 refuses a field that is a string in one row and a list in another; 5.x
  reads it as a Json column). So every `content` here is a list of parts, as the `sharegpt4v_coco` preset makes
  them (`configs.py` `_normalize_sharegpt4v_coco`: user parts `{"type": "image", "path"}` and `{"type": "text",
  "text"}`, the assistant's text as one text part), and the image rows go to a file of their own: pre-tokenized
  rows (`input_ids`, `loss_mask`) and these cannot share a file (`_preprocess_batch` takes a whole batch as one or
  the other).
- `_normalize_conversation`: `role`/`content` (or `from`/`value`), `tool_calls`, `tool_call_id`, `reasoning_content`
  (or `thinking`); `_adapt_part_for_vllm`: an image part with `path` becomes `image_url` `file://<absolute path>`
  (vLLM reads it under `--allowed-local-media-path`); base64 is refused.
- `_render_boundary_rows` renders each assistant turn through `--render-endpoint` (a vLLM server of the target) and
  trains every assistant turn of a row at its render boundary. So a row holds target-written assistant turns only:
  an all_turns conversation whole, a last_turn record only when its history holds no assistant turn (the source
  wrote those; such records are not exported as image rows, counted as `history_not_target_written`). The renderer
  closes every assistant turn, so records cut at max_tokens are not exported as image rows (`truncated`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..core.images import IMAGE, is_parts
from .formats import Record, conversation_id, specforge_conversation_row
from .messages import ImagePaths

NOTE = ("speculators: image records are natural-language conversations in {images} (image parts as absolute "
        "`path`s, --image-prefix rewrites them for the trainer's filesystem); `speculators prepare-data` renders "
        "them only with `--render-endpoint` (a vLLM server of the target, started with --allowed-local-media-path "
        "covering the images, and on vLLM 0.32 --enable-scale-out for its render route) and trains every assistant "
        "turn of each row: pass both files, `--data {out} --data {images}`. Text records stay pre-tokenized rows in "
        "{out}")


def _parts(content: Any, paths: ImagePaths) -> list[dict[str, Any]]:
    if not is_parts(content):
        return [{"type": "text", "text": content}] if content else []
    return [{"type": IMAGE, "path": paths.path_of(p)} if p["type"] == IMAGE else {"type": "text", "text": p["text"]}
            for p in content]


def _message(message: Mapping[str, Any], paths: ImagePaths) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": _parts(message.get("content"), paths)}
    for key in ("reasoning_content", "tool_calls", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    return out


def history_has_assistant(record: Record) -> bool:
    return any(m["role"] == "assistant" for m in record.get("messages") or [])


def speculators_image_row(turns: Sequence[Record], paths: ImagePaths, source_ref: str | None) -> dict[str, Any]:
    """One conversation: turns 0..k of an all_turns conversation (raises formats.HistoryMismatch when its history
    is not the target's own replies), or a last_turn record alone."""
    row = specforge_conversation_row(turns)
    return {"id": conversation_id(turns[-1]), "conversations": [_message(m, paths) for m in row["conversations"]],
            "tools": row.get("tools"), "source_ref": source_ref}
