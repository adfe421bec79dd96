"""all_turns tool-calling conversations on the SGLang emulator (kimi preset: Kimi's call markup in the output ids,
SGLang's kimi_k2 tool-call parser in `message.tool_calls`), through the real endpoint worker over HTTP, the record
builder, a run directory of real Parquet, the exports, `regen status` and the card.

The prompts are built here as the sources normalise them (a prompt set table with the tool columns); the records
are written to a run directory of records schema 5 (tests/tool_records.py)."""
from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pytest

from pipeline.capture import pending_samples
from pipeline.core.config import Endpoint, RunConfig, SourceRef
from pipeline.core.work import DONE, WorkItem
from pipeline.dispatch.worker import EndpointWorker
from pipeline.emulator.tools import CALL_END, SECTION_BEGIN, TOOL_SPECIAL
from pipeline.endpoints.client import ClientSettings
from pipeline.endpoints.engines import SGLangAdapter
from pipeline.export.card import write_card
from pipeline.export.jsonl import export_run, manifest_path
from pipeline.prompts.tool_calls import canonical_json, message_from_row
from tests.helpers import handed_out
from pipeline.store.status import print_status
from tests.helpers import emulators, exchange_all
from tests.tool_records import make_tool_run

MODEL = "moonshotai/Kimi-K2.5"
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]


def calls(*names, first=0):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{first + i}", "type": "function", "function": {"name": n, "arguments": '{"city":"Paris"}'}}
        for i, n in enumerate(names)]}


def result(name, text, call_id):
    return {"role": "tool", "content": text, "tool_call_id": call_id, "name": name}


def say(text):
    return {"role": "assistant", "content": text}


def user(text):
    return {"role": "user", "content": text}


# The emulated Kimi calls the tools the last user message names (else the first), and answers after tool results.
PROMPTS = {
    "aaaa0001": ([user("Use get_weather for Paris, please."), calls("get_weather"),
                  result("get_weather", "18C, clear", "call_0"), say("18C and clear."),
                  user("And get_weather for tomorrow?"), calls("get_weather", first=1),
                  result("get_weather", "20C, rain", "call_1"), say("20C with rain.")], TOOLS),
    "bbbb0002": ([user("Please get_time in Paris."), calls("get_weather"),
                  result("get_weather", "18C", "call_0"), say("18C.")], TOOLS),
    "cccc0003": ([user("Check get_weather twice for Paris."), calls("get_weather"),
                  result("get_weather", "18C", "call_0"), calls("get_weather", first=1),
                  result("get_weather", "19C", "call_1"), say("18C, then 19C.")], TOOLS),
    "dddd0004": ([user("Name a prime."), say("Seven."), user("Another?"), say("Eleven.")], None),
}


def prompt_table():
    rows = [{"prompt_id": pid, "source": "agent" if tools else "chat", "reference": None,
             "tools": canonical_json(tools) if tools else None,
             "messages": [{**m, "tool_calls": canonical_json(m["tool_calls"]) if m.get("tool_calls") else None}
                          for m in messages]} for pid, (messages, tools) in PROMPTS.items()]
    return pa.Table.from_pylist(rows)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    with emulators(1, preset="kimi") as (server,):
        info = orjson.loads(urllib.request.urlopen(f"{server.url}/server_info", timeout=10).read())
        settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=1024, chat_template_kwargs={"thinking": False},
                                  engines={"emu": SGLangAdapter.from_server_info(info)})
        cfg = RunConfig(run_name="t", model=MODEL, mode="all_turns", sources=[SourceRef(spec="s.yaml")],
                        endpoints=[Endpoint(url=server.url)], sampling={"max_tokens": 1024})
        builder, handed = handed_out(prompt_table(), cfg, tmp_path_factory.mktemp("prompts"), fingerprint="fp-tools")

        async def scenario():
            worker = EndpointWorker(server.url, "emu", 4, settings, mode="all_turns", attempts_per_endpoint=1)
            return await exchange_all(worker, [handed[pid] for pid in PROMPTS], rounds=100)

        outcomes = asyncio.run(scenario())
    assert sorted(o.kind for o in outcomes) == [DONE] * 4, [o.message for o in outcomes]
    rows = [row for o in outcomes for row in builder.records(o, o.attempts)]
    return {pid: sorted((r for r in rows if r["prompt_id"] == pid), key=lambda r: r["turn_index"]) for pid in PROMPTS}


