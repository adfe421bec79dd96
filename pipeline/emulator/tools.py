"""Tool calls as Kimi-K2 writes them and SGLang serves them (serving_chat.py, function_call/kimik2_detector.py).

- The prompt: with `tools` (and tool_choice not "none": SGLang renders no tools then) the template starts with a
  `tool_declare` system turn holding the tools' JSON; an assistant turn with calls renders them in Kimi's markup,
  a tool result as `## Return of ID`. (Kimi's own template is on the hub, not here: the layout is Kimi's as its
  tool-call guide shows it, unverified byte for byte.)
- The output: the model writes
  `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>`
  after its reasoning, IDX counting the calls of the whole conversation from 0; the tokens are in the output ids.
- The answer: with `--tool-call-parser kimi_k2` SGLang cuts the calls out of the content into `tool_calls`, each
  id `functions.NAME:` + (the calls in the history + the call's index), and a `stop` finish becomes `tool_calls`
  (matched_stop null). Before 0.5.17 the index is the number the model wrote, so the history is counted twice.
  What it does with a call cut at max_tokens, or whose arguments are not an object, streamed and not, per
  version: kimi_parser.py. Without a tool-call parser SGLang refuses nothing: the calls stay in the content as text. tool_choice
  "required" without a parser is met by a JSON-schema constraint: the content is a JSON array of
  {"name", "parameters"}.

When does the emulated model call? tool_choice "required" (or a named function): always; "auto": when the last
message is the user's (after tool results it answers in text); "none": never. It calls each tool whose name the
last user message mentions, in the order mentioned (several: parallel calls), else the first tool; arguments fill
the schema's required properties (all when none is required) with values drawn from the prompt. A tool whose
`parameters` schema is not an object (`{"type": "array", ...}`) gets arguments of that type: how the emulated
model writes a call whose arguments are not a JSON object (SGLang drops it unstreamed, streams it from 0.5.17).
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Any

import orjson

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# Kimi-K2's ids of its tool-call tokens (its tokenizer_config.json on the hub; not verifiable here).
TOOL_SPECIAL = {SECTION_BEGIN: 163595, SECTION_END: 163596, CALL_BEGIN: 163597, ARGUMENT_BEGIN: 163598,
                CALL_END: 163599}
KIMI_PARSERS = ("kimi_k2",)  # the parsers that read this markup (SGLang's ToolCallParserEnum name)
# KimiK2Detector numbers the calls of one answer from 0 (before: the model's IDX); the same versions' parser is
# kimi_parser.py's `modern` one
LOCAL_INDEX_FROM = (0, 5, 17)

# The pseudo-tokenizer's tokens with the whitespace before each (model._TOKEN_RE drops it): pieces that join back
# into the text.
_PIECE_RE = re.compile(r"\s*(?:<\|[a-z_]+\|>|</?think>|\w+|[^\w\s])")
_VALUES = ("Paris", "Berlin", "Tokyo", "blue", "seven", "alpha", "north", "river")


def active_tools(req: dict) -> list[dict] | None:
    """The tools the template renders and the model may call: none with tool_choice "none" (SGLang renders
    none then); a named function keeps that one."""
    tools = req.get("tools")
    if not tools:
        return None
    choice = req.get("tool_choice") or "auto"
    if choice == "none":
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        return [t for t in tools if _name(t) == wanted] or None
    return list(tools)


def _name(tool: dict) -> str:
    return str((tool.get("function") or {}).get("name") or "")


def history_calls(messages: list[dict]) -> int:
    """SGLang's _get_history_tool_calls_cnt: the calls of the assistant turns sent."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


# --- the prompt --------------------------------------------------------------------------------------------------
def render_tools(tools: list[dict]) -> str:
    return f"<|im_system|>tool_declare<|im_middle|>{orjson.dumps(tools).decode()}<|im_end|>"


def render_calls(tool_calls: list[dict]) -> str:
    """An assistant turn's calls in Kimi's markup (their ids as sent)."""
    body = "".join(f"{CALL_BEGIN}{c.get('id') or ''}{ARGUMENT_BEGIN}{_arguments_text(c)}{CALL_END}"
                   for c in tool_calls)
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


def _arguments_text(call: dict) -> str:
    arguments = (call.get("function") or {}).get("arguments")
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments or {}).decode()


def result_header(message: dict) -> str:
    return f"## Return of {message['tool_call_id']}\n" if message.get("tool_call_id") else ""


# --- what the model writes ---------------------------------------------------------------------------------------
def plan_calls(req: dict, tools: list[dict] | None) -> list[tuple[str, Any]] | None:
    """(name, arguments) of each call the model makes, or None when it answers in text."""
    if not tools:
        return None
    messages = req.get("messages") or []
    choice = req.get("tool_choice") or "auto"
    if choice == "auto" and messages and messages[-1].get("role") != "user":
        return None
    last_user = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    mentioned = sorted((last_user.find(_name(t)), i) for i, t in enumerate(tools)
                       if _name(t) and _name(t) in last_user)
    chosen = [tools[i] for _, i in mentioned] or tools[:1]
    rng = random.Random(hashlib.blake2b(orjson.dumps(messages), digest_size=8).digest())
    return [(_name(t), _arguments(t, rng)) for t in chosen]


def _arguments(tool: dict, rng: random.Random) -> Any:
    schema = (tool.get("function") or {}).get("parameters") or {}
    if schema.get("type", "object") != "object":
        return _value(schema, rng)
    properties = schema.get("properties") or {}
    keys = schema.get("required") or list(properties)
    return {key: _value(properties.get(key) or {}, rng) for key in keys}


def _value(spec: dict, rng: random.Random) -> Any:
    if spec.get("enum"):
        return spec["enum"][0]
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind in ("integer", "number"):
        return rng.randint(1, 9)
    if kind == "boolean":
        return True
    if kind == "array":
        return [_value(spec.get("items") or {}, rng)]
    if kind == "object":
        return {}
    return rng.choice(_VALUES)


def kimi_call_text(plan: list[tuple[str, dict]], first_index: int) -> str:
    """Kimi's markup for the planned calls; IDX counts the conversation's calls from `first_index`."""
    calls = [{"id": f"functions.{name}:{first_index + k}", "function": {"arguments": orjson.dumps(arguments).decode()}}
             for k, (name, arguments) in enumerate(plan)]
    return render_calls(calls)


def json_array_text(plan: list[tuple[str, dict]]) -> str:
    """What tool_choice "required" without a tool-call parser gets: SGLang's JSON-schema constraint's array."""
    return orjson.dumps([{"name": name, "parameters": arguments} for name, arguments in plan]).decode()


def text_pieces(text: str) -> list[str]:
    """The pseudo-tokenizer's tokens of a text, each with the whitespace before it."""
    return _PIECE_RE.findall(text)
