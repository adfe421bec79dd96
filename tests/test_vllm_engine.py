"""A real inference engine: runs against two vLLM servers (its CPU build, SmolLM2-135M-Instruct), started by
`local_fleet: {engine: vllm}`'s own code (the vllm_fleet fixture), through a real Ray head, with the real `regen`
command in a subprocess and real SIGKILLs. The ids are checked with the model's own tokenizer (transformers), and
the run's token exports are loaded by SpecForge's and speculators' own code (tests/trainlib.py).
The test that SIGKILLs a server is last: the fleet is shared by the module."""
from __future__ import annotations

import collections
import json
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.emulator import start_emulator
from pipeline.export.jsonl import export_run
from pipeline.store.faults import kill_at_data_part
from pipeline.store.schema import SCHEMA_VERSION
from tests.helpers import (
    all_prompt_ids, committed_ids, data_parts, run_regen, start_regen, wait_for, write_config,
    write_prompts, write_source,
)
from tests.trainlib import run_checks

pytestmark = pytest.mark.vllm
MAX_TOKENS = 32


def endpoints(vllm_fleet) -> list[dict]:
    return [{"url": e.url, "concurrency": e.concurrency, "name": e.name} for e in vllm_fleet.fleet.endpoints()]


@pytest.fixture(scope="module")
def tokenizer(vllm_fleet):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(vllm_fleet.model_dir))


