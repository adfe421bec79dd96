"""Validation and normalisation of one conversation, and the prompt's content-addressed id.

A valid conversation: an optional system message; then user turns and assistant steps, where an assistant step
with tool calls is followed by one tool result per call (in the calls' order), then another assistant step or
the end. A tool-free message is exactly `{"role", "content"}`; tool keys appear only when present
(docs/sources-tool-calls.md).
"""
from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import orjson

from ..core.errors import ConfigError
from ..core.images import content_text, identity_content
from .parts import IMAGE_REF, is_part_list, read_parts
from .records import InvalidRecord, RejectCode, Tally
from .tool_calls import call_arguments, canonical_json, identity_calls
from .tool_steps import check_steps, count_tools

MODES = ("last_turn", "all_turns")
# ShareGPT as it is in the wild: the role names of the dumps people download (SpecForge's prepare_data maps
# the same ones); tool results under their several names.
ROLE_MAP = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown regeneration mode {mode!r} (expected one of {', '.join(MODES)})")


def prompt_id(messages: Iterable[Mapping[str, Any]], mode: str = "last_turn",
              tools: Iterable[Mapping[str, Any]] | None = None) -> str:
    """Stable id of what is sent: sha256 over sorted-key JSON of the mode and the messages, first 32 hex chars.

    In `all_turns` mode the assistant turns are regenerated, so only the system and user turns name the prompt,
    plus (when there are any) the source's calls, whose cached results are spliced in, and those results. The
    tool keys and `tools` enter the hash only when present, so a tool-free prompt keeps the id it always had. A
    content of parts is hashed as `identity_content` (an image by its sha256 alone); a string content as it is.
    """
    check_mode(mode)
    msgs = []
    for m in messages:
        content = m["content"]
        msg = {"role": m["role"], "content": identity_content(content) if type(content) is list else content}
        if len(m) > 2:
            msg.update({key: m[key] for key in ("tool_calls", "tool_call_id", "name") if m.get(key) is not None})
            if m.get("tool_calls"):
                msg["tool_calls"] = identity_calls(m["tool_calls"])
        if mode == "all_turns" and m["role"] == "assistant":
            if not m.get("tool_calls"):
                continue
            msg = {"role": "assistant", "tool_calls": msg["tool_calls"]}  # its text is regenerated
        msgs.append(msg)
    doc: dict[str, Any] = {"mode": mode, "messages": msgs}
    if tools:
        doc["tools"] = list(tools)
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


@dataclass(frozen=True)
class Normalised:
    messages: tuple[dict[str, Any], ...]  # what is sent (all_turns: the whole conversation)
    reference: str | None  # last_turn: the text of the source's final assistant step
    reference_tool_calls: str | None  # last_turn: that step's calls (canonical JSON), when it made any
    tools: tuple[dict[str, Any], ...] | None


def normalise(raw_messages: Any, mode: str = "last_turn",
              dropped: dict[str, int] | None = None) -> tuple[tuple[dict[str, Any], ...], str | None]:
    """(messages to send, reference text) of a conversation, or InvalidRecord; see `normalise_record`."""
    tally = Tally()
    result = normalise_record(raw_messages, None, mode, tally)
    if dropped is not None:
        for kind, n in tally.dropped.items():
            dropped[kind] = dropped.get(kind, 0) + n
    return result.messages, result.reference


