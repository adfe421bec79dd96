"""Tool-call data exactly as the target would see it (issue 29), on the SGLang emulator (kimi preset) through the real
endpoint worker and record builder: a call cut at max_tokens as a real server answers it, streamed and not, and
the project's tool samples regenerated under both `tool_result_match` rules (tests/tool_samples.py)."""
from __future__ import annotations

import asyncio

import orjson
import pyarrow as pa
import pytest

from pipeline.core.config import Endpoint, RunConfig, SourceRef
from pipeline.dispatch.worker import EndpointWorker
from pipeline.emulator import expected_chat, make_config
from pipeline.emulator.protocol import stream_deltas
from pipeline.endpoints.client import ClientSettings
from pipeline.endpoints.engines import SGLangAdapter
from tests.helpers import emulators, handed_out
from tests.tool_samples import MODEL, figures, regenerate, splices

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Use get_weather for Paris."}]
SOURCE = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "content": "18C", "tool_call_id": "call_0", "name": "get_weather"},
    {"role": "assistant", "content": "18C."}]


@pytest.fixture(scope="module")
def server():
    with emulators(1, preset="kimi") as (emulator,):
        yield emulator


def test_the_emulator_answers_a_cut_call_as_sglang_does_not_with_its_markup():
    """SGLang 0.5.17+ keeps only the text before the call section of an unstreamed answer; 0.5.14 leaves the whole
    text with `tool_calls: []` (checked against each version's own code by the conformance)."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 12,
            "chat_template_kwargs": {"thinking": False}}
    answer = expected_chat(body, make_config(preset="kimi"))
    assert (answer["content"], answer["tool_calls"], answer["finish_reason"]) == ("", None, "length")
    assert 163595 in answer["output_ids"], "the call's tokens are in the output ids all the same"
    old = expected_chat(body, make_config(preset="kimi", sglang_version="0.5.14"))
    assert old["content"].startswith("<|tool_calls_section_begin|>") and old["tool_calls"] == []
    from pipeline.emulator.model import chat_generation

    _, gen = chat_generation(body, 4096, 512, "kimi_k2", True)
    streamed = stream_deltas(gen, True)
    assert not any(d.get("content") for d in streamed)
    assert "".join(f["function"].get("arguments") or "" for d in streamed for f in d.get("tool_calls") or []) == '{"city"'


@pytest.mark.parametrize("stream, thinking, max_tokens", [(False, True, 24), (True, False, 12)])
def test_regen_flags_a_cut_call_as_what_the_server_made_of_it(server, tmp_path, stream, thinking, max_tokens):
    """Unstreamed: a `length` answer with no call and empty content after the reasoning is `truncated_call` (not
    truncated_thinking). Streamed: the call comes with its arguments cut, `arguments_not_object`, and all_turns
    ends there without sending it back."""
    info = {"sglang_version": "0.5.23", "version": "0.5.23"}
    settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=max_tokens, stream=stream,
                              chat_template_kwargs={"thinking": thinking}, tool_choice="required",
                              engines={"e": SGLangAdapter.from_server_info(info)})
    cfg = RunConfig(run_name="t", model=MODEL, mode="all_turns", sources=[SourceRef(spec="s.yaml")],
                    endpoints=[Endpoint(url=server.url)], sampling={"max_tokens": max_tokens}, tool_choice="required")
    table = pa.Table.from_pylist([{"prompt_id": "cafe0001", "source": "agent", "reference": None,
                                   "tools": orjson.dumps([WEATHER]).decode(), "messages": [
                                       {**m, "tool_calls": orjson.dumps(m["tool_calls"]).decode()
                                        if m.get("tool_calls") else None} for m in SOURCE]}])
    builder, handed = handed_out(table, cfg, tmp_path, fingerprint="fp")

    async def scenario():
        worker = EndpointWorker(server.url, "e", 1, settings, mode="all_turns", attempts_per_endpoint=1)
        outcomes = list((await worker.exchange(list(handed.values()), wait_s=1.0)).outcomes)
        for _ in range(600):  # each exchange waits on the worker's event, at most 0.5 s
            if outcomes:
                break
            outcomes += (await worker.exchange([], wait_s=0.5)).outcomes
        await worker.close()
        return outcomes

    [outcome] = asyncio.run(scenario())
    [row] = builder.records(outcome, 1)
    assert row["finish_reason"] == "length"
    if stream:
        assert row["flags"] == ["truncated", "arguments_not_object"]
        assert orjson.loads(row["tool_calls"])[0]["function"]["arguments"] == '{"city"'
        assert row["conversation_end"].startswith('arguments_not_object: step 0 called get_weather {"city"')
    else:
        assert row["content"] == "" and row.get("tool_calls") is None and row["reasoning_content"]
        assert row["flags"] == ["truncated", "truncated_call"]
        assert row["conversation_end"] == "truncated: step 0 was cut at max_tokens where the source called get_weather"


# Prompts whose tools constrain their arguments to one value (an enum): the emulated model writes the source's own
# arguments, so that `tool_result_match: arguments` has splices to keep.
UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
DAYS = {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
    "days": {"type": "integer", "enum": [3]}}, "required": ["days"]}}}


def enum_record(rid, names):
    args = {"set_unit": {"unit": "celsius"}, "get_forecast": {"days": 3}}
    return {"id": rid, "tools": [UNIT, DAYS], "messages": [
        {"role": "user", "content": "Use " + " and ".join(names) + ", please."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": orjson.dumps(args[n]).decode()}}
            for k, n in enumerate(names)]},
        *[{"role": "tool", "content": f"{n} done", "tool_call_id": f"c{k}"} for k, n in enumerate(names)],
        {"role": "assistant", "content": "Done."}]}


EXTRA = [enum_record("enum-one", ["set_unit"]), enum_record("enum-parallel", ["set_unit", "get_forecast"])]


def test_the_tool_samples_under_both_rules_every_splice_is_matched_or_flagged(server, tmp_path):
    """Under `arguments` every spliced result answered its call's own arguments; under `name` each record whose
    history holds one that did not is flagged, and only those (read without regen's matching: splices())."""
    seen = {}
    for rule in ("name", "arguments"):
        prompts, rows, builder = regenerate(server.url, rule, tmp_path / rule, extra=EXTRA)
        by_id = {p.prompt_id: p for p in prompts}
        for pid, steps in rows.items():
            checked = splices(list(by_id[pid].messages), steps)
            if rule == "arguments":
                assert all(ok for _, ok in checked), by_id[pid].source_ref
                assert not any("spliced_other_arguments" in r["flags"] for r in steps)
            else:
                first = min((turn for turn, ok in checked if not ok), default=None)
                assert [("spliced_other_arguments" in r["flags"]) for r in steps] == [
                    first is not None and r["turn_index"] >= first for r in steps], by_id[pid].source_ref
        seen[rule] = figures(prompts, rows)
        seen[rule]["flagged_conversations"] = sum(any("spliced_other_arguments" in r["flags"] for r in steps)
                                                  for steps in rows.values())
        if rule == "name":
            assert builder.tool_notes.splices == seen[rule]["splices_other_arguments"]
    name, arguments = seen["name"], seen["arguments"]
    assert arguments["splices"] == 3 and arguments["splices_other_arguments"] == 0  # the enum prompts' 1 + 2
    assert name["splices_other_arguments"] == name["splices"] - 3 > 0  # the emulator fills in other arguments
    # the emulator is deterministic: each conversation runs alike under both rules up to its first splice for other
    # arguments, where `arguments` ends it
    assert arguments["conversation_end"]["other_arguments"] == name["flagged_conversations"]
