"""samples_per_prompt end to end against SGLang emulators (one fleet for the module, each with a request log of
whole bodies): k samples of each prompt with their own seeds and exact ids, exports naming them, the card's
diversity, a SIGKILL mid-run, raising k with --add-samples (only the new samples are sent), lowering refused,
greedy sampling refused, all_turns conversations per sample."""
from __future__ import annotations

import collections
import re
import signal
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.core.exits import CONFIG, DRIFT
from pipeline.emulator import make_config
from pipeline.emulator.model import expected_chat
from pipeline.endpoints.preflight import PROBE_RID_PREFIX
from pipeline.export.formats import validate_specforge_row
from pipeline.store.faults import kill_at_data_part
from pipeline.prompts.conversation import sample_seed
from tests.helpers import (
    data_parts, emulators, run_regen, start_regen, write_config, write_prompts, write_source,
)
from tests.test_modes import write_conversations

MODEL = "moonshotai/Kimi-K2.5"
KIMI = make_config(preset="kimi")
SAMPLING = {"temperature": 0.8, "max_tokens": 16}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two emulators at 100 tokens/s (a request of 16 tokens takes up to 0.16 s: a run can be killed mid-way)."""
    logs = tmp_path_factory.mktemp("sample-logs")
    with emulators(2, preset="kimi", tok_per_s=100, request_log=str(logs / "e.jsonl"),
                   request_log_bodies=True) as servers:
        yield servers


def endpoints(servers) -> list[dict]:
    return [{"url": s.url, "concurrency": 4, "name": f"emu-{i}"} for i, s in enumerate(servers)]


def sent(servers) -> list[dict]:
    """Every prompt request the fleet has seen so far (the preflight's probes left out)."""
    path = Path(servers[0].options["request_log"])
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [line for line in lines if not line["rid"].startswith(PROBE_RID_PREFIX)]


def rows_of(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def units(rows: list[dict]) -> list[tuple[str, int]]:
    return [(r["prompt_id"], r["sample_index"] or 0) for r in rows]


def exported(run: Path, fmt: str, out: Path, *flags: str) -> list[dict]:
    result = run_regen("export", str(run), "--format", fmt, "--out", str(out), *flags)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def test_three_samples_of_each_prompt_are_distinct_exact_and_named_in_exports_and_card(tmp_path, ray_cluster,
                                                                                       fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 6)
    config = write_config(tmp_path, endpoints(fleet), [write_source(tmp_path, prompts)], model=MODEL,
                          sampling=SAMPLING, samples_per_prompt=3)
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    rows = rows_of(run)
    assert sorted(units(rows)) == sorted((pid, j) for pid in {r["prompt_id"] for r in rows} for j in range(3))
    by_prompt = collections.defaultdict(list)
    for row in rows:
        by_prompt[row["prompt_id"]].append(row)
        assert row["seed"] == sample_seed(row["prompt_id"], row["sample_index"], 0.8)
        expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 16, "temperature": 0.8,
                                  "seed": row["seed"]}, KIMI)
        assert row["output_token_ids"] == expected["output_ids"] and row["content"] == expected["content"]
    assert len(by_prompt) == 6
    for samples in by_prompt.values():
        assert len({tuple(r["output_token_ids"]) for r in samples}) == 3, "three distinct completions"

    tokens = exported(run, "specforge-tokens", tmp_path / "tok.jsonl")
    assert sorted(r["id"] for r in tokens) == sorted(
        f"{pid}#turn0" if j == 0 else f"{pid}#s{j}#turn0" for pid, j in units(rows))
    spec = exported(run, "speculators", tmp_path / "spec.jsonl")
    assert {(r["id"], r["primary_id"]) for r in spec} == {
        (f"{pid}_gen0", pid) if j == 0 else (f"{pid}#s{j}_gen0", f"{pid}#s{j}") for pid, j in units(rows)}
    status = run_regen("status", str(run))
    assert "samples (3 per prompt, 6 prompts) 18: done 18, failed 0, pending 0" in status.stdout, status.stdout
    assert re.search(r"overall rate: [\d.]+ samples/s", status.stdout), status.stdout  # rates count samples too
    log = (run / "logs" / "regen.log").read_text()
    assert "dispatch: 18 samples (3 per prompt) to 2 endpoints" in log, log[-2000:]
    assert run_regen("card", str(run)).returncode == 0
    card = (run / "README.md").read_text()
    assert "## Samples" in card and "(6 prompts, 3 samples of each)" in card
    assert "| distinct completions per prompt (min) | 3 |" in card
    assert "| mean pairwise Jaccard overlap of token 4-grams |" in card


