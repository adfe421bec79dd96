"""What SGLang's kimi_k2 tool-call parser makes of the text the emulated Kimi wrote, streamed and not, per version.

A port of KimiK2Detector (sglang/srt/function_call/kimik2_detector.py) and of the serving code around it
(serving_chat.py: `_process_tool_calls`, `_process_tool_call_stream`, `_check_for_unstreamed_tool_args`, the
stream's last finish_reason), checked against each version's own code on the emulator's text by
tests/test_sglang_conformance.py (tests/conformance/sglang_tool_checks.py). Two generations of the parser:

- 0.5.17 and later (`modern`, the versions whose detector numbers an answer's calls from 0):
  - not streamed: the content is the text before `<|tool_calls_section_begin|>`, whatever follows it; the calls are
    the complete ones (`<|tool_call_begin|>ID<|tool_call_argument_begin|>{...}<|tool_call_end|>`): a call cut
    before its end, or whose arguments do not start with `{` (not a JSON object), is dropped. No complete call: no
    `tool_calls`, the finish as it was (`length` for a call cut at max_tokens);
  - streamed: each call's name when its `<|tool_call_argument_begin|>` arrives, then its arguments piece by piece,
    whatever they are (a cut call streams what it has; arguments that are not an object stream too); text outside
    the calls' markup streams as content, markup taken out. At the end, the last call's arguments are completed
    to `{}` when what streamed of them is a prefix of `{}` (`_check_for_unstreamed_tool_args`).
- 0.5.14:
  - not streamed: a section with no complete call leaves the whole text, markup included, in the content, with
    `tool_calls: []`; a `stop` becomes `tool_calls` as soon as the section is there;
  - streamed: a call streams from its `{` on (arguments that do not start with `{` never stream); ids number the
    calls of the answer from 0 (not the model's IDX, as the unstreamed answer does); nothing after the section's
    start streams as content. At the end, the last call's arguments are completed with what of `{}` (or of its
    parsed arguments, re-dumped with spaces) the streamed text is not.

Call ids are SGLang's `_process_tool_call_id`: `functions.NAME:` + the calls in the history + the call's index.
Ids the emulated model never writes (a bare counter such as `3`, whose name SGLang infers from the tools) are
dropped here.
"""
from __future__ import annotations

import json
import re
from typing import Any

import orjson

from .tools import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

_SPECIAL = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENT_BEGIN)
_CALL_RE = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*"
                      r"(?P<arguments>\{.*?\})\s*<\|tool_call_end\|>", re.DOTALL)
_PORTION_RE = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*"
                         r"(?P<arguments>\{.*)", re.DOTALL)  # 0.5.14's stream
_ONE_CALL_RE = re.compile(r"<\|tool_call_begin\|>.*?<\|tool_call_end\|>", re.DOTALL)
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")


def _strip_special(text: str) -> str:
    for token in _SPECIAL:
        text = text.replace(token, "")
    return text


def _name_of(call_id: str) -> tuple[str, int] | None:
    found = _ID_RE.match(call_id)
    return (found["name"], int(found["index"])) if found else None


def _call(name: str, index: int, history: int, arguments: str) -> dict[str, Any]:
    return {"id": f"functions.{name}:{history + index}", "index": index, "type": "function",
            "function": {"name": name, "arguments": arguments}}


# --- not streamed ------------------------------------------------------------------------------------------------
def parse_answer(text: str, finish: str, history: int, modern: bool) -> tuple[str, list[dict] | None, str]:
    """(content, tool_calls, finish_reason) of an unstreamed answer whose text (after the reasoning) is `text`.
    tool_calls None: the message has none; [] only on 0.5.14 (a section with no complete call)."""
    if SECTION_BEGIN not in text:
        return text, None, finish
    calls = []
    for match in _CALL_RE.finditer(text):
        named = _name_of(match["id"])
        if named is None:
            continue
        calls.append(_call(named[0], len(calls) if modern else named[1], history, match["arguments"]))
    before = text[:text.find(SECTION_BEGIN)]
    called = "tool_calls" if finish == "stop" else finish
    if modern:
        return (before, calls, called) if calls else (before, None, finish)
    return (before, calls, called) if calls else (text, [], called)


