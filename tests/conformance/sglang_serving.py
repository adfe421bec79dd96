"""What one SGLang version's own serving code makes of a Kimi answer's text, streamed and not (issue 29).

Run inside the version's subprocess (sglang_checks.py). serving_chat.py imports the GPU stack, so its methods that
turn the model's text into the answer are compiled out of the wheel's source with the names they use:
`_process_tool_calls` (the unstreamed answer: FunctionCallParser(tools, "kimi_k2").parse_non_stream and what the
server does with an empty or odd result), `_check_for_unstreamed_tool_args` (what a stream sends at its end) and
`_process_tool_call_id`. The stream itself is the version's FunctionCallParser fed piece by piece (and
`parse_stream_end` on the last piece where the version calls it), with the stream's last finish_reason rule.
"""
from __future__ import annotations

import ast
import json
import logging
import time
import typing
import uuid
from pathlib import Path
from types import SimpleNamespace

CHAT = "sglang/srt/entrypoints/openai/serving_chat.py"
METHODS = ("_process_tool_call_id", "_process_tool_calls", "_check_for_unstreamed_tool_args")


def _compiled(root: Path) -> dict:
    """The methods of serving_chat.py named in METHODS, compiled with the names they use (annotations dropped)."""
    import orjson
    from sglang.srt.entrypoints.openai import protocol
    from sglang.srt.function_call.core_types import ToolCallItem
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.function_call.json_array_parser import JsonArrayParser

    found = {}
    for node in ast.walk(ast.parse((root / CHAT).read_text())):
        if isinstance(node, ast.FunctionDef) and node.name in METHODS and node.name not in found:
            node.returns = None
            for arg in [*node.args.args, *node.args.kwonlyargs]:
                arg.annotation = None
            found[node.name] = node
    missing = set(METHODS) - set(found)
    if missing:
        raise LookupError(f"serving_chat.py has no {sorted(missing)}")
    scope = {name: getattr(typing, name) for name in ("Any", "Dict", "List", "Optional", "Union", "Tuple")}
    scope.update({name: getattr(protocol, name) for name in (
        "ToolCall", "FunctionResponse", "ToolCallProcessingResult", "ToolChoice", "ChatCompletionStreamResponse",
        "ChatCompletionResponseStreamChoice", "DeltaMessage", "ChatCompletionRequest")})
    scope.update(FunctionCallParser=FunctionCallParser, JsonArrayParser=JsonArrayParser, ToolCallItem=ToolCallItem,
                 orjson=orjson, json=json, uuid=uuid, time=time, logger=logging.getLogger("sglang-serving"))
    exec(compile(ast.Module(body=list(found.values()), type_ignores=[]), str(root / CHAT), "exec"), scope)
    return {name: scope[name] for name in METHODS}


class Serving:
    """The version's serving of a kimi_k2 answer: `answer` (not streamed) and `stream`."""

    def __init__(self, root: Path):
        from sglang.srt.entrypoints.openai import protocol
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        self.p, self.FunctionCallParser = protocol, FunctionCallParser
        self.methods = _compiled(root)
        self.flushes = hasattr(FunctionCallParser, "parse_stream_end")  # 0.5.18+: the last delta drains the parser
        server = SimpleNamespace(tool_call_parser="kimi_k2", tokenizer_manager=SimpleNamespace(tokenizer=None))
        server._process_tool_call_id = lambda item, history: self.methods["_process_tool_call_id"](
            server, item, history)
        self.server = server

    def tools(self, tools: list[dict]) -> list:
        return [self.p.Tool.model_validate(t) for t in tools]

    def answer(self, text: str, finish: str, tools: list[dict], tool_choice, history: int) -> dict:
        """What the unstreamed answer holds: content, calls [(id, name, arguments)] or None, finish_reason."""
        result = self.methods["_process_tool_calls"](self.server, text, self.tools(tools),
                                                     {"type": finish, "matched": None}, tool_choice, history)
        calls, content, finish_reason = result[0], result[1], result[2]
        return {"content": content,
                "calls": None if calls is None else [(c.id, c.function.name, c.function.arguments) for c in calls],
                "finish": finish_reason["type"]}

    def stream(self, pieces: list[str], finish: str, tools: list[dict], history: int) -> dict:
        """What the stream carries: the content joined, the calls joined by index, the last finish_reason."""
        parser = self.FunctionCallParser(self.tools(tools), "kimi_k2")
        content, calls, called = "", {}, False
        for k, piece in enumerate(pieces):
            text, items = parser.parse_stream_chunk(piece)
            if k == len(pieces) - 1 and self.flushes and finish != "abort":
                end_text, end_items = parser.parse_stream_end()
                text, items = (text or "") + end_text, list(items) + list(end_items)
            content += text or ""
            for item in items:
                called = True
                call = calls.setdefault(item.tool_index, {"id": None, "name": None, "arguments": ""})
                if item.name:
                    call["id"] = call["id"] or self.server._process_tool_call_id(item, history)
                    call["name"] = call["name"] or item.name
                call["arguments"] += item.parameters or ""
        check = self.methods["_check_for_unstreamed_tool_args"]
        extra = {"created": 0} if "created" in check.__code__.co_varnames[:check.__code__.co_argcount] else {}
        chunk = check(self.server, parser, {"meta_info": {"id": "r"}}, SimpleNamespace(model="m"), 0, **extra)
        if chunk:
            for fragment in json.loads(chunk.removeprefix("data: "))["choices"][0]["delta"]["tool_calls"]:
                calls[fragment["index"]]["arguments"] += fragment["function"]["arguments"] or ""
        incomplete = getattr(parser.detector, "incomplete_tool_call_indices", set())
        last = "tool_calls" if called and finish == "stop" and not incomplete else finish
        return {"content": content,
                "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())] or None,
                "finish": last}