def rows_of(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def failures_of(run: Path) -> list[dict]:
    return [r for p in sorted((run / "failures").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def check_ids(rows: list[dict], tokenizer) -> None:
    for row in rows:
        ids = row["output_token_ids"]
        assert ids and len(ids) == row["completion_tokens"], row
        assert tokenizer.decode(ids, skip_special_tokens=True) == row["content"], row["prompt_id"]
        assert row["prompt_token_ids"] == chat_ids(tokenizer, row["messages"]), row["prompt_id"]
        assert len(row["prompt_token_ids"]) == row["prompt_tokens"]
        assert (row["engine"], row["engine_version"]) == ("vllm", "0.32.0")


def test_token_ids_decode_to_the_content_and_the_chat_rendering(tmp_path, ray_cluster, vllm_fleet, tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 8)
    config = write_config(tmp_path, endpoints(vllm_fleet), [write_source(tmp_path, prompts)],
                          sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "out" / "t"
    rows = rows_of(run)
    assert sorted(r["prompt_id"] for r in rows) == sorted(all_prompt_ids(run))
    check_ids(rows, tokenizer)
    assert any(r["finish_reason"] == "stop" for r in rows) and any(r["output_token_ids"][-1] == 2 for r in rows), \
        "an answer that stopped ends with the EOS id (<|im_end|>), which its content does not show"
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["engines"] == [{"engine": "vllm", "version": "0.32.0"}]
    assert manifest["schema_version"] == SCHEMA_VERSION  # a new run writes the current schema
    check_token_exports_in_the_libraries(tmp_path, run, rows, vllm_fleet.model_dir)


def check_token_exports_in_the_libraries(tmp_path, run, rows, model_dir):
    """The run's token exports through SpecForge's pre-tokenized path and `speculators prepare-data` (their own
    code, tests/trainlib_checks.py): each row's ids are a record's prompt + output ids, and every mask is 0 on the
    prompt, 1 on the output, 0 on the last position of a record cut at max_tokens."""
    expected = {}
    for row in rows:
        mask = [0] * len(row["prompt_token_ids"]) + [1] * len(row["output_token_ids"])
        if row["finish_reason"] == "length":
            mask[-1] = 0
        expected[tuple(row["prompt_token_ids"] + row["output_token_ids"])] = mask
    assert len(expected) == len(rows), "two records with the same ids: the check below could not tell them apart"
    tokens, spec = tmp_path / "sf-tokens.jsonl", tmp_path / "spec.jsonl"
    export_run(run, "specforge-tokens", tokens)
    export_run(run, "speculators", spec)
    loaded = {
        "specforge": run_checks({"check": "specforge_rows", "path": str(tokens)})["rows"],
        "speculators": run_checks({"check": "speculators_prepare", "path": str(spec), "tokenizer": str(model_dir),
                                   "out": str(tmp_path / "prepared")})["rows"]}
    for library, got in loaded.items():
        assert sorted(tuple(r["input_ids"]) for r in got) == sorted(expected), f"{library}: not the records' ids"
        mis_masked = [r for r in got if r["loss_mask"] != expected[tuple(r["input_ids"])]]
        assert not mis_masked, f"{library}: {len(mis_masked)} mis-masked rows of {len(got)}"


def test_streaming_run(tmp_path, ray_cluster, vllm_fleet, tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 4)
    config = write_config(tmp_path, endpoints(vllm_fleet), [write_source(tmp_path, prompts)], stream=True,
                          sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "out" / "t")
    assert len(rows) == 4
    check_ids(rows, tokenizer)  # prompt ids from the first chunk, output ids joined from every chunk


def test_three_samples_at_temperature_are_distinct_completions_with_exact_ids(tmp_path, ray_cluster, vllm_fleet,
                                                                              tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3)
    config = write_config(tmp_path, endpoints(vllm_fleet), [write_source(tmp_path, prompts)], samples_per_prompt=3,
                          sampling={"temperature": 0.8, "max_tokens": 16})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "out" / "t")
    by_prompt = collections.defaultdict(list)
    for row in rows:
        by_prompt[row["prompt_id"]].append(row)
    assert len(by_prompt) == 3
    for samples in by_prompt.values():
        assert sorted(r["sample_index"] for r in samples) == [0, 1, 2]
        assert len({tuple(r["output_token_ids"]) for r in samples}) == 3, "three distinct completions"
        assert len({r["seed"] for r in samples}) == 3
    check_ids(rows, tokenizer)  # each sample's ids decode to its own content and the chat rendering


def test_over_long_prompt_is_one_terminal_attempt_with_the_server_message(tmp_path, ray_cluster, vllm_fleet):
    prompts = tmp_path / "prompts.jsonl"
    rows = write_prompts(prompts, 2)
    long_prompt = {"prompt": "Summarise this: " + " ".join(["lorem ipsum dolor sit amet"] * 300)}
    prompts.write_text(prompts.read_text() + json.dumps(long_prompt) + "\n")
    config = write_config(tmp_path, endpoints(vllm_fleet), [write_source(tmp_path, prompts)],
                          sampling={"temperature": 0.0, "max_tokens": 8})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "out" / "t"
    assert len(committed_ids(run)) == len(rows)
    [failure] = failures_of(run)
    assert failure["attempts"] == 1, "a context overflow is never retried"
    assert failure["error_class"] == "terminal" and failure["status"] == 400
    assert "This model's maximum context length is 1024 tokens" in failure["message"], failure["message"]


def test_a_fleet_mixing_engines_is_refused(tmp_path, vllm_fleet):
    emulator = start_emulator(preset="kimi", served_model_name="SmolLM2-135M-Instruct")
    try:
        prompts = tmp_path / "prompts.jsonl"
        write_prompts(prompts, 1)
        config = write_config(tmp_path, endpoints(vllm_fleet)[:1] + [{"url": emulator.url, "name": "sgl"}],
                              [write_source(tmp_path, prompts)], return_token_ids=False)
        result = run_regen("preflight", str(config))
    finally:
        emulator.stop()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "different inference engines" in result.stderr and "local-0: vllm" in result.stderr, result.stderr
    assert "vllm 0.32.0" in result.stdout, "the table names the engine and its version"


def test_bench_endpoints_reads_vllm_metrics(tmp_path, vllm_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    config = write_config(tmp_path, endpoints(vllm_fleet)[:1], [write_source(tmp_path, prompts)])
    result = run_regen("bench-endpoints", str(config), "--max-tokens", "8", "--prompts", "5", "--concurrency", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if "vllm:generation_tokens_total" in l)
    tokens = float(line.split(": ")[1].split(" tokens")[0])
    assert 7 * 8 * 0.5 <= tokens <= 7 * 8, f"5 + 2 requests of at most 8 tokens, counted by the server: {line}"
    assert "speculative" not in result.stdout, "no spec-decode counters without --speculative-config"


def test_an_images_run_is_refused_on_the_text_only_model(vllm_fleet):
    """No vLLM route says whether the model takes images: the preflight's tiny image probe gets SmolLM2's own
    refusal (400 "... is not a multimodal model") and names the fix; a text prompt set is not asked."""
    import asyncio

    from pipeline.core.config import RunConfig
    from pipeline.endpoints.probes import check_endpoint

    client = tool_client(vllm_fleet)
    cfg = RunConfig.model_validate({"run_name": "t", "model": "SmolLM2-135M-Instruct", "sources": [{"spec": "u.yaml"}],
                                    "endpoints": [{"url": client.url}], "sampling": {"max_tokens": 8},
                                    "min_prompt_tokens": 16})

    async def reports():
        try:
            return await check_endpoint(client, cfg, images=True), await check_endpoint(client, cfg)
        finally:
            await client.close()

    images, text = asyncio.run(reports())
    [problem] = images.problems
    assert "400 SmolLM2-135M-Instruct is not a multimodal model" in problem and "vision-language model" in problem
    assert images.images is False and images.reachable
    assert text.ok and text.images is None


# --- tool calls: the fleet serves configs/templates/smollm2_tools.jinja with --tool-call-parser hermes -------------
# strict: vLLM pins the arguments to the schema (its structural tag, VLLM_ENFORCE_STRICT_TOOL_CALLING); the enum makes
# the forced call's arguments one of two known values. vLLM renders a tool as its FunctionDefinition dumps it
# (name, description, parameters, strict: that key order), so the tool is written in that order here.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
                   "required": ["city"], "additionalProperties": False}, "strict": True}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_client(vllm_fleet, **settings):
    from pipeline.endpoints.client import ClientSettings, EndpointClient
    from pipeline.endpoints.engines import VLLMAdapter

    endpoint = vllm_fleet.fleet.endpoints()[0]
    values = {"model": "SmolLM2-135M-Instruct", "temperature": 0.0, "top_p": 1.0, "max_tokens": 64,
              "engines": {endpoint.label: VLLMAdapter(version="0.32.0")}, **settings}
    return EndpointClient(endpoint.url, endpoint.label, ClientSettings(**values))


async def ask(client, messages, tools):
    try:
        return await client.chat(messages, None, tools)
    finally:
        await client.close()


def template_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    from tests.conftest import TOOL_TEMPLATE

    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             chat_template=TOOL_TEMPLATE.read_text())
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_a_forced_tool_call_round_trip_on_the_cpu_build(vllm_fleet, tokenizer):
    """tools in the prompt ids, the call in the output ids and in tool_calls (unstreamed and streamed alike), then
    the call and a spliced result sent back: the next step's prompt holds both, and the server answers it."""
    import asyncio

    called = asyncio.run(ask(tool_client(vllm_fleet, tool_choice="required"), ASK, [WEATHER_TOOL]))
    assert called.prompt_token_ids == template_ids(tokenizer, ASK, [WEATHER_TOOL])
    assert '"name": "get_weather"' in tokenizer.decode(called.prompt_token_ids), "the tools are in the prompt ids"
    [call] = called.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert json.loads(call["function"]["arguments"]) in ({"city": "Paris"}, {"city": "Berlin"})
    output = tokenizer.decode(called.output_token_ids)
    assert "<tool_call>" in output and "get_weather" in output, f"the call's tokens are in the output ids: {output!r}"
    assert called.finish_reason in ("tool_calls", "stop") and called.content == "", called
    streamed = asyncio.run(ask(tool_client(vllm_fleet, tool_choice="required", stream=True), ASK, [WEATHER_TOOL]))
    # vLLM re-serialises the arguments of an unstreamed call; a stream carries them as the model wrote them
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed.tool_calls] == \
        [("get_weather", json.loads(call["function"]["arguments"]))], "the stream's fragments join to the call"
    assert streamed.output_token_ids == called.output_token_ids

    result = {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "Sunny, 21 C."}
    follow_up = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}, result]
    step = asyncio.run(ask(tool_client(vllm_fleet, tool_choice="none"), follow_up, [WEATHER_TOOL]))
    assert step.prompt_token_ids == template_ids(tokenizer, follow_up, [WEATHER_TOOL])
    prompt = tokenizer.decode(step.prompt_token_ids)
    arguments = json.dumps(json.loads(call["function"]["arguments"]))
    assert f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' \
        f"<|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 21 C.\n</tool_response><|im_end|>" in prompt
    assert step.tool_calls is None and step.content, "tool_choice none: the next step is text"
    assert tokenizer.decode(step.output_token_ids, skip_special_tokens=True) == step.content


