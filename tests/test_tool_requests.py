"""Tool calls on the request side (issue 22): what a request carries, how the target's calls come back (answers
and streams), the preflight's refusal of a fleet that cannot return them, and the settings that must not move
today's runs (fingerprints, affinity keys). Against the SGLang emulator (Kimi preset, and one launched without a
tool-call parser); SGLang's own detector checks the emulator in test_sglang_conformance.py, vLLM's real
server the client in test_vllm_engine.py."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pipeline.core.config import LocalFleet, RunConfig, load_config
from pipeline.core.work import affinity_key
from pipeline.emulator import expected_chat, make_config, start_emulator
from pipeline.emulator.tools import TOOL_SPECIAL
from pipeline.endpoints.client import ClientSettings, EndpointClient, StreamAccumulator
from pipeline.endpoints.localfleet import vllm_command, vllm_environment
from pipeline.endpoints.preflight import preflight_async

REPO = Path(__file__).resolve().parent.parent
MODEL = "moonshotai/Kimi-K2.5"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Use get_weather: is it raining in Paris?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A Kimi server as production launches it (--tool-call-parser kimi_k2), and one without a tool-call parser."""
    log = tmp_path_factory.mktemp("tool-requests") / "requests.jsonl"
    kimi = start_emulator(preset="kimi", request_log=str(log), request_log_bodies=True)
    bare = start_emulator(reasoning_parser="kimi_k2")
    yield type("Servers", (), {"kimi": kimi, "bare": bare, "log": log})
    kimi.stop()
    bare.stop()


def client(url: str, **settings) -> EndpointClient:
    values = {"model": MODEL, "temperature": 0.0, "top_p": 1.0, "max_tokens": 64, **settings}
    return EndpointClient(url, "e", ClientSettings(**values))


async def _chat(url: str, messages, tools, **settings):
    chat = client(url, **settings)
    try:
        return await chat.chat(messages, None, tools)
    finally:
        await chat.close()


def chat(url: str, messages, tools=None, **settings):
    return asyncio.run(_chat(url, messages, tools, **settings))


def sent_bodies(log: Path) -> list[dict]:
    return [json.loads(line)["body"] for line in log.read_text().splitlines()]


# --- requests ------------------------------------------------------------------------------------------------------
def test_tools_and_tool_choice_are_sent_only_with_a_prompt_that_has_tools(servers):
    before = len(sent_bodies(servers.log))
    chat(servers.kimi.url, ASK)
    chat(servers.kimi.url, ASK, [])  # an empty list is no tools: vLLM answers `tools: []` with a 400
    chat(servers.kimi.url, ASK, [WEATHER], tool_choice="required")
    plain, empty, with_tools = sent_bodies(servers.log)[before:]
    assert "tools" not in plain and "tool_choice" not in plain
    assert "tools" not in empty and "tool_choice" not in empty
    assert with_tools["tools"] == [WEATHER] and with_tools["tool_choice"] == "required"


# --- answers -------------------------------------------------------------------------------------------------------
def test_a_kimi_call_comes_back_in_tool_calls_and_in_the_output_ids(servers):
    completion = chat(servers.kimi.url, ASK, [WEATHER], chat_template_kwargs={"thinking": True})
    want = expected_chat({"messages": ASK, "tools": [WEATHER], "max_tokens": 64,
                          "chat_template_kwargs": {"thinking": True}}, make_config(preset="kimi"))
    [call] = completion.tool_calls
    assert call == {"id": "functions.get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": want["tool_calls"][0]["function"]["arguments"]}}
    assert json.loads(call["function"]["arguments"]).keys() == {"city"}
    assert completion.finish_reason == "tool_calls" and completion.content == ""  # a pure call
    assert completion.reasoning_content, "the reasoning before the call stays apart"
    ids = completion.output_token_ids
    assert ids == want["output_ids"] and set(TOOL_SPECIAL.values()) <= set(ids), "the call's tokens are in the ids"


def test_a_streamed_call_joins_to_the_same_tool_calls(servers):
    unstreamed = chat(servers.kimi.url, ASK, [WEATHER, TIME], return_token_ids=False)
    streamed = chat(servers.kimi.url, ASK, [WEATHER, TIME], stream=True, return_token_ids=False)
    assert streamed.tool_calls == unstreamed.tool_calls and streamed.tool_calls
    assert streamed.finish_reason == unstreamed.finish_reason == "tool_calls"