def test_a_target_that_follows_the_source_gets_each_cached_result_and_writes_every_step(records):
    steps = records["aaaa0001"]
    assert [bool(r.get("tool_calls")) for r in steps] == [True, False, True, False]
    assert [r["finish_reason"] for r in steps][::2] == ["tool_calls", "tool_calls"] and not steps[0]["flags"]
    assert all("conversation_end" not in r for r in steps)
    first_call = orjson.loads(steps[0]["tool_calls"])[0]
    assert first_call["function"]["name"] == "get_weather" and first_call["id"].startswith("functions.get_weather:")
    # the cached result goes back under the target's own call id, and the next step is generated after it
    spliced = steps[1]["messages"][-1]
    assert message_from_row(spliced) == {"role": "tool", "content": "18C, clear", "tool_call_id": first_call["id"],
                                         "name": "get_weather"}
    # the call's tokens are in the output ids, and come back in the next step's prompt ids
    for marker in (SECTION_BEGIN, CALL_END):
        assert TOOL_SPECIAL[marker] in steps[0]["output_token_ids"]
        assert TOOL_SPECIAL[marker] in steps[1]["prompt_token_ids"]
    assert {r["tools"] for r in steps} == {canonical_json(TOOLS)}


def test_another_tool_or_an_answer_ends_the_conversation_with_its_reason(records):
    other = records["bbbb0002"]
    assert len(other) == 1 and other[0]["conversation_end"].startswith(
        "other_tool: step 0 called get_time, the cached result answers get_weather")
    answered = records["cccc0003"]
    assert len(answered) == 2 and "tool_calls" not in answered[1]
    assert answered[1]["conversation_end"] == "answered: step 1 answered where the source called get_weather"


def test_a_tool_free_prompt_in_the_same_run_is_regenerated_as_before(records):
    plain = records["dddd0004"]
    assert [r["turn_index"] for r in plain] == [0, 1]
    assert [message_from_row(m) for m in plain[1]["messages"]] == [user("Name a prime."), say(plain[0]["content"]),
                                                                    user("Another?")]
    assert not {"tools", "tool_calls", "conversation_end"} & (set(plain[0]) | set(plain[1]))


def test_exports_status_and_card_of_a_tool_run(records, tmp_path, capsys):
    rows = [r for pid in PROMPTS for r in records[pid]]
    run = make_tool_run(tmp_path / "run", [rows], model=MODEL)
    out = tmp_path / "sf.jsonl"
    summary = export_run(run.path, "specforge", out, keep_truncated=True)  # the emulator's answers may be cut
    conversations = {row["id"]: row for row in map(orjson.loads, out.read_bytes().splitlines())}
    assert summary.dropped == {} and set(conversations) == set(PROMPTS), summary.dropped
    weather = conversations["aaaa0001"]
    assert orjson.loads(weather["tools"]) == TOOLS and "tools" not in conversations["dddd0004"]
    assert [m["role"] for m in weather["conversations"]] == ["user", "assistant", "tool", "assistant", "user",
                                                             "assistant", "tool", "assistant"]
    assert weather["conversations"][1]["tool_calls"] == orjson.loads(records["aaaa0001"][0]["tool_calls"])
    advice = orjson.loads(manifest_path(out).read_bytes())["chat_template"]
    assert advice["family"] == "kimi" and "lfm" not in advice["specforge"]
    assert "specforge-tokens" in advice["specforge"]

    tokens = tmp_path / "tokens.jsonl"
    export_run(run.path, "specforge-tokens", tokens)
    by_id = {row["id"]: row for row in map(orjson.loads, tokens.read_bytes().splitlines())}
    for record in rows:  # each step trains exactly its own ids: earlier steps and tool results are prompt, 0
        row = by_id[f"{record['prompt_id']}#turn{record['turn_index']}"]
        n = len(record["prompt_token_ids"])
        assert row["input_ids"] == record["prompt_token_ids"] + record["output_token_ids"]
        expected = [0] * n + [1] * len(record["output_token_ids"])
        if record["finish_reason"] == "length":
            expected[-1] = 0  # a cut answer's last position never trains an end-of-turn
        assert row["loss_mask"] == expected

    # the hidden-state capture takes every generation of the tool run as a sample of its own, with its exact ids
    pending = pending_samples(run, set(), refused := set(), lambda pid, turn, sid, ids, n_prompt, finish:
                              SimpleNamespace(token_ids=ids, key=(sid, ids, n_prompt)))
    assert not refused and pending.no_token_ids == pending.count_mismatch == 0
    assert sorted(s.key for prompt in pending.prompts for s in prompt) == sorted(
        (f"{r['prompt_id']}#turn{r['turn_index']}", r["prompt_token_ids"] + r["output_token_ids"],
         len(r["prompt_token_ids"])) for r in rows)

    assert print_status(run.path, as_json=True) == 0
    status = orjson.loads(capsys.readouterr().out)
    flagged = [r for r in rows if "spliced_other_arguments" in r["flags"]]
    assert status["tools"] == {"prompts_with_tools": 3, "prompts_in_set_with_tools": None, "records_with_calls": 4,
                               "calls": 4,
                               "cut_short": {"other_tool": 1, "answered": 1},
                               "spliced_other_arguments": {"conversations": len({r["prompt_id"] for r in flagged}),
                                                           "records": len(flagged)},
                               "arguments_not_object": 0, "truncated_call": 0}
    card = write_card(run.path).read_bytes().decode()
    assert "- 3 prompts with committed records sent with tools\n" in card and "cut short: 2 — " in card