def test_tool_free_chats_render_as_smollm2s_own_template(tokenizer):
    """The fleet's template changes nothing for a chat without tools: the ids of every other test stand."""
    from tests.conftest import TOOL_TEMPLATE

    ours = TOOL_TEMPLATE.read_text()
    for messages in (ASK, [{"role": "system", "content": "Be terse."}, *ASK, {"role": "assistant", "content": "Mild."},
                           {"role": "user", "content": "And\n\n tomorrow?"}], [{"role": "user", "content": ""}]):
        for generation_prompt in (True, False):
            own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                 chat_template=ours) == own


def test_driver_sigkill_mid_run_then_resume_nothing_lost_or_doubled(tmp_path, ray_cluster, vllm_fleet):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 16)
    config = write_config(tmp_path, endpoints(vllm_fleet), [write_source(tmp_path, prompts)], flush_records=2,
                          flush_interval_s=0.5, sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    run = tmp_path / "out" / "t"
    # SIGKILLed at its third commit: a kill from outside after a first commit could land after the last one
    proc = start_regen("generate", "--config", str(config), env=kill_at_data_part(3), log=tmp_path / "run1.log")
    assert proc.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "run1.log").read_text()[-3000:]
    before = committed_ids(run)
    assert 0 < len(before) < 16, "the kill must land mid-run"
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    ids = committed_ids(run)
    assert collections.Counter(ids).most_common(1)[0][1] == 1, "a prompt was committed twice"
    assert set(ids) == all_prompt_ids(run) and len(ids) == 16
    assert not failures_of(run)


