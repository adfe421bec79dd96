"""The tool-calling shapes of downloaded data, turned into raw OpenAI messages (checked later by `normalise`).

- OpenAI: assistant `tool_calls`; the older `function_call` key and `function` role.
- ShareGPT Hermes function calling: the schema inside `<tools>` in the system turn, calls as
  `<tool_call>{json}</tool_call>` in gpt turns, results as `<tool_response>...</tool_response>` in tool turns.
- `function_call` / `observation` turns (LLaMA-Factory's sharegpt tags): the call as JSON
  (`{"name", "arguments"}` or a list of them for parallel calls), the result as the turn's text.

A raw call here is `{"name", "arguments"}` (with `id` when the source gave one) or OpenAI's nested form; ids
are made, arguments parsed and results matched by `normalise`.
"""
from __future__ import annotations

import re
from typing import Any

from .records import InvalidRecord, RejectCode, Tally
from .tool_calls import canonical_json, normalise_tools, parse_loose

TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
TOOL_RESPONSE_BLOCK = re.compile(r"<tool_response>(.*?)(?:</tool_response>|$)", re.DOTALL)
RESULT_ROLES = {"tool", "function", "observation", "ipython"}  # ipython: Llama 3.1's tool results
CALL_ROLES = {"function_call", "tool_call"}


def role_of(raw: Any) -> Any:
    return raw.strip().lower() if isinstance(raw, str) else raw


def hermes_tools(messages: list[dict[str, Any]], tally: Tally) -> list[dict[str, Any]]:
    """The tools of a `<tools>` block in the first (system) message, which is taken out of its text (the
    target's own template renders the tools). [] when there is no such block."""
    if not messages or role_of(messages[0]["role"]) != "system" or not isinstance(messages[0]["content"], str):
        return []
    # the Hermes preamble itself names the empty tags ("within <tools></tools> XML tags"): that mention stays
    found = next((b for b in TOOLS_BLOCK.finditer(messages[0]["content"]) if b.group(1).strip()), None)
    if found is None:
        return []
    inner = found.group(1).strip()
    where = "the <tools> block of the system turn"
    try:
        tools = normalise_tools(inner, where, tally)
    except InvalidRecord:
        # Hermes templates also write one JSON object per line
        lines = [line for line in inner.splitlines() if line.strip()]
        tools = normalise_tools(lines, where, tally)
    text = messages[0]["content"]
    messages[0] = {**messages[0], "content": (text[:found.start()].rstrip() + "\n" + text[found.end():].lstrip()).strip()}
    tally.tool("hermes_tools_blocks_moved")
    return tools


def _call_from_json(text: str, where: str) -> list[dict[str, Any]]:
    try:
        value = parse_loose(text.strip())
    except ValueError as exc:
        raise InvalidRecord(RejectCode.ARGUMENTS_NOT_JSON, f"{where} is not JSON ({exc}): {text.strip()[:80]!r}")
    calls = value if isinstance(value, list) else [value]
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"{where} is not a call with a name: {text.strip()[:80]!r}")
    return [{"name": c["name"], "arguments": c.get("arguments", c.get("parameters"))} for c in calls]


def _hermes_calls(message: dict[str, Any], i: int, tally: Tally) -> dict[str, Any]:
    """The `<tool_call>` blocks of an assistant turn as its calls, the rest of its text as its content. An OpenAI
    assistant message holds its text before its calls, so text written after the first block moves before the
    calls: counted as `hermes_text_after_call`."""
    text = message["content"]
    if not isinstance(text, str) or "<tool_call>" not in text:
        return message
    calls = []
    blocks = list(TOOL_CALL_BLOCK.finditer(text))
    for block in blocks:
        calls += _call_from_json(block.group(1), f"message {i}: a <tool_call>")
    if TOOL_CALL_BLOCK.sub("", text[blocks[0].start():]).strip():
        tally.tool("hermes_text_after_call")
    rest = TOOL_CALL_BLOCK.sub("", text).strip()
    return {**message, "content": rest or None, "tool_calls": calls}