def test_parallel_calls_are_numbered_across_the_conversation(servers):
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Rain."},
        {"role": "user", "content": "Now get_time and get_weather for Berlin."}]
    completion = chat(servers.kimi.url, history, [WEATHER, TIME])
    assert [c["id"] for c in completion.tool_calls] == ["functions.get_time:1", "functions.get_weather:2"]


def test_tool_choice_none_answers_in_text_and_required_calls_after_a_result(servers):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Rain."}]
    answer = chat(servers.kimi.url, history, [WEATHER])  # auto after a result: the next step is text
    assert answer.tool_calls is None and answer.content and answer.finish_reason in ("stop", "length")
    assert chat(servers.kimi.url, ASK, [WEATHER], tool_choice="none").tool_calls is None
    again = chat(servers.kimi.url, history, [WEATHER], tool_choice="required")
    assert [c["id"] for c in again.tool_calls] == ["functions.get_weather:1"]


def test_a_server_without_a_tool_parser_leaves_the_call_in_content_as_sglang_does(servers):
    completion = chat(servers.bare.url, ASK, [WEATHER], chat_template_kwargs={"thinking": True})
    assert completion.tool_calls is None and completion.finish_reason == "stop"
    assert completion.content.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0")


def test_stream_fragments_are_joined_by_index():
    """OpenAI's streaming shape: the first fragment of a call brings its id and name, the next ones pieces of its
    arguments, parallel calls interleaved by index."""
    stream = StreamAccumulator()
    deltas = [
        [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        [{"index": 0, "function": {"arguments": '{"city": '}}],
        [{"index": 0, "function": {"arguments": '"Paris"}'}}],
    ]
    for tool_calls in deltas:
        stream.add({"id": "r", "choices": [{"index": 0, "delta": {"tool_calls": tool_calls}, "finish_reason": None}]})
    stream.add({"id": "r", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    completion = stream.completion(0.1)
    assert completion.tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert completion.finish_reason == "tool_calls" and completion.content == ""


# --- the preflight -------------------------------------------------------------------------------------------------
def run_config(url: str, **overrides) -> RunConfig:
    return RunConfig.model_validate({"run_name": "t", "model": MODEL, "thinking": True, "sources": [{"spec": "u.yaml"}],
                                     "endpoints": [{"url": url, "name": "bare"}], "sampling": {"max_tokens": 24},
                                     "dead_fleet_deadline_s": 5, **overrides})


def test_a_prompt_set_with_tools_is_refused_on_a_server_without_a_tool_parser(servers):
    from pipeline.core.errors import PreflightError

    cfg = run_config(servers.bare.url)
    asyncio.run(preflight_async(cfg, {}))  # no tools: nothing to refuse
    with pytest.raises(PreflightError) as refused:
        asyncio.run(preflight_async(cfg, {}, tools=True))
    message = str(refused.value)
    assert "bare:" in message and "tool_call_parser: null" in message and "--tool-call-parser" in message
    kimi = run_config(servers.kimi.url)
    asyncio.run(preflight_async(kimi, {}, tools=True))  # kimi_k2 parser: admitted
    asyncio.run(preflight_async(run_config(servers.bare.url, tool_choice="none"), {}, tools=True))  # no calls asked


# --- what must not move ------------------------------------------------------------------------------------------
# Fingerprints of today's configs, as main computed them before tool calls existed.
FINGERPRINTS = {"local": "1a1c86c32cf65b40", "local_vllm": "69b4a0d77d744303", "kimi_k25_88k": "b9658b4b05ee20b0"}


def test_todays_fingerprints_stand_and_tool_choice_enters_only_when_not_auto():
    for name, fingerprint in FINGERPRINTS.items():
        assert load_config(str(REPO / f"configs/{name}.yaml")).fingerprint() == fingerprint, name
    base = run_config("http://127.0.0.1:1")
    assert run_config("http://127.0.0.1:1", tool_choice="auto").fingerprint() == base.fingerprint()
    required = run_config("http://127.0.0.1:1", tool_choice="required")
    assert required.fingerprint() != base.fingerprint()
    assert required.generation_identity()["tool_choice"] == "required"


def test_the_affinity_key_of_a_tool_free_prompt_stands_and_tools_move_it():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is the weather in Paris?"}]
    assert affinity_key(messages, 256) == 14593508764534682655  # main's key, before tool calls existed
    assert affinity_key(messages, 10) == 4298793098564617112
    tools = json.dumps([WEATHER]).encode()
    assert affinity_key(messages, 256, tools) != affinity_key(messages, 256)
    assert affinity_key(messages, 256, tools) == affinity_key(messages + [{"role": "user", "content": "x"}], 256, tools)
    other = json.dumps([TIME]).encode()
    assert affinity_key(messages, 256, other) != affinity_key(messages, 256, tools)


def test_the_length_check_counts_the_tools_as_the_template_renders_them():
    from pipeline.endpoints.localfleet import vllm_model_dir
    from pipeline.prompts.records import InvalidRecord
    from pipeline.prompts.tokens import PromptLength

    transformers = pytest.importorskip("transformers")
    if not (vllm_model_dir() / "tokenizer.json").exists():
        pytest.skip("SmolLM2's HF folder is not converted (make vllm)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(vllm_model_dir()))
    tokenizer.chat_template = (REPO / "configs/templates/smollm2_tools.jinja").read_text()
    big = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 20,
                                             "parameters": {"type": "object", "properties": {}}}} for i in range(8)]
    check = PromptLength(tokenizer, 400, "smollm2")
    check(tuple(ASK))  # short alone
    with pytest.raises(InvalidRecord) as too_long:
        check(tuple(ASK), big)
    assert "over max_prompt_tokens 400" in str(too_long.value)


def smollm2_folder() -> Path:
    from pipeline.endpoints.localfleet import vllm_model_dir

    pytest.importorskip("transformers")
    if not (vllm_model_dir() / "tokenizer.json").exists():
        pytest.skip("SmolLM2's HF folder is not converted (make vllm)")
    return vllm_model_dir()


CALLED = (*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "content": "rain, 12C " * 40, "tool_call_id": "call_1", "name": "get_weather"})


