"""Format adapters: one record of a source format -> raw OpenAI messages and its tools list.

Roles and contents are checked by `normalise`; an adapter only finds the messages (and tools) in the record.
The readers' rule: every field of a record that shapes what the model sees is carried or counted by name. An
adapter carries the fields it knows (`carried_keys`) and counts every other non-empty key of the record
(`record.KEY`) and of each message (`message.KEY`) in the record's Tally (docs/sources-tool-calls.md).
A record's images field (`image`/`images`, or the spec's `image_field`), in any format, puts its images into the
user turns as image references (image_records.py); they are read after `normalise` (images.py).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from .image_records import image_fields, record_images, with_images
from .records import InvalidRecord, RejectCode, Tally
from .schema_dialect import checked_tools, looks_like_tools
from .tool_calls import drop_arrow_nulls, normalise_tools
from .transcript import looks_like_transcript
from .toolformats import CALL_ROLES, RESULT_ROLES, expand, hermes_tools, is_hermes, role_of

if TYPE_CHECKING:
    from .spec import SourceSpec


def _invalid(code: str, reason: str) -> InvalidRecord:
    return InvalidRecord(RejectCode(code), reason)


TOOLS_KEYS = ("tools", "functions")  # top-level keys holding the tools list (OpenAI's current and older names)
MESSAGE_TOOL_KEYS = ("tool_calls", "function_call", "tool_call_id")
ARROW_KINDS = ("parquet", "hf")  # records come from Arrow tables, whose structs are unified across rows
OUTPUT_KEY = "output"  # input_output: the reply to the `input` messages (Nemotron post-training)
ANSWER_KEY = "answer"  # question_answer: the reply to the question (GSM8K)
PLAIN_ROLES = frozenset({"human", "gpt", "user", "assistant", "system"})  # spelled as they are most often


def to_messages(spec: "SourceSpec", data: Any) -> list[dict[str, Any]]:
    """Turn one record into raw messages; roles and contents are checked by `normalise`."""
    return to_conversation(spec, data, Tally())[0]


def to_conversation(spec: "SourceSpec", data: Any, tally: Tally) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One record as (raw messages, tools: [] when it has none); what it does not carry is counted in `tally`."""
    if not isinstance(data, dict):
        raise _invalid("not_object", f"the record is a JSON {json_type(data)}, not an object")
    field = spec.conversation_field
    if "." in field and field not in data:  # a path into objects and lists (`question.0`)
        data = at_path(data, field)
    if spec.format in ("sharegpt", "openai"):
        messages, tools = _conversation(data, field, spec.format, tally, arrow=spec.kind in ARROW_KINDS,
                                        tools_keys=tools_keys(spec))
    elif spec.format == "alpaca":
        messages, tools = _alpaca(data, field), _named_tools(spec, data, tally)
        _transcript(data, field, tally)
    elif spec.format == "prompt":
        messages, tools = _prompt(data, field), _named_tools(spec, data, tally)
        _transcript(data, field, tally)
    elif spec.format == "input_output":
        messages, tools = _input_output(data, field, tally, arrow=spec.kind in ARROW_KINDS,
                                        tools_keys=tools_keys(spec))
    elif spec.format == "question_answer":
        messages, tools = _question_answer(data, field), _named_tools(spec, data, tally)
        _transcript(data, field, tally)
    else:
        raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}")
    images = record_images(spec, data)
    if images is not None:
        messages = with_images(messages, images[0], images[1], tally)
    if tools:
        tools = checked_tools(tools, spec.schema_dialect, tally)
    carried = carried_keys(spec)
    for key in data:
        if key not in carried and not _empty(data[key]):
            tally.uncarry(f"record.{key}")
            if looks_like_tools(data[key]):  # only for a field not carried: a few checks, then usually out
                tally.tool_like[key] = tally.tool_like.get(key, 0) + 1
    return messages, tools


def _transcript(data: dict, field: str, tally: Tally) -> None:
    """A one-prompt format's field whose text is a whole conversation: counted by field, sent as it stands
    (transcript.py; cheap first, and never run for the formats of messages)."""
    if looks_like_transcript(data[field]):
        tally.transcripts[field] = 1


def at_path(data: dict, path: str) -> dict:
    """The record with its dotted `path` (`question.0`: key `question`, then item 0 of its list) read into the key
    `path` itself, where every step exists; else the record as it is (the field is then missing)."""
    value: Any = data
    for step in path.split("."):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, (list, tuple)) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            return data
    return {**data, path: value}


def _named_tools(spec: "SourceSpec", data: dict, tally: Tally) -> list[dict[str, Any]]:
    """The tools of a one-prompt format (prompt, alpaca, question_answer): only from the spec's `tools_field`
    (xlam's `tools`), so a source without it reads as it always did."""
    if spec.tools_field is None or data.get(spec.tools_field) is None:
        return []
    value = data[spec.tools_field]
    if spec.kind in ARROW_KINDS:
        value = drop_arrow_nulls(value, tally)
    return _unique(normalise_tools(value, f"the {spec.tools_field!r} field", tally), tally)


def tools_keys(spec: "SourceSpec") -> tuple[str, ...]:
    return TOOLS_KEYS + ((spec.tools_field,) if spec.tools_field and spec.tools_field not in TOOLS_KEYS else ())


