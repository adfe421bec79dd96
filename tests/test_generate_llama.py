"""End-to-end runs against real llama.cpp servers (SmolLM2-135M), through a real Ray head, with the
real `regen` command in a subprocess and real SIGKILLs."""
from __future__ import annotations

import collections
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.store.faults import kill_at_data_part
from tests.helpers import (
    all_prompt_ids, committed_ids, data_parts, run_regen, sigkill, start_regen, temp_files, wait_for,
    write_config, write_prompts, write_source,
)

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.llama


NO_IDS = {"return_token_ids": False}  # llama.cpp returns no token ids: the preflight refuses a run asking for them


def llama_endpoints(fleet) -> list[dict]:
    return [{"url": e.url, "concurrency": e.concurrency, "name": e.name} for e in fleet.endpoints()]


def sample_specs() -> list[Path]:
    """The plain-chat samples of configs/local.yaml (the tool-calling and image samples have configs and tests of
    their own: llama.cpp here serves text only, and the preflight refuses it for an image prompt set)."""
    return sorted(p for p in (REPO / "prompts_sources").glob("sample_*.yaml")
                  if "tools" not in p.name and "images" not in p.name)


def test_full_run_on_local_endpoints(tmp_path, ray_cluster, llama_fleet):
    config = write_config(tmp_path, llama_endpoints(llama_fleet), sample_specs(), **NO_IDS,
                          sampling={"temperature": 0.7, "max_tokens": 12})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    ids = committed_ids(run)
    expected = all_prompt_ids(run)
    assert len(expected) >= 100
    assert collections.Counter(ids).most_common(1)[0][1] == 1, "a prompt was committed twice"
    assert set(ids) == expected
    rows = [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]
    assert all(r["content"].strip() for r in rows), "empty completion"
    assert all(r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 for r in rows)
    assert {r["model"] for r in rows} == {"SmolLM2-135M-Instruct"}
    assert {r["endpoint"] for r in rows} == {"local-0", "local-1"}, "both endpoints should take work"
    multi_turn = [r for r in rows if r["turn_index"] > 0]
    assert multi_turn and all(r["messages"][-1]["role"] == "user" for r in rows)
    assert any(r["reference"] for r in rows), "the source's final assistant turn is kept for reference"
    assert all(r["seed"] is not None for r in rows), "temperature > 0 derives a seed per prompt"

    again = run_regen("generate", "--config", str(config))
    assert again.returncode == 0 and "is complete" in again.stderr
    assert committed_ids(run) == ids, "a finished run must not send anything again"
    status = run_regen("status", str(run))
    assert f"done {len(expected)}" in status.stdout and "complete" in status.stdout


def test_sigkill_three_times_then_resume_exactly_once(tmp_path, ray_cluster, llama_fleet):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 300)
    config = write_config(tmp_path, llama_endpoints(llama_fleet), [write_source(tmp_path, prompts)], **NO_IDS,
                          sampling={"temperature": 0.0, "max_tokens": 4}, flush_records=12, flush_interval_s=0.5)
    run = tmp_path / "out" / "t"

    def check_parts_readable() -> int:
        ids = committed_ids(run)  # raises if any committed part is torn
        assert len(ids) == len(set(ids)), "a prompt committed twice"
        return len(ids)

    # Kill 1: soon after the first part is committed.
    proc = start_regen("generate", "--config", str(config), log=tmp_path / "run1.log")
    wait_for(lambda: len(data_parts(run)) >= 1, 120, what="a first committed part")
    sigkill(proc)
    after_first = check_parts_readable()

    # Kill 2: inside a commit, after the part's fsync and before its rename (fault injection).
    proc = start_regen("generate", "--config", str(config), env=kill_at_data_part(3),
                       log=tmp_path / "run2.log")
    assert proc.wait(timeout=180) == -9, "the fault point must SIGKILL the driver"
    assert temp_files(run), "the kill between fsync and rename leaves the temporary part behind"
    after_second = check_parts_readable()
    assert after_second > after_first

    # Kill 3: mid-run, once more records are in.
    proc = start_regen("generate", "--config", str(config), log=tmp_path / "run3.log")
    wait_for(lambda: len(committed_ids(run)) >= after_second + 24, 120, what="progress before the third kill")
    sigkill(proc)
    check_parts_readable()

    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    ids = committed_ids(run)
    assert len(ids) == len(set(ids)) == 300, "every prompt exactly once"
    assert set(ids) == all_prompt_ids(run)
    assert not temp_files(run), "no temporary file may survive a resume"


def test_prompt_longer_than_context_is_a_terminal_failure(tmp_path, ray_cluster, llama_fleet):
    prompts = tmp_path / "prompts.jsonl"
    rows = write_prompts(prompts, 3)
    long_prompt = {"prompt": "Summarise this: " + " ".join(["lorem ipsum dolor sit amet"] * 300)}
    prompts.write_text(prompts.read_text() + __import__("json").dumps(long_prompt) + "\n")
    config = write_config(tmp_path, llama_endpoints(llama_fleet), [write_source(tmp_path, prompts)], **NO_IDS,
                          hedge_tail=False)  # a hedged copy is an attempt too: this proves retries only
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    assert len(committed_ids(run)) == len(rows)
    failures = [r for p in sorted((run / "failures").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(failures) == 1
    failure = failures[0]
    assert failure["attempts"] == 1, "a context overflow is never retried"
    assert failure["error_class"] == "terminal" and failure["status"] == 400
    assert "context" in failure["message"], failure["message"]  # the server's own message is kept
