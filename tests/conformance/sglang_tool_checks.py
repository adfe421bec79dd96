"""Tool calls in the SGLang conformance (tests/test_sglang_conformance.py, issue 22).

`drive_tools` (in the test process): regen's own client sends the version's emulator tool requests (a call,
parallel calls after a call and its result, tool_choice required and none; streamed and not). The request and
response checks of sglang_checks.py cover their bodies and answers; `ToolChecker.tool_answer` (in the version's
subprocess) checks each answer's calls against what the version's own ReasoningParser("kimi_k2") and
FunctionCallParser(tools, "kimi_k2") make of the text the emulated model wrote (recomputed), whole and piece by
piece, with ids from the version's own `_process_tool_call_id` (compiled out of its source). Its detectors import
xgrammar (`make sglang-wheels` installs it without its dependencies).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.conformance.sglang_checks import Checker


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Use get_weather: is it raining in Paris?"}]
CALLED = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                          "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Rain."}]
CASES = [  # (messages, tool_choice, thinking)
    (ASK, "auto", True),
    (CALLED + [{"role": "user", "content": "Now get_time, then get_weather for Berlin."}], "auto", True),
    (CALLED, "required", False),
    (CALLED, "auto", True),  # after a result: an answer in text
    (ASK, "none", False),
]


async def drive_tools(url: str, version: str, model: str) -> None:
    """Every case through regen's own client, unstreamed and streamed, as the run would send it to `version`."""
    from pipeline.endpoints.client import ClientSettings, EndpointClient
    from pipeline.endpoints.engines import SGLangAdapter

    for messages, tool_choice, thinking in CASES:
        for stream in (False, True):
            settings = ClientSettings(model=model, temperature=0.0, top_p=1.0, max_tokens=96, stream=stream,
                                      chat_template_kwargs={"thinking": thinking}, tool_choice=tool_choice,
                                      engines={"e": SGLangAdapter(version=version)})
            client = EndpointClient(url, "e", settings)
            try:
                await client.chat(messages, None, [WEATHER, TIME])
            finally:
                await client.close()


def call_id_rule(root: Path):
    """serving_chat's `_process_tool_call_id`, compiled out of the wheel's source (its module imports the GPU
    stack): (tool_call_parser, call item, history count) -> id."""
    source = (root / "sglang/srt/entrypoints/openai/serving_chat.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "_process_tool_call_id":
            import logging
            import uuid

            scope = {"uuid": uuid, "logger": logging.getLogger("sglang-rule"), "ToolCallItem": object}
            node.returns = None
            for arg in node.args.args:
                arg.annotation = None
            exec(compile(ast.Module(body=[node], type_ignores=[]), "serving_chat.py", "exec"), scope)
            rule = scope["_process_tool_call_id"]
            return lambda parser, item, history: rule(type("S", (), {"tool_call_parser": parser})(), item, history)
    raise LookupError("no _process_tool_call_id in serving_chat.py")


class ToolChecker(Checker):
    def __init__(self, root: Path, emulator: str):
        super().__init__(root, emulator)
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        self.FunctionCallParser, self.ReasoningParser = FunctionCallParser, ReasoningParser
        self.rule = call_id_rule(root)

    def model_wrote(self, body: dict) -> str:
        """The raw text the emulated model wrote for a body, recomputed, with the reasoning cut off by SGLang's
        own parser."""
        from pipeline.emulator.config import make_config
        from pipeline.emulator.model import chat_generation

        cfg = make_config(preset="kimi")
        _, gen = chat_generation(body, cfg.context_length, cfg.default_max_tokens, "kimi_k2", True)
        if not gen.thinking:
            return gen.text
        _, content = self.ReasoningParser("kimi_k2", stream_reasoning=False, force_reasoning=True) \
            .parse_non_stream(gen.text)
        return content or ""

    def theirs(self, body: dict) -> tuple[str, list[dict]]:
        """(content, tool_calls) as this version's parsers and id rule make them of what the model wrote."""
        tools = [self.p.Tool.model_validate(t) for t in body["tools"]]
        history = sum(len(m.get("tool_calls") or []) for m in body["messages"] if m.get("role") == "assistant")
        text, items = self.FunctionCallParser(tools, "kimi_k2").parse_non_stream(self.model_wrote(body))
        return text, [{"id": self.rule("kimi_k2", item, history), "name": item.name, "arguments": item.parameters}
                      for item in items]

    def streamed_calls(self, body: dict) -> list[dict]:
        """The calls this version's parser finds piece by piece (names and joined arguments by tool_index)."""
        from pipeline.emulator.tools import text_pieces

        tools = [self.p.Tool.model_validate(t) for t in body["tools"]]
        parser = self.FunctionCallParser(tools, "kimi_k2")
        calls: dict[int, dict] = {}
        for piece in text_pieces(self.model_wrote(body)):
            _, items = parser.parse_stream_chunk(piece)
            for item in items:
                call = calls.setdefault(item.tool_index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or item.name
                call["arguments"] += item.parameters or ""
        return [calls[k] for k in sorted(calls)]

    def tool_answer(self, body: dict) -> list[str]:
        problems: list[str] = []
        label = f"{len(body['messages'])} messages, tool_choice {body.get('tool_choice')}"
        status, raw = self._http("POST", "/v1/chat/completions", {**body, "stream": False})
        if status != 200:
            return [f"{label}: the emulator answered {status}"]
        answer = json.loads(raw)
        problems += self._parse(self.p.ChatCompletionResponse, answer, label)
        message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
        ours = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in message.get("tool_calls") or []]
        text, calls = self.theirs(body)
        if body.get("tool_choice") == "none":
            calls = []  # SGLang runs no tool parser then
        if ours != calls:
            problems.append(f"{label}: tool_calls {ours}, SGLang's parser and id rule give {calls}")
        if calls and (message["content"] != text or finish != "tool_calls"):
            problems.append(f"{label}: content {message['content']!r} / finish {finish!r}, SGLang's: {text!r} / "
                            "'tool_calls'")
        streamed_body = {k: v for k, v in body.items() if k not in ("return_token_ids", "return_prompt_token_ids")}
        status, raw = self._http("POST", "/v1/chat/completions", {**streamed_body, "stream": True})
        if status != 200:
            return problems + [f"{label}: the emulator answered the stream with {status}"]
        joined: dict[int, dict] = {}
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                problems += self._parse(self.p.ChatCompletionStreamResponse, chunk, label + " chunk")
                for choice in chunk.get("choices") or []:
                    for fragment in (choice.get("delta") or {}).get("tool_calls") or []:
                        call = joined.setdefault(fragment["index"], {"name": None, "arguments": ""})
                        function = fragment.get("function") or {}
                        call["name"] = call["name"] or function.get("name")
                        call["arguments"] += function.get("arguments") or ""
        streamed = [joined[k] for k in sorted(joined)]
        theirs = [] if body.get("tool_choice") == "none" else self.streamed_calls(body)
        if [(c["name"], json.loads(c["arguments"])) for c in streamed] != \
                [(c["name"], json.loads(c["arguments"])) for c in theirs]:
            problems.append(f"{label}: streamed calls {streamed}, SGLang's streaming parser finds {theirs}")
        return problems
