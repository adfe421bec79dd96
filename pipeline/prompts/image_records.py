"""The images of a record: a field beside its conversation (`image` or `images`: LLaVA-Instruct, ShareGPT4V,
ALLaVA, TRL's datasets), put into its user turns as image references (parts.py). Pure: nothing is read here.

The field holds one reference or a list of them (a path, a URL, a `datasets` Image value). The user turns say
where each goes: a `<image>` marker in their text (and the newline LLaVA writes right after it) or an image part
with nothing in it (`{"type": "image"}`) takes the next image, in order. A record whose turns have no marker gets
its images before the first user text, as LLaVA's preprocessing puts them. More or fewer markers than images
rejects the record (`image_marker_mismatch`). A record without the field is a text prompt exactly as before (a
`<image>` in its text is text); one whose field is present but empty has no images, and a marker in it is a
mismatch (an image the record lost).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .images import shown
from .normalise import ROLE_MAP
from .parts import image_ref, is_placeholder, read_parts
from .records import InvalidRecord, RejectCode, Tally

if TYPE_CHECKING:
    from .spec import SourceSpec

MARKER = "<image>"
DEFAULT_FIELDS = ("image", "images")


def image_fields(spec: "SourceSpec") -> tuple[str, ...]:
    return (spec.image_field,) if spec.image_field else DEFAULT_FIELDS


def record_images(spec: "SourceSpec", data: dict[str, Any]) -> tuple[str, list[Any]] | None:
    """(the images field, its references in order) of a record, or None when it has no images field."""
    if not spec.image_field and "image" not in data and "images" not in data:  # a text record, quickly
        return None
    fields = [f for f in image_fields(spec) if f in data]
    if not fields:
        return None
    full = [f for f in fields if not _empty(data[f])]
    if len(full) > 1:
        raise InvalidRecord(RejectCode.IMAGE_MARKER_MISMATCH,
                            f"the record has images under both {full[0]!r} and {full[1]!r}: set the spec's "
                            "`image_field` to the one that goes with the conversation")
    field = full[0] if full else fields[0]
    value = data[field]
    if value is None:
        return field, []
    return field, list(value) if isinstance(value, (list, tuple)) else [value]


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple, str)) and not value)


def _is_user(role: Any) -> bool:
    return isinstance(role, str) and (ROLE_MAP.get(role) or ROLE_MAP.get(role.strip().lower())) == "user"


def with_images(messages: list[dict[str, Any]], field: str, refs: list[Any], tally: Tally) -> list[dict[str, Any]]:
    """The raw messages with the record's images in their user turns (see the module's docstring)."""
    users = [k for k, m in enumerate(messages) if _is_user(m.get("role"))]
    parts: dict[int, list[dict[str, Any]]] = {}  # list contents of user turns, read
    slots = 0
    for k in users:
        content = messages[k].get("content")
        if isinstance(content, str):
            slots += content.count(MARKER)
        elif isinstance(content, (list, tuple)):
            parts[k] = read_parts(content, k + 1, tally)
            slots += sum(map(is_placeholder, parts[k]))
    if not refs and not slots:
        return messages
    if slots and slots != len(refs):
        held = f" ({', '.join(shown(ref) for ref in refs[:4])}{', ...' if len(refs) > 4 else ''})" if refs else ""
        raise InvalidRecord(RejectCode.IMAGE_MARKER_MISMATCH,
                            f"the user turns hold {slots} <image> marker{'s' if slots != 1 else ''} (or empty image "
                            f"parts), and the record's {field!r} field {len(refs)} "
                            f"image{'s' if len(refs) != 1 else ''}{held}")
    if not users:  # nowhere to put them: normalise rejects the record (no user turn)
        return messages
    out = list(messages)
    if not slots:  # before the first user text, as LLaVA does
        k = users[0]
        content = parts.get(k, out[k].get("content"))
        rest = [{"type": "text", "text": content}] if isinstance(content, str) and content else list(content or ())
        out[k] = {**out[k], "content": [image_ref(ref) for ref in refs] + rest}
        tally.image("images_placed_before_text", len(refs))
        return out
    pending = iter(refs)
    for k in users:
        content = out[k].get("content")
        if isinstance(content, str) and MARKER in content:
            out[k] = {**out[k], "content": _split(content, pending)}
        elif k in parts:
            out[k] = {**out[k], "content": [image_ref(next(pending)) if is_placeholder(p) else p for p in parts[k]]}
    tally.image("images_at_markers", len(refs))
    return out


def _split(text: str, pending: Any) -> list[dict[str, Any]]:
    """A text with markers as text parts and the next images; the newline right after a marker goes with it."""
    pieces = text.split(MARKER)
    out = [{"type": "text", "text": pieces[0]}] if pieces[0].strip() else []
    for piece in pieces[1:]:
        out.append(image_ref(next(pending)))
        piece = piece[1:] if piece.startswith("\n") else piece
        if piece.strip():
            out.append({"type": "text", "text": piece})
    return out