def test_a_sigkill_mid_run_then_resume_commits_each_sample_exactly_once(tmp_path, ray_cluster, fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 40)
    config = write_config(tmp_path, endpoints(fleet), [write_source(tmp_path, prompts)], model=MODEL,
                          sampling=SAMPLING, samples_per_prompt=3, flush_records=6, flush_interval_s=0.5)
    run = tmp_path / "out" / "t"
    # SIGKILLed at its third commit: a kill from outside after a first commit could land after the last one (the
    # whole run takes about 3 s on the emulators)
    proc = start_regen("generate", "--config", str(config), env=kill_at_data_part(3), log=tmp_path / "run1.log")
    assert proc.wait(timeout=180) == -signal.SIGKILL, (tmp_path / "run1.log").read_text()[-3000:]
    before = units(rows_of(run))
    assert 0 < len(before) < 120, "killed mid-run"
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    after = units(rows_of(run))
    assert len(after) == len(set(after)) == 120, "0 lost, 0 doubled, per sample"
    assert set(before) <= set(after)


def test_k1_records_stay_null_raising_k_adds_only_the_new_samples_and_lowering_is_refused(tmp_path, ray_cluster,
                                                                                          fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 5)
    spec = write_source(tmp_path, prompts)
    config = write_config(tmp_path, endpoints(fleet), [spec], model=MODEL, sampling=SAMPLING)
    assert run_regen("generate", "--config", str(config)).returncode == 0
    run = tmp_path / "out" / "t"
    first = rows_of(run)
    assert len(first) == 5 and all(r["sample_index"] is None for r in first), "k = 1: the column stays null"
    before = exported(run, "specforge-tokens", tmp_path / "k1.jsonl")
    assert sorted(r["id"] for r in before) == sorted(f"{r['prompt_id']}#turn0" for r in first)
    k1_lines = set((tmp_path / "k1.jsonl").read_bytes().splitlines())

    config = write_config(tmp_path, endpoints(fleet), [spec], model=MODEL, sampling=SAMPLING, samples_per_prompt=3)
    refused = run_regen("generate", "--config", str(config))
    assert refused.returncode == DRIFT.code and "--add-samples" in refused.stderr, refused.stderr
    seen = len(sent(fleet))
    added = run_regen("generate", "--config", str(config), "--add-samples")
    assert added.returncode == 0, added.stderr
    assert "samples_per_prompt raised from 1 to 3" in added.stderr
    new_seeds = {line["body"]["seed"] for line in sent(fleet)[seen:]}
    assert new_seeds == {sample_seed(r["prompt_id"], j, 0.8) for r in first for j in (1, 2)}, "only new samples"
    rows = rows_of(run)
    assert sorted(units(rows)) == sorted((r["prompt_id"], j) for r in first for j in range(3))
    assert [r for r in rows if r["sample_index"] is None] == first, "the old records are kept as they were"
    assert orjson.loads((run / "run.json").read_bytes())["generation"]["samples_per_prompt"] == 3
    exported(run, "specforge-tokens", tmp_path / "k3.jsonl")
    assert k1_lines <= set((tmp_path / "k3.jsonl").read_bytes().splitlines()), "sample 0's rows are unchanged"

    config = write_config(tmp_path, endpoints(fleet), [spec], model=MODEL, sampling=SAMPLING, samples_per_prompt=2)
    lowered = run_regen("generate", "--config", str(config), "--add-samples")
    assert lowered.returncode == DRIFT.code and "lowering it is refused" in lowered.stderr, lowered.stderr


def test_greedy_sampling_with_several_samples_exits_with_the_config_code(tmp_path, fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    config = write_config(tmp_path, endpoints(fleet), [write_source(tmp_path, prompts)], model=MODEL,
                          sampling={"temperature": 0.0, "max_tokens": 8}, samples_per_prompt=2)
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == CONFIG.code
    assert "samples_per_prompt" in result.stderr and "sampling.temperature" in result.stderr
    assert not (tmp_path / "out" / "t").exists()


def test_all_turns_with_two_samples_gives_each_sample_its_own_whole_conversation(tmp_path, ray_cluster, fleet):
    source = tmp_path / "conv.jsonl"
    write_conversations(source, 4)
    config = write_config(tmp_path, endpoints(fleet), [write_source(tmp_path, source, fmt="sharegpt")],
                          model=MODEL, mode="all_turns", sampling=SAMPLING, samples_per_prompt=2,
                          thinking=False)  # no turn's budget spent on thinking alone: no empty content to drop
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    rows = rows_of(run)
    assert len(rows) == 4 * 2 * 3
    for row in rows:
        assert row["seed"] == sample_seed(row["prompt_id"], row["sample_index"], 0.8) + row["turn_index"]
    # kept whole even where a turn was cut at max_tokens: every conversation is exported
    conversations = exported(run, "specforge", tmp_path / "sf.jsonl", "--keep-truncated")
    pids = {r["prompt_id"] for r in rows}
    assert sorted(c["id"] for c in conversations) == sorted([*pids, *(f"{pid}#s1" for pid in pids)])
    assert all(validate_specforge_row(c) == [] for c in conversations)
    by_id = {c["id"]: c["conversations"] for c in conversations}
    for pid in pids:
        assert by_id[pid] != by_id[f"{pid}#s1"], "the two samples are two conversations"
        assert sum(m["role"] == "assistant" for m in by_id[f"{pid}#s1"]) == 3