def normalise_record(raw_messages: Any, tools: list[dict[str, Any]] | None, mode: str, tally: Tally) -> Normalised:
    """Validate and normalise a conversation and its tools. Raises InvalidRecord with the reason's code.

    Blank system messages are dropped, as are assistant steps (and their results) before the first user turn
    (SpecForge's preprocessing drops a first message that is not the user's); NUL characters are removed; under
    last_turn a blank last assistant turn (the reference a new answer replaces) is dropped. Each is counted in
    `tally.dropped` (blank_system, leading_assistant, leading_tool_result, nul, blank_reference); any other blank
    message but a tool result rejects the record. Calls without an id get `functions.NAME:IDX`."""
    check_mode(mode)
    if not isinstance(raw_messages, (list, tuple)):
        raise InvalidRecord(RejectCode.BAD_CONVERSATION, "the conversation is not a list of messages")
    if not raw_messages:
        raise InvalidRecord(RejectCode.EMPTY, "the conversation is empty")
    conv = [m for m in (_message(i, m, tally) for i, m in enumerate(raw_messages, start=1)) if m is not None]
    for k, (i, m) in enumerate(conv):
        if m["role"] == "system" and k != 0:
            raise InvalidRecord(RejectCode.SYSTEM_NOT_FIRST,
                                f"message {i} is a system message, but a system message may only come first")
    system = conv[:1] if conv and conv[0][1]["role"] == "system" else []
    body = conv[len(system):]
    leading = 0
    while leading < len(body) and body[leading][1]["role"] != "user":
        if body[leading][1]["role"] == "tool" and not any(m["role"] == "assistant" for _, m in body[:leading]):
            i = body[leading][0]
            raise InvalidRecord(RejectCode.TOOL_RESULT_WITHOUT_CALL, f"message {i} is a tool result with no call "
                                                                     "before it")
        leading += 1
    if leading:
        for _, m in body[:leading]:
            tally.drop("leading_assistant" if m["role"] == "assistant" else "leading_tool_result")
        body = body[leading:]
    if not body:
        if leading:
            raise InvalidRecord(RejectCode.NO_USER_TURN, "the conversation has no user turn")
        raise InvalidRecord(RejectCode.NOTHING_TO_SEND,
                            "the conversation has nothing to send (it has only a system message)")
    tool_steps = any(len(m) > 2 or m["role"] == "tool" for _, m in body)
    if tool_steps:
        body = check_steps(body, tally)
    else:  # the plain chat of before tool calls, checked as fast as it was
        for k, (i, m) in enumerate(body):
            expected = "user" if k % 2 == 0 else "assistant"
            if m["role"] != expected:
                raise InvalidRecord(RejectCode.NOT_ALTERNATING, f"roles do not alternate: message {i} is "
                                                                f"{m['role']} where {expected} was expected")
    if mode == "last_turn" and body[-1][1]["role"] == "assistant" and not body[-1][1].get("tool_calls") \
            and not body[-1][1]["content"]:
        tally.drop("blank_reference")  # the reference only: a new answer takes its place, so nothing is lost
        body = body[:-1]
    for i, m in body:
        if m["role"] in ("user", "assistant") and not m["content"] and not m.get("tool_calls"):
            raise InvalidRecord(RejectCode.BLANK_CONTENT, f"message {i} ({m['role']}) is blank")
    messages = [m for _, m in system + body]
    norm_tools = tuple(tools) if tools else None
    if tool_steps or norm_tools:
        count_tools(messages, norm_tools, tally)
    if mode == "all_turns":
        return Normalised(tuple(messages), None, None, norm_tools)
    reference = calls = None
    if messages[-1]["role"] == "assistant":
        last = messages.pop()
        reference = content_text(last["content"]) if type(last["content"]) is list else last["content"]
        if last.get("tool_calls"):
            calls = canonical_json(last["tool_calls"])
            tally.tool("reference_is_call")
    elif messages[-1]["role"] == "tool":
        tally.tool("ends_on_tool_result")
    return Normalised(tuple(messages), reference, calls, norm_tools)