def test_the_length_check_of_a_run_renders_with_the_template_the_fleet_serves():
    """configs/local_vllm_tools.yaml serves SmolLM2 with the project's template (SmolLM2's own renders no tools):
    max_prompt_tokens measures what that template renders, tools included."""
    from pipeline.prompts.records import InvalidRecord
    from pipeline.prompts.tokens import load_length_check

    folder = smollm2_folder()
    cfg = load_config(REPO / "configs" / "local_vllm_tools.yaml")
    assert cfg.served_chat_template() == str(REPO / "configs" / "templates" / "smollm2_tools.jinja")
    big = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 20,
                                             "parameters": {"type": "object", "properties": {}}}} for i in range(8)]
    check = load_length_check(400, str(folder), cfg.served_chat_template())
    with pytest.raises(InvalidRecord) as too_long:
        check(tuple(ASK), big)
    assert "over max_prompt_tokens 400" in str(too_long.value)


def test_a_tool_turn_the_tokenizers_template_cannot_render_is_measured_not_a_crash():
    """SmolLM2's own template fails on a pure call (content null): the prompt is measured by its texts (a lower
    bound), and a long one is still rejected as too long, instead of the build ending in a Jinja error."""
    from pipeline.prompts.records import InvalidRecord, RejectCode
    from pipeline.prompts.tokens import load_length_check

    check = load_length_check(100, str(smollm2_folder()))
    with pytest.raises(InvalidRecord) as too_long:
        check(CALLED, [WEATHER])
    assert too_long.value.code == RejectCode.TOO_LONG and check.unrenderable == 1
    load_length_check(4000, str(smollm2_folder()))(CALLED, [WEATHER])  # within the limit: kept


def test_the_vllm_local_fleet_launches_with_the_template_and_the_parser(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    fleet = LocalFleet(engine="vllm", chat_template=str(template), tool_call_parser="hermes")
    command = vllm_command(fleet, 18000, 3)
    assert command[command.index("--chat-template") + 1] == str(template.resolve())
    assert command[command.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in command
    assert vllm_environment(fleet, 0)["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "1"
    plain = vllm_command(LocalFleet(engine="vllm"), 18000, 3)
    assert "--chat-template" not in plain and "--tool-call-parser" not in plain
    with pytest.raises(ValueError, match="need engine: vllm"):
        LocalFleet(engine="llamacpp", tool_call_parser="hermes")
