"""Format adapters: one record of a source format -> raw `{"role", "content"}` messages.

Roles and contents are checked by `prompt_set.normalise`; an adapter only finds the messages in the record.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from .records import InvalidRecord, RejectCode

if TYPE_CHECKING:
    from .spec import SourceSpec


def _invalid(code: str, reason: str) -> InvalidRecord:
    return InvalidRecord(RejectCode(code), reason)


def to_messages(spec: "SourceSpec", data: Any) -> list[dict[str, Any]]:
    """Turn one record into raw `{"role", "content"}` messages; roles and contents are checked by `normalise`."""
    if not isinstance(data, dict):
        raise _invalid("not_object", f"the record is a JSON {json_type(data)}, not an object")
    field = spec.conversation_field
    if spec.format in ("sharegpt", "openai"):
        return _conversation(data, field, spec.format)
    if spec.format == "alpaca":
        return _alpaca(data, field)
    if spec.format == "prompt":
        return _prompt(data, field)
    raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}")


def source_ref(spec: "SourceSpec", data: Any) -> str | None:
    """The value of the source's id field, kept for traceability only."""
    if spec.id_field is None or not isinstance(data, dict) or data.get(spec.id_field) is None:
        return None
    return str(data[spec.id_field])


def _conversation(data: dict, field: str, fmt: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise _invalid("missing_field", f"the record has no conversation field {field!r}")
    conv = data[field]
    if not isinstance(conv, list):
        raise _invalid("bad_conversation",
                       f"the conversation field {field!r} is a {json_type(conv)}, not a list of messages")
    if not conv:
        raise _invalid("empty_conversation", "the conversation is empty")
    # ShareGPT dumps sometimes use role/content inside `conversations`, and vice versa; accept both spellings.
    primary = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    other = ("role", "content") if fmt == "sharegpt" else ("from", "value")
    out = []
    for i, item in enumerate(conv, start=1):
        if not isinstance(item, dict):
            raise _invalid("bad_message", f"message {i} is a {json_type(item)}, not an object")
        rk, ck = other if primary[0] not in item and other[0] in item else primary
        if rk not in item:
            raise _invalid("bad_message", f"message {i} has no role ({rk!r} is missing)")
        if ck not in item:
            raise _invalid("bad_message", f"message {i} has no content ({ck!r} is missing)")
        out.append({"role": item[rk], "content": item[ck]})
    return out


def _alpaca(data: dict, field: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise _invalid("missing_field", f"the record has no instruction field {field!r}")
    instruction, extra, output = data[field], data.get("input"), data.get("output")
    for name, value in ((field, instruction), ("input", extra), ("output", output)):
        if value is not None and not isinstance(value, str):
            raise _invalid("non_string_content", f"the field {name!r} is a {json_type(value)}, not a string")
    text = instruction
    if extra and extra.strip():
        text = f"{instruction.strip()}\n\n{extra.strip()}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": text}]
    if output and output.strip():
        msgs.append({"role": "assistant", "content": output})
    return msgs


def _prompt(data: dict, field: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise _invalid("missing_field", f"the record has no prompt field {field!r}")
    msgs: list[dict[str, Any]] = []
    if data.get("system") is not None:
        msgs.append({"role": "system", "content": data["system"]})
    msgs.append({"role": "user", "content": data[field]})
    return msgs


def json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__