def _message(i: int, m: Any, tally: Tally) -> tuple[int, dict[str, Any]] | None:
    """Message i with its role mapped and its content cleaned (None: a blank system message, dropped)."""
    if not (type(m) is dict or isinstance(m, Mapping)) or "role" not in m or (
            "content" not in m and not m.get("tool_calls")):
        raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} is not an object with a role and a content")
    raw_role, content = m["role"], m.get("content")
    role = None
    if isinstance(raw_role, str):
        role = ROLE_MAP.get(raw_role) or ROLE_MAP.get(raw_role.strip().lower())
    if role is None:
        raise InvalidRecord(RejectCode.UNKNOWN_ROLE, f"message {i} has an unknown role {raw_role!r}")
    calls = None
    if len(m) > 2 or role == "tool":  # tool keys: only checked where there can be any
        calls = m.get("tool_calls") if role == "assistant" else None
        if role != "assistant" and m.get("tool_calls"):
            raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"message {i} ({role}) has tool calls; only an "
                                                          "assistant step may call a tool")
        if role != "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    tally.uncarry(f"message.{key}")
        if role == "tool" and isinstance(content, (dict, list)) and not is_part_list(content):
            try:
                content = canonical_json(content)  # a structured result, as its JSON text
            except TypeError as exc:
                raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                    f"message {i} (tool) holds a result that is not JSON ({exc})") from exc
            tally.tool("structured_results_as_json")
        if content is None and calls:
            content = ""
    if type(content) is str or isinstance(content, str):
        content = _without_nul(content, tally) if role == "tool" else _clean(content, tally)
    elif isinstance(content, (list, tuple)):
        content = _parts(i, role, content, tally)
    else:
        raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                            f"message {i} ({role}) has non-string content ({type(content).__name__})")
    if not content and role == "system":
        tally.drop("blank_system")
        return None
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        if not isinstance(calls, list):
            raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"message {i}: tool_calls is not a list")
        out["content"] = content or None
        out["tool_calls"] = [_call(i, k, c, tally) for k, c in enumerate(calls, start=1)]
    if role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
        name = str(m["name"]).strip() if m.get("name") is not None else ""
        if name:  # a tool's name as a call's is read (stripped); a blank one names no tool
            out["name"] = name
    return i, out


def _without_nul(text: str, tally: Tally) -> str:
    """NUL characters removed (counted as dropped `nul`): the only change made to a tool result's text."""
    if "\x00" in text:
        tally.drop("nul", text.count("\x00"))
        text = text.replace("\x00", "")
    return text


def _clean(text: str, tally: Tally) -> str:
    """A system, user or assistant text: NUL characters removed, then stripped and NFC-normalised; each change
    counted (`whitespace_stripped`, `unicode_nfc`)."""
    text = _without_nul(text, tally)
    stripped = text.strip()
    if len(stripped) != len(text):
        tally.change("whitespace_stripped")
    if not unicodedata.is_normalized("NFC", stripped):
        stripped = unicodedata.normalize("NFC", stripped)
        tally.change("unicode_nfc")
    return stripped


def _parts(i: int, role: str, content: list | tuple, tally: Tally) -> list[dict[str, Any]] | str:
    """A content of parts: text parts cleaned as a string content is (a blank one dropped and counted), image parts
    kept; "" when nothing is left. A tool result's text parts are kept as written, blank ones too. An image in an
    assistant turn rejects the record: the target writes that turn. Counted as `messages_with_parts` (a record
    without it has no image to read)."""
    tally.image("messages_with_parts")
    out = []
    for part in read_parts(content, i, tally):
        if part["type"] == "text" and role == "tool":
            out.append({"type": "text", "text": _without_nul(part["text"], tally)})
            continue
        if part["type"] == "text":
            text = _clean(part["text"], tally)
            if text:
                out.append({"type": "text", "text": text})
            else:
                tally.drop("blank_text_part")
            continue
        if role == "assistant":
            raise InvalidRecord(RejectCode.IMAGE_IN_ASSISTANT_TURN,
                                f"message {i} (assistant) holds an image: images are read in user, system and tool "
                                "messages (an assistant turn is what the target writes)")
        out.append({**part, "at": i} if part["type"] == IMAGE_REF else part)
    return out or ""


def _call(i: int, k: int, raw: Any, tally: Tally) -> dict[str, Any]:
    """A raw call (OpenAI's nested form, or flat `{"name", "arguments"}`) in OpenAI's form; its id may be None
    here (made in tool_steps.check_steps, which knows the call's index in the conversation)."""
    where = f"message {i}, call {k}"
    if not isinstance(raw, dict):
        raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"{where} is a {type(raw).__name__}, not an object")
    fn = raw.get("function", raw)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"{where} has no function name")
    for key in set(raw) - {"id", "type", "function", "name", "arguments", "index"}:
        tally.uncarry(f"tool_call.{key}")
    if fn is not raw:
        for key in set(fn) - {"name", "arguments"}:
            tally.uncarry(f"tool_call.function.{key}")
    call_id = raw.get("id")
    return {"id": str(call_id) if call_id not in (None, "") else None, "type": "function",
            "function": {"name": fn["name"].strip(), "arguments": call_arguments(fn.get("arguments"), where,
                                                                                      tally)}}
