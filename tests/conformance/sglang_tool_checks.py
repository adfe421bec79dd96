"""Tool calls in the SGLang conformance (tests/test_sglang_conformance.py, issues 22 and 29).

`drive_tools` (in the test process): regen's own client sends the version's emulator tool requests (a call,
parallel calls after a call and its result, tool_choice required and none; a call cut at max_tokens at every one
of its tokens; parallel calls one of whose arguments are not a JSON object, whole and cut; streamed and not). The
request and response checks of sglang_checks.py cover their bodies and answers; `ToolChecker.tool_answer` (in the
version's subprocess) checks each answer, unstreamed and streamed, against what the version's own serving code
makes of the text the emulated model wrote (recomputed): its ReasoningParser("kimi_k2"), its
`_process_tool_calls` around FunctionCallParser(tools, "kimi_k2").parse_non_stream, its streaming parser fed
piece by piece with `_check_for_unstreamed_tool_args` at the end, and its call ids (sglang_serving.py).
`ToolChecker.texts` runs texts the emulated model does not write (text before and after the section, arguments
with spaces, nested or not JSON, an id SGLang cannot read) through the emulator's parser (kimi_parser.py) and the
version's. Its detectors import xgrammar (`make sglang-wheels` installs it without its dependencies).
"""
from __future__ import annotations

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
NOT_OBJECT = {"type": "function", "function": {"name": "set_list", "description": "Numbers, as a list.",
                                               "parameters": {"type": "array", "items": {"type": "integer"}}}}
BOTH = [{"role": "user", "content": "Use get_weather for Paris, then set_list."}]
ONE_CALL_TOKENS = 19  # <|tool_calls_section_begin|> ... <|tool_calls_section_end|> of one get_weather call
TWO_CALL_TOKENS = 30  # the same with a set_list call after it
CASES = [  # (messages, tool_choice, thinking, max_tokens, tools)
    (ASK, "auto", True, 96, [WEATHER, TIME]),
    (CALLED + [{"role": "user", "content": "Now get_time, then get_weather for Berlin."}], "auto", True, 96,
     [WEATHER, TIME]),
    (CALLED, "required", False, 96, [WEATHER, TIME]),
    (CALLED, "auto", True, 96, [WEATHER, TIME]),  # after a result: an answer in text
    (ASK, "none", False, 96, [WEATHER, TIME]),
    # a call cut at max_tokens after each of its tokens (thinking off: the answer is the call)
    *[(ASK, "required", False, k, [WEATHER, TIME]) for k in range(1, ONE_CALL_TOKENS + 1)],
    # parallel calls, the second one's arguments not an object; after a call in the history (ids count it)
    *[(CALLED + BOTH, "required", False, k, [WEATHER, NOT_OBJECT])
      for k in (9, 18, 20, 22, 24, 26, 28, TWO_CALL_TOKENS, 96)],
    (BOTH, "auto", True, 96, [NOT_OBJECT]),  # the only call is not an object
]


async def drive_tools(url: str, version: str, model: str) -> None:
    """Every case through regen's own client, unstreamed and streamed, as the run would send it to `version`."""
    from pipeline.endpoints.client import ClientSettings, EndpointClient
    from pipeline.endpoints.engines import SGLangAdapter

    for messages, tool_choice, thinking, max_tokens, tools in CASES:
        for stream in (False, True):
            settings = ClientSettings(model=model, temperature=0.0, top_p=1.0, max_tokens=max_tokens, stream=stream,
                                      chat_template_kwargs={"thinking": thinking}, tool_choice=tool_choice,
                                      engines={"e": SGLangAdapter(version=version)})
            client = EndpointClient(url, "e", settings)
            try:
                await client.chat(messages, None, tools)
            finally:
                await client.close()