def test_status_counts_the_tool_prompts_of_the_set_beside_those_with_records(records, tmp_path, capsys):
    """Walk of issue 31: "tools: 21 prompts sent with tools" counted only the prompts with records, while all 36 of
    the set were sent (15 failed with a 400, leaving no record). The figure says what it counts, and the set's."""
    rows = [r for pid in ("aaaa0001", "bbbb0002", "dddd0004") for r in records[pid]]  # cccc0003: no record
    run = make_tool_run(tmp_path / "run", [rows], model=MODEL)
    run.write_prompt_set(prompt_table(), pa.table({"reason": pa.array([], pa.string())}))
    assert print_status(run.path) == 0
    said = capsys.readouterr().out
    assert "tools: 2 prompts with committed records sent with tools, of 3 in the prompt set that carry tools;" in said
    assert print_status(run.path, as_json=True) == 0
    tools = orjson.loads(capsys.readouterr().out)["tools"]
    assert (tools["prompts_with_tools"], tools["prompts_in_set_with_tools"]) == (2, 3)
    card = write_card(run.path).read_bytes().decode()
    assert "- 2 prompts with committed records sent with tools, of 3 in the prompt set that carry tools" in card


def test_regen_generate_all_turns_on_the_tool_sample_commits_whole_spliced_conversations(tmp_path, ray_cluster):
    """The CLI end to end: the project's tool-calling sample, all_turns, one emulated Kimi; then status and export."""
    import pyarrow.parquet as pq

    from tests.helpers import data_parts, run_regen, write_config

    repo = Path(__file__).resolve().parent.parent

    with emulators(1, preset="kimi") as (server,):
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4, "name": "emu-0"}],
                              [repo / "prompts_sources" / "sample_tools.yaml"], model=MODEL, mode="all_turns",
                              thinking=False, sampling={"temperature": 0.0, "max_tokens": 128})
        result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    rows = [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]
    by_prompt: dict[str, list[dict]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_id"], []).append(row)
    assert any(row["tool_calls"] for row in rows) and any(row["tools"] for row in rows)
    for steps in by_prompt.values():
        steps.sort(key=lambda r: r["turn_index"])
        assert [r["turn_index"] for r in steps] == list(range(len(steps))) == list(range(steps[0]["n_turns"]))
        assert all(r["conversation_end"] is None for r in steps[:-1])
        for step, following in zip(steps, steps[1:]):  # each call's result comes back under the target's own id
            if step["tool_calls"]:
                ids = [c["id"] for c in orjson.loads(step["tool_calls"])]
                assert [m["tool_call_id"] for m in following["messages"] if m["role"] == "tool"][-len(ids):] == ids
    status = orjson.loads(run_regen("status", str(run), "--json").stdout)["tools"]
    assert status["calls"] == sum(len(orjson.loads(r["tool_calls"])) for r in rows if r["tool_calls"])
    assert sum(status["cut_short"].values()) == sum(r["conversation_end"] is not None for r in rows)
    summary = export_run(run, "specforge", tmp_path / "sf.jsonl", keep_truncated=True)
    assert summary.rows_written and "invalid_conversation" not in summary.dropped


def test_the_template_advice_for_a_chatml_model_says_rows_with_tools_are_not_rendered_exactly():
    """vLLM renders each tool in its own model's key order (seen on the CPU build: type, then function with name,
    description, parameters) while the export holds canonical sorted-key JSON: lfm is exact only without tools."""
    from pipeline.export.templates import template_advice

    advice = template_advice("SmolLM2-135M-Instruct")["specforge"]
    assert "lfm" in advice and "tool-free rows" in advice
    assert "Rows with tools are not rendered exactly" in advice and "export `specforge-tokens`" in advice