@functools.lru_cache(maxsize=64)
def carried_keys(spec: "SourceSpec") -> frozenset[str]:
    """The top-level keys of a record that the spec's format reads (the others are counted, never dropped
    silently)."""
    keys = ({spec.conversation_field, spec.conversation_field.split(".")[0]} | set(spec.ignore_fields)
            | ({spec.id_field} if spec.id_field else set()) | set(image_fields(spec)))
    if spec.format in ("sharegpt", "openai"):
        return frozenset(keys | set(tools_keys(spec)))
    if spec.format == "input_output":
        return frozenset(keys | set(tools_keys(spec)) | {OUTPUT_KEY})
    keys |= {spec.tools_field} if spec.tools_field else set()
    if spec.format == "question_answer":
        return frozenset(keys | {ANSWER_KEY})
    if spec.format == "alpaca":
        return frozenset(keys | {"input", "output"})
    return frozenset(keys | {"system"})


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def source_ref(spec: "SourceSpec", data: Any) -> str | None:
    """The value of the source's id field, kept for traceability only."""
    if spec.id_field is None or not isinstance(data, dict) or data.get(spec.id_field) is None:
        return None
    return str(data[spec.id_field])


def _conversation(data: dict, field: str, fmt: str, tally: Tally, arrow: bool = False,
                  tools_keys: tuple[str, ...] = TOOLS_KEYS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    plain = True  # only role and content, and no role of the tool shapes: nothing to expand
    for i, item in enumerate(conv, start=1):
        if not isinstance(item, dict):
            raise _invalid("bad_message", f"message {i} is a {json_type(item)}, not an object")
        rk, ck = other if primary[0] not in item and other[0] in item else primary
        if rk not in item:
            raise _invalid("bad_message", f"message {i} has no role ({rk!r} is missing)")
        if len(item) == 2 and ck in item:  # the common case, kept fast
            role = item[rk]
            out.append({"role": role, "content": item[ck]})
            plain = plain and role in PLAIN_ROLES
            continue
        plain = False
        message = _message(i, item, rk, ck, tally)
        if arrow and isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = drop_arrow_nulls(message["tool_calls"], tally)
        out.append(message)
    tools: list[dict[str, Any]] = []
    for key in tools_keys:
        if data.get(key) is not None:
            value = drop_arrow_nulls(data[key], tally) if arrow else data[key]
            tools += normalise_tools(value, f"the {key!r} field", tally)
    if plain and not tools and not (isinstance(out[0]["content"], str) and "<tools>" in out[0]["content"]):
        return out, []
    block = hermes_tools(out, tally)  # Hermes, in ShareGPT or in OpenAI spelling
    tools += block
    out = expand(out, is_hermes(out, bool(tools)), tally)
    return out, _unique(tools, tally)


def _message(i: int, item: dict, rk: str, ck: str, tally: Tally) -> dict[str, Any]:
    """A message with keys beyond role and content: the tool keys are carried, the others counted."""
    calls = any(item.get(key) is not None for key in ("tool_calls", "function_call"))
    if ck not in item and not calls:  # OpenAI leaves `content` out of a pure call
        raise _invalid("bad_message", f"message {i} has no content ({ck!r} is missing)")
    message = {"role": item[rk], "content": item.get(ck)}
    carried = {rk, ck}
    for key in MESSAGE_TOOL_KEYS:
        if item.get(key) is not None:
            message[key] = item[key]
            carried.add(key)
    if role_of(item[rk]) in RESULT_ROLES | CALL_ROLES and item.get("name") is not None:
        message["name"] = item["name"]  # the tool a result answers (a user's `name` is not carried)
        carried.add("name")
    for key in item:
        if key not in carried and not _empty(item[key]):
            tally.uncarry(f"message.{key}")
    return message


def _unique(tools: list[dict[str, Any]], tally: Tally) -> list[dict[str, Any]]:
    """One schema per tool name: the first (a `tools` column and a `<tools>` block may both name a tool)."""
    seen, out = set(), []
    for tool in tools:
        name = tool["function"]["name"]
        if name in seen:
            tally.tool("repeated_tool_schemas")
            continue
        seen.add(name)
        out.append(tool)
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


def _input_output(data: dict, field: str, tally: Tally, arrow: bool = False,
                  tools_keys: tuple[str, ...] = TOOLS_KEYS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`input`: the conversation so far as `role`/`content` messages; `output`: the assistant's reply to it (as
    speculators' `_normalize_nemotron` joins them)."""
    messages, tools = _conversation(data, field, "openai", tally, arrow, tools_keys)
    reply = _reply(data, OUTPUT_KEY)
    return (messages + [reply] if reply else messages), tools


def _question_answer(data: dict, field: str) -> list[dict[str, Any]]:
    """A question as the user turn, its answer as the reference reply (as both libraries' GSM8K loaders do)."""
    if field not in data or data[field] is None:
        raise _invalid("missing_field", f"the record has no question field {field!r}")
    if not isinstance(data[field], str):
        raise _invalid("non_string_content", f"the field {field!r} is a {json_type(data[field])}, not a string")
    reply = _reply(data, ANSWER_KEY)
    return [{"role": "user", "content": data[field]}] + ([reply] if reply else [])


def _reply(data: dict, key: str) -> dict[str, Any] | None:
    """The assistant message of a reply field; None when the field is absent or blank (no reference)."""
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _invalid("non_string_content", f"the field {key!r} is a {json_type(value)}, not a string")
    return {"role": "assistant", "content": value} if value and value.strip() else None


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
