"""Content parts as the sources write them, read into the few forms `normalise` checks. Pure: no I/O.

A list content is read part by part:
- text: `{"type": "text", "text"}` (also `input_text`, OpenAI's Responses API) -> `{"type": "text", "text"}`;
- an image -> `{"type": "image_ref", "ref": <the reference as the source wrote it>}`, read later by images.py:
  `{"type": "image_url", "image_url": {"url"}}` or `image_url` as a bare string (OpenAI, TorchSpec), `{"type":
  "image", "image" | "path" | "url" | "image_url" | "base64": ...}` (TorchSpec, speculators, transformers' chat
  templates), `{"type": "input_image", "image_url"}` (the Responses API). Each is sent as an `image_url` part, the
  one form every supported SGLang version's request model takes (its pydantic models refuse `image`,
  `input_image` and a bare-string `image_url`). An image part that holds nothing (`{"type": "image"}`, as TRL's datasets write them beside an `images` column) is a placeholder
  (`ref` None) that the record's images field fills (image_records.py);
- an image part in regen's own stored form (`sha256`, `media_type`, `path`: core/images.py) is read from its
  `path` like any other (never taken on the record's word: its bytes are hashed, checked and kept under
  `image_root`); its other keys are counted as not carried, and one without `path` is a placeholder;
- video, audio and file parts, and any other type: the record is rejected under the kind's own code, the reason
  naming the type. They are never sent as text.
Keys of a part that regen does not send (an image's `detail`, ...) are counted by name (`part.KEY`,
`part.image_url.KEY`). Arrow unifies the keys of struct rows (Parquet, hub datasets), so a key holding null is absent.
"""
from __future__ import annotations

from typing import Any

from .records import InvalidRecord, RejectCode, Tally

IMAGE_REF = "image_ref"  # an image not read yet: {"type": "image_ref", "ref": ..., "at": message number}
TEXT_TYPES = frozenset({"text", "input_text"})
IMAGE_TYPES = frozenset({"image_url", "image", "input_image"})
# where an image part of type "image" keeps its reference, in the order they are looked for
IMAGE_KEYS = ("image", "path", "url", "image_url", "base64")
UNCARRIED_TYPES = {"video_url": RejectCode.VIDEO_PART, "video": RejectCode.VIDEO_PART,
                   "input_audio": RejectCode.AUDIO_PART, "audio_url": RejectCode.AUDIO_PART,
                   "audio": RejectCode.AUDIO_PART, "file": RejectCode.FILE_PART, "input_file": RejectCode.FILE_PART}
PART_TYPES = TEXT_TYPES | IMAGE_TYPES | set(UNCARRIED_TYPES) | {IMAGE_REF}


def image_ref(ref: Any) -> dict[str, Any]:
    return {"type": IMAGE_REF, "ref": ref}


def is_placeholder(part: dict[str, Any]) -> bool:
    return part["type"] == IMAGE_REF and part["ref"] is None


def is_part_list(content: Any) -> bool:
    """A list of content parts (every item an object whose `type` is a part type): a tool result that is one is
    read as parts; any other list or object is a structured result, sent as its JSON text."""
    return isinstance(content, (list, tuple)) and bool(content) and all(
        isinstance(p, dict) and p.get("type") in PART_TYPES for p in content)


def read_parts(content: list | tuple, i: int, tally: Tally) -> list[dict[str, Any]]:
    """The parts of message i as text parts, image references and images already read; raises InvalidRecord for a
    part regen cannot carry."""
    out = []
    for k, part in enumerate(content, start=1):
        if not isinstance(part, dict):
            raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                f"message {i}: part {k} is a {type(part).__name__}, not a content part object")
        kind = part.get("type")
        if kind in TEXT_TYPES:
            text = part.get("text")
            if text is not None and not isinstance(text, str):
                raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                    f"message {i}: text part {k} holds a {type(text).__name__}, not a string")
            _count_extra(part, ("type", "text"), "part", tally)
            out.append({"type": "text", "text": text or ""})
        elif kind == IMAGE_REF:  # read already (image_records.py), or a source's own: a reference, checked later
            out.append(part if "ref" in part else image_ref(None))
        elif kind in IMAGE_TYPES:
            out.append(image_ref(_reference(part, kind, tally)))
        elif kind in UNCARRIED_TYPES:
            what = "video is out of scope" if UNCARRIED_TYPES[kind] is RejectCode.VIDEO_PART else \
                "regen sends text and images only"
            raise InvalidRecord(UNCARRIED_TYPES[kind], f"message {i}: part {k} is a {kind} part ({what}); it is "
                                                       "never sent as text")
        else:
            raise InvalidRecord(RejectCode.UNKNOWN_PART,
                                f"message {i}: part {k} is of type {kind!r}, which regen does not read (it reads "
                                "text and image parts)")
    return out


def _reference(part: dict[str, Any], kind: str, tally: Tally) -> Any:
    """The image reference an image part holds (None: a placeholder)."""
    if kind == "image":
        key = next((key for key in IMAGE_KEYS if part.get(key) is not None), None)
    else:  # image_url, input_image
        key = "image_url" if part.get("image_url") is not None else None
    _count_extra(part, ("type", key), "part", tally)
    if key is None:
        return None
    value = part[key]
    if key == "base64" and isinstance(value, str):  # transformers' raw base64, without the data: prefix
        return f"data:;base64,{value}"
    if key == "image_url" and isinstance(value, dict) and "bytes" not in value:  # {"url", "detail", ...}
        _count_extra(value, ("url",), "part.image_url", tally)
        return value.get("url")
    return value


def _count_extra(obj: dict[str, Any], used: tuple[Any, ...], prefix: str, tally: Tally) -> None:
    for key, value in obj.items():
        if key not in used and value is not None:
            tally.uncarry(f"{prefix}.{key}")