def _response_text(inner: str) -> str:
    """A `<tool_response>` block's result as written: only the layout's own newline after the opening tag and
    before the closing one is not the result's (Hermes and Qwen templates write `<tool_response>\n...\n</tool_response>`
    around the result); nothing else is stripped."""
    inner = inner[1:] if inner.startswith("\n") else inner
    return inner[:-1] if inner.endswith("\n") else inner


def _hermes_results(message: dict[str, Any], tally: Tally) -> list[dict[str, Any]]:
    """One tool message per `<tool_response>` block (the whole text when it has none); a block naming its tool
    (`{"name": ..., "content": ...}`) gives the result's name. Text outside the blocks is not sent: counted as
    `hermes_text_outside_response` (once per message)."""
    text = message["content"]
    if not isinstance(text, str) or "<tool_response>" not in text:
        return [message]
    if TOOL_RESPONSE_BLOCK.sub("", text).strip():
        tally.tool("hermes_text_outside_response")
    out = []
    for block in TOOL_RESPONSE_BLOCK.finditer(text):
        inner = _response_text(block.group(1))
        result = {"role": "tool", "content": inner}
        try:
            parsed = parse_loose(inner)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            result["name"] = parsed["name"]
        out.append(result)
    return out


def expand(messages: list[dict[str, Any]], hermes: bool, tally: Tally) -> list[dict[str, Any]]:
    """Turn every tool-calling shape of one conversation into raw OpenAI messages."""
    out: list[dict[str, Any]] = []
    last_calls = 0  # calls of the latest call step, to split one observation that holds all their results
    for i, m in enumerate(messages, start=1):
        role = role_of(m["role"])
        if role in CALL_ROLES:  # LLaMA-Factory: the turn's text is the call
            content = m["content"]
            if isinstance(content, (dict, list)):  # a column read from Parquet may hold the call itself
                content = canonical_json(content)
            if not isinstance(content, str):
                raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"message {i} ({role}) is not a call")
            calls = _call_from_json(content, f"message {i} ({role})")
            m = {"role": "assistant", "content": None, "tool_calls": calls}
            tally.tool("function_call_turns")
        elif "function_call" in m:  # OpenAI's older single call
            fc = m["function_call"]
            if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise InvalidRecord(RejectCode.BAD_TOOL_CALL, f"message {i}: function_call has no name")
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = list(m.get("tool_calls") or []) + [{"name": fc["name"],
                                                                  "arguments": fc.get("arguments")}]
            tally.tool("legacy_function_calls")
        elif hermes and role in ("gpt", "assistant") and not m.get("tool_calls"):
            m = _hermes_calls(m, i, tally)
        if role in RESULT_ROLES:
            if role == "function":
                tally.tool("legacy_function_results")
            results = _hermes_results(m, tally) if hermes and "tool_call_id" not in m else [m]
            if (len(results) == 1 and last_calls > 1 and role == "observation"
                    and isinstance(m["content"], str)):
                results = _split_observation(m, last_calls, tally)
            for r in results:
                out.append({**r, "role": "tool"})
            continue
        if m.get("tool_calls"):
            last_calls = len(m["tool_calls"]) if isinstance(m["tool_calls"], list) else 0
        out.append(m)
    return out


def _split_observation(message: dict[str, Any], n: int, tally: Tally) -> list[dict[str, Any]]:
    """LLaMA-Factory writes the results of n parallel calls as one observation holding a JSON list of n; a result
    that is not a string is sent as its JSON text (counted as `structured_results_as_json`)."""
    try:
        value = parse_loose(message["content"])
    except ValueError:
        return [message]
    if not isinstance(value, list) or len(value) != n:
        return [message]
    tally.tool("structured_results_as_json", sum(not isinstance(v, str) for v in value))
    return [{**message, "content": v if isinstance(v, str) else canonical_json(v)} for v in value]


def is_hermes(messages: list[dict[str, Any]], tools_found: bool) -> bool:
    """Parse `<tool_call>` blocks in assistant text only when the conversation declares tools or has tool
    results (a chat that merely mentions the tag stays text)."""
    return tools_found or any(role_of(m["role"]) in RESULT_ROLES for m in messages)