# --- streamed ----------------------------------------------------------------------------------------------------
class _Stream:
    """The detector's streaming state (BaseFormatDetector's fields) and the serving layer's has_tool_calls."""

    def __init__(self, modern: bool):
        self.modern = modern
        self.buffer = ""
        self.tool_id = -1
        self.name: str | None = None  # the call in flight (modern) / whose name was sent (0.5.14)
        self.last_arguments = ""
        self.prev: list[dict] = []  # prev_tool_call_arr
        self.streamed: list[str] = []  # streamed_args_for_tool

    def _start_call(self, name: str) -> None:
        if self.tool_id == -1:
            self.tool_id, self.prev, self.streamed = 0, [], [""]
        while len(self.prev) <= self.tool_id:
            self.prev.append({})
        while len(self.streamed) <= self.tool_id:
            self.streamed.append("")
        self.prev[self.tool_id] = {"name": name, "arguments": {}}

    def _stream_arguments(self, diff: str) -> None:
        self.last_arguments += diff
        self.streamed[self.tool_id] += diff

    def _next_call(self) -> None:
        self.tool_id += 1
        self.last_arguments, self.name = "", None

    def feed(self, piece: str) -> tuple[str, list[tuple[int, str | None, str]]]:
        """(normal text, [(tool index, name or None, arguments piece)]) for one more piece of text."""
        return self._feed_modern(piece) if self.modern else self._feed_0514(piece)

    def _feed_modern(self, piece: str) -> tuple[str, list[tuple[int, str | None, str]]]:
        self.buffer += piece
        if self.name is None and SECTION_BEGIN not in self.buffer and CALL_BEGIN not in self.buffer:
            emit, self.buffer = _split_pending(self.buffer)
            return _strip_special(emit), []
        texts: list[str] = []
        items: list[tuple[int, str | None, str]] = []
        while True:
            begin = self.buffer.find(CALL_BEGIN)
            if begin == -1:
                emit, self.buffer = _split_pending(self.buffer)
                texts.append(_strip_special(emit))
                break
            if begin > 0:
                texts.append(_strip_special(self.buffer[:begin]))
                self.buffer = self.buffer[begin:]
            arg_begin = self.buffer.find(ARGUMENT_BEGIN)
            orphan = self.buffer.find(CALL_BEGIN, len(CALL_BEGIN))
            if orphan != -1 and (arg_begin == -1 or orphan < arg_begin):  # a header never closed: discarded
                self.buffer = self.buffer[orphan:]
                self.last_arguments, self.name = "", None
                continue
            if arg_begin == -1:
                break
            start = arg_begin + len(ARGUMENT_BEGIN)
            end = self.buffer.find(CALL_END)
            just_named = False
            if self.name is None:
                named = _name_of(self.buffer[len(CALL_BEGIN):arg_begin].strip())
                if named is None:
                    if end == -1:
                        break
                    self.buffer = self.buffer[end + len(CALL_END):]
                    self.last_arguments, self.name = "", None
                    continue
                self.name, just_named = named[0], True
                self._start_call(self.name)
            arguments = self.buffer[start:end] if end != -1 else self.buffer[start:]
            diff = arguments[len(self.last_arguments):]
            if diff or just_named:
                items.append((self.tool_id, self.name if just_named else None, diff))
                if diff:
                    self._stream_arguments(diff)
            if end == -1:
                break
            self.buffer = self.buffer[end + len(CALL_END):]
            self._next_call()
        return "".join(texts), items

    def _feed_0514(self, piece: str) -> tuple[str, list[tuple[int, str | None, str]]]:
        self.buffer += piece
        if SECTION_BEGIN not in self.buffer and CALL_BEGIN not in self.buffer:
            self.buffer = ""
            return _strip_special(piece), []
        match = _PORTION_RE.search(self.buffer)
        if not match:
            return "", []
        if self.name is None:  # the call's name, sent alone when its `{` arrives
            named = _name_of(match["id"])
            if named is None:
                return "", []
            self.name = named[0]
            self._start_call(self.name)
            return "", [(self.tool_id, self.name, "")]
        arguments = match["arguments"]
        diff = arguments[len(self.last_arguments):] if arguments.startswith(self.last_arguments) else arguments
        diff = diff.split(CALL_END, 1)[0]
        items: list[tuple[int, str | None, str]] = []
        if diff:
            items.append((self.tool_id, None, diff))
            self._stream_arguments(diff)
        whole = arguments.split(CALL_END, 1)[0]
        try:
            orjson.loads(whole)  # utils._is_complete_json
        except orjson.JSONDecodeError:
            return "", items
        try:
            self.prev[self.tool_id]["arguments"] = json.loads(whole)
        except ValueError:
            pass
        done = _ONE_CALL_RE.search(self.buffer)
        self.buffer = self.buffer[done.end():] if done else ""
        self._next_call()
        return "", items

    def remainder(self) -> tuple[int, str] | None:
        """`_check_for_unstreamed_tool_args`: (the last call's index, arguments still to send) at the end."""
        if not self.prev or not self.streamed:
            return None
        index = len(self.prev) - 1
        if index >= len(self.streamed):
            return None
        expected = self.prev[index].get("arguments", {})
        expected = expected if isinstance(expected, str) else json.dumps(expected, ensure_ascii=False)
        actual = self.streamed[index]
        if self.modern:
            rest = expected[len(actual):] if expected.startswith(actual) else ""
        else:
            rest = expected.replace(actual, "", 1) if actual in expected else ""
        return (index, rest) if rest else None


def _split_pending(text: str) -> tuple[str, str]:
    """The modern detector holds back a trailing fragment that may be the start of a section or of a call."""
    for n in range(min(len(text), len(SECTION_BEGIN) - 1), 1, -1):
        tail = text[-n:]
        if SECTION_BEGIN.startswith(tail) or CALL_BEGIN.startswith(tail):
            return text[:-n], tail
    return text, ""


def stream_answer(pieces: list[str], finish: str, history: int, modern: bool) -> tuple[list[dict], str]:
    """The deltas of a streamed answer whose text (after the reasoning) comes in `pieces`, one per piece (the
    last one also carries what `_check_for_unstreamed_tool_args` sends at the end), and the stream's last
    finish_reason (`stop` becomes `tool_calls` when a call streamed)."""
    stream, deltas, called = _Stream(modern), [], False
    for piece in pieces:
        text, items = stream.feed(piece)
        delta: dict[str, Any] = {"content": text} if text else {}
        fragments = [_fragment(index, name, arguments, history) for index, name, arguments in items]
        if fragments:
            delta["tool_calls"] = fragments
            called = True
        deltas.append(delta)
    rest = stream.remainder()
    if rest is not None and deltas:
        deltas[-1] = {**deltas[-1], "tool_calls": [*(deltas[-1].get("tool_calls") or []),
                                                   _fragment(rest[0], None, rest[1], history)]}
    return deltas, "tool_calls" if called and finish == "stop" else finish


def _fragment(index: int, name: str | None, arguments: str, history: int) -> dict[str, Any]:
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": f"functions.{name}:{history + index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