def test_sigkill_of_one_server_mid_run_moves_its_work(tmp_path, ray_cluster, vllm_fleet):
    """Last: it leaves the module's fleet with one server. The fleet is an endpoints file naming local-1 alone, so
    local-1 is certain to hold work (with both listed, local-0 may take every prompt before local-1's actor is up on
    a loaded machine); once local-1 has answered, local-0 is added to the file and local-1 is SIGKILLed."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 16)
    local0, local1 = vllm_fleet.fleet.endpoints()
    fleet_file = tmp_path / "fleet.txt"
    fleet_file.write_text(f"{local1.url} 2\n")
    config = write_config(tmp_path, [], [write_source(tmp_path, prompts)], flush_records=1, flush_interval_s=0.2,
                          endpoints_file=str(fleet_file), endpoints_file_interval_s=0.5,
                          sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    run = tmp_path / "out" / "t"
    log = tmp_path / "run.log"
    label0, label1 = (e.url.split("://", 1)[1] for e in (local0, local1))
    proc = start_regen("generate", "--config", str(config), log=log)
    try:
        wait_for(lambda: any(r["endpoint"] == label1 for r in rows_of(run)) if data_parts(run) else False, 240,
                 interval=0.2, what="a record from local-1")
    except AssertionError:
        raise AssertionError(log.read_text()[-3000:]) from None
    fleet_file.write_text(f"{local1.url} 2\n{local0.url} 4\n")
    victim = vllm_fleet.processes.processes[1]
    os.killpg(victim.pid, signal.SIGKILL)  # the API server, its EngineCore and its worker
    victim.wait(timeout=30)
    at_kill = len(committed_ids(run))
    assert at_kill < 16, "the kill must land mid-run"
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    rows = rows_of(run)
    assert sorted(r["prompt_id"] for r in rows) == sorted(all_prompt_ids(run)), "every prompt, once"
    assert not failures_of(run)
    served = collections.Counter(r["endpoint"] for r in rows)
    assert served[label0] > 0 and served[label0] + served[label1] == 16, served