def call(call_id: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


# Texts the emulated model does not write, through the emulator's parser and the version's: (text, finish).
TEXTS = [
    ("Let me check. " + section(call("functions.get_weather:0", '{"city":"Oslo"}')) + " Done.", "stop"),
    ("Use a <b> tag <| and " + section(call("functions.get_weather:0", '{"city":"Oslo"}')), "stop"),
    (section(call("functions.get_weather:2", ' {"city": "Oslo", "days": 3} ')), "stop"),
    (section(call("functions.get_weather:0", '{"city":{"name":"Oslo","near":[1,2]}}'),
             call("functions.get_time:1", "{}")), "stop"),
    (section(call("functions.get_weather:0", '{"city": Oslo}')), "stop"),  # not JSON, but braced
    (section(call("functions.get_weather:0", '"Oslo"'), call("functions.get_time:1", "{}")), "stop"),
    (section(call("weather", "{}")), "stop"),  # an id SGLang cannot read: no name
    ("<|tool_calls_section_begin|>", "length"),
    ("Sure. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{",
     "length"),
    (section(call("functions.get_weather:0", '{"city":"Oslo"}')) + "<|tool_call_begin|>functions.get_time:1"
     "<|tool_call_argument_begin|>{}", "length"),
]


class ToolChecker(Checker):
    def __init__(self, root: Path, emulator: str):
        super().__init__(root, emulator)
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        from tests.conformance.sglang_serving import Serving

        self.ReasoningParser, self.serving = ReasoningParser, Serving(root)

    def model_wrote(self, body: dict) -> tuple[str, list[str], str]:
        """(the answer's text, its pieces, the finish) the emulated model wrote for a body, recomputed, with the
        reasoning cut off by SGLang's own parser."""
        from pipeline.emulator.config import make_config
        from pipeline.emulator.model import chat_generation

        cfg = make_config(preset="kimi")
        _, gen = chat_generation(body, cfg.context_length, cfg.default_max_tokens, "kimi_k2", True)
        if not gen.thinking:
            return gen.text, gen.pieces, gen.finish
        _, content = self.ReasoningParser("kimi_k2", stream_reasoning=False, force_reasoning=True) \
            .parse_non_stream(gen.text)
        return content or "", gen.pieces[gen.n_reason + 1:], gen.finish

    def theirs(self, body: dict) -> tuple[dict, dict]:
        """(the unstreamed answer, the stream) as this version's serving code makes them of what the model wrote."""
        text, pieces, finish = self.model_wrote(body)
        if body.get("tool_choice") == "none":  # SGLang runs no tool parser then
            plain = {"content": text, "calls": None, "finish": finish}
            return plain, plain
        history = sum(len(m.get("tool_calls") or []) for m in body["messages"] if m.get("role") == "assistant")
        return (self.serving.answer(text, finish, body["tools"], body.get("tool_choice") or "auto", history),
                self.serving.stream(pieces, finish, body["tools"], history))

    def tool_answer(self, body: dict) -> list[str]:
        problems: list[str] = []
        label = (f"{len(body['messages'])} messages, tool_choice {body.get('tool_choice')}, max_tokens "
                 f"{body.get('max_tokens')}")
        status, raw = self._http("POST", "/v1/chat/completions", {**body, "stream": False})
        if status != 200:
            return [f"{label}: the emulator answered {status}"]
        answer = json.loads(raw)
        problems += self._parse(self.p.ChatCompletionResponse, answer, label)
        message, choice = answer["choices"][0]["message"], answer["choices"][0]
        calls = message.get("tool_calls")
        ours = {"content": message["content"], "finish": choice["finish_reason"],
                "calls": None if calls is None else [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                     for c in calls]}
        whole, streamed = self.theirs(body)
        thinking = (body.get("chat_template_kwargs") or {}).get("thinking", True)
        problems += _differences(label, ours, whole, thinking)
        streamed_body = {k: v for k, v in body.items() if k not in ("return_token_ids", "return_prompt_token_ids")}
        status, raw = self._http("POST", "/v1/chat/completions", {**streamed_body, "stream": True})
        if status != 200:
            return problems + [f"{label}: the emulator answered the stream with {status}"]
        joined: dict[int, dict] = {}
        content, finish = "", None
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                problems += self._parse(self.p.ChatCompletionStreamResponse, chunk, label + " chunk")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content += delta.get("content") or ""
                    finish = choice.get("finish_reason") or finish
                    for fragment in delta.get("tool_calls") or []:
                        call = joined.setdefault(fragment["index"], {"id": None, "name": None, "arguments": ""})
                        function = fragment.get("function") or {}
                        call["id"] = call["id"] or fragment.get("id")
                        call["name"] = call["name"] or function.get("name")
                        call["arguments"] += function.get("arguments") or ""
        ours = {"content": content, "finish": finish,
                "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(joined.items())] or None}
        return problems + _differences(label + " (streamed)", ours, streamed, thinking)

    def texts(self) -> None:
        """TEXTS through the emulator's parser and this version's serving, whole and piece by piece."""
        from pipeline.emulator.kimi_parser import parse_answer, stream_answer
        from pipeline.emulator.tools import text_pieces

        modern = tuple(int(x) for x in self.root.name.split(".")) >= (0, 5, 17)
        tools = [WEATHER, TIME]
        problems, checked = [], 0
        for n, (text, finish) in enumerate(TEXTS):
            content, calls, last = parse_answer(text, finish, 1, modern)
            ours = {"content": content, "finish": last,
                    "calls": None if calls is None else [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                         for c in calls]}
            problems += _differences(f"text {n}", ours, self.serving.answer(text, finish, tools, "auto", 1), False)
            pieces = text_pieces(text)
            deltas, last = stream_answer(pieces, finish, 1, modern)
            joined: dict[int, dict] = {}
            for delta in deltas:
                for fragment in delta.get("tool_calls") or []:
                    call = joined.setdefault(fragment["index"], {"id": None, "name": None, "arguments": ""})
                    call["id"] = call["id"] or fragment.get("id")
                    call["name"] = call["name"] or (fragment.get("function") or {}).get("name")
                    call["arguments"] += (fragment.get("function") or {}).get("arguments") or ""
            ours = {"content": "".join(d.get("content") or "" for d in deltas), "finish": last,
                    "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(joined.items())] or None}
            problems += _differences(f"text {n} (streamed)", ours, self.serving.stream(pieces, finish, tools, 1),
                                     False)
            checked += 2
        self.report("tool_texts", problems, checked)


def _differences(label: str, ours: dict, theirs: dict, thinking: bool) -> list[str]:
    """What differs between the emulator's answer and SGLang's (content compared stripped after a reasoning)."""
    if thinking:
        ours, theirs = ({**d, "content": (d["content"] or "").strip()} for d in (ours, theirs))
    if ours == theirs:
        return []
    return [f"{label}: ours {ours}, SGLang's {theirs}"]
