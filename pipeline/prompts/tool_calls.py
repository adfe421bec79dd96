"""Tool calls in normalised form (OpenAI's), and their canonical JSON text. Pure: no I/O.

- a call: `{"id": str, "type": "function", "function": {"name": str, "arguments": str}}`, `arguments` the
  canonical JSON text of an object (orjson, sorted keys);
- `tools`: a tuple of `{"type": "function", "function": {"name", ...}}`, or None (never empty);
- a call without an id gets `functions.NAME:IDX` (Kimi-K2's convention, as SGLang's KimiK2Detector makes them;
  IDX counts the calls of the conversation from 0).

Messages go into Parquet with `tool_calls` as canonical JSON text (`message_row`) and come back as dicts with
only the keys that are present (`message_from_row`), so a tool-free message is `{"role", "content"}` again. A
content that is a list of parts (core/images.py) is stored as PART rows (`parts`, `content` null) and comes back
as that list, each part with only the keys it has.
"""
from __future__ import annotations

import ast
from typing import Any, Iterable, Mapping

import orjson

from ..core.images import is_parts
from .records import InvalidRecord, RejectCode, Tally

TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")  # the message keys beyond role and content
PART_KEYS = ("type", "text", "sha256", "media_type", "width", "height", "bytes", "path")  # store/schema.py PART


def canonical_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def tools_json(tools: Iterable[Mapping[str, Any]] | None) -> bytes | None:
    """WorkItem.tools_json: the canonical JSON of the tools list, None when there is none."""
    return None if not tools else orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS)


def made_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def parse_loose(text: str) -> Any:
    """JSON, or a Python literal (Hermes dumps write dicts with single quotes); ValueError if neither."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        json_error = str(exc)
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as exc:
        raise ValueError(json_error) from exc


def canonical_arguments(raw: Any, where: str, tally: Tally) -> str:
    """A call's arguments as canonical JSON text of an object. A string is parsed (one more time when it holds
    a JSON string: double-encoded); an empty string or null is `{}`. Counted in `tally.tools`."""
    value = raw
    if value is None or (isinstance(value, str) and not value.strip()):
        tally.tool("empty_arguments")
        return "{}"
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidRecord(RejectCode.ARGUMENTS_NOT_JSON,
                                f"{where}: the arguments are not JSON ({exc}): {raw[:80]!r}") from exc
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
                tally.tool("double_encoded_arguments")
            except orjson.JSONDecodeError:
                pass
    if not isinstance(value, dict):
        raise InvalidRecord(RejectCode.ARGUMENTS_NOT_OBJECT,
                            f"{where}: the arguments are a JSON {type(value).__name__}, not an object")
    try:
        return canonical_json(value)
    except TypeError as exc:  # e.g. a non-string key from a Python literal
        raise InvalidRecord(RejectCode.ARGUMENTS_NOT_JSON, f"{where}: the arguments are not JSON ({exc})") from exc


def normalise_tools(raw: Any, where: str, tally: Tally) -> list[dict[str, Any]]:
    """A tools list (a list, a JSON string of one, or one tool) as OpenAI tool schemas; [] when there is none.

    A bare function schema `{"name", "description", "parameters"}` (older `functions` lists, Hermes,
    LLaMA-Factory) is wrapped as `{"type": "function", "function": ...}`; everything else is kept as given."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return []
    if isinstance(raw, str):
        try:
            raw = parse_loose(raw)
        except ValueError as exc:
            raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where} is not JSON ({exc})") from exc
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where} is a {type(raw).__name__}, not a list of tools")
    tools = []
    for k, tool in enumerate(raw, start=1):
        if isinstance(tool, str):  # a list of JSON strings, one per tool
            try:
                tool = parse_loose(tool)
            except ValueError as exc:
                raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where}: tool {k} is not JSON ({exc})") from exc
        if not isinstance(tool, dict):
            raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where}: tool {k} is a {type(tool).__name__}, not an object")
        if "function" in tool or "type" in tool:
            if tool.get("type", "function") != "function":
                raise InvalidRecord(RejectCode.BAD_TOOLS,
                                    f"{where}: tool {k} is of type {tool.get('type')!r}, not 'function'")
            tool = {**tool, "type": "function"}
        else:
            tool = {"type": "function", "function": tool}
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where}: tool {k} has no function name")
        try:
            canonical_json(tool)
        except TypeError as exc:  # e.g. a non-string key from a Python literal
            raise InvalidRecord(RejectCode.BAD_TOOLS, f"{where}: tool {k} is not JSON ({exc})") from exc
        tools.append(tool)
    return tools


def drop_arrow_nulls(value: Any, tally: Tally) -> Any:
    """Tools and call arguments read from an Arrow table (Parquet, a hub dataset) as nested structs: Arrow unifies
    a struct's keys across all rows, so every object holds every key any row had, null where it had none. Those
    nulls are taken out (counted as `arrow_nulls_removed`); JSON text columns are left as they are."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if item is None:
                tally.tool("arrow_nulls_removed")
                continue
            out[key] = drop_arrow_nulls(item, tally)
        return out
    if isinstance(value, list):
        return [drop_arrow_nulls(item, tally) for item in value]
    return value


def tool_names(tools: Iterable[Mapping[str, Any]] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}


def message_row(message: Mapping[str, Any]) -> dict[str, Any]:
    """A normalised message as a row of the MESSAGE6 struct of the prompt set and of records schema 6 (the
    schemas before it take the keys they have: a text message is the same row in each)."""
    content = message.get("content")
    row: dict[str, Any] = {"role": message["role"], "content": None if is_parts(content) else content,
                           "parts": [{key: part.get(key) for key in PART_KEYS} for part in content]
                           if is_parts(content) else None}
    calls = message.get("tool_calls")
    row["tool_calls"] = canonical_json(list(calls)) if calls else None
    row["tool_call_id"] = message.get("tool_call_id")
    row["name"] = message.get("name")
    return row


def message_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A MESSAGE struct row (of any version) as the normalised message: tool keys only when present; a content of
    parts as the list of its parts, each with the keys it has."""
    parts = row.get("parts")
    content = ([{key: value for key, value in part.items() if value is not None} for part in parts]
               if parts is not None else row.get("content"))
    message: dict[str, Any] = {"role": row["role"], "content": content}
    if row.get("tool_calls"):
        message["tool_calls"] = orjson.loads(row["tool_calls"])
    for key in ("tool_call_id", "name"):
        if row.get(key) is not None:
            message[key] = row[key]
    return message


def has_tool_fields(messages: Iterable[Mapping[str, Any]]) -> bool:
    return any(key in m for m in messages for key in TOOL_MESSAGE_KEYS)
