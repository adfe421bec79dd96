"""Counts survive a kill (issue 30): the goodput of every committed record is part of its commit (each records
part's footer), and status.json's and /metrics' `done` count commits, not outcomes still in the buffer."""
from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq

from pipeline.store.goodput import COMMITTED
from pipeline.store.progress import Progress
from pipeline.store.rundir import RunDir
from tests.helpers import data_parts, emulators, prompt_source, run_regen, write_config


def test_goodput_counts_of_a_part_committed_just_before_a_kill_are_kept(tmp_path, ray_cluster):
    """k = 3 over 12 prompts, SIGKILLed at the third data part's folder fsync (after its publish, before the next
    status.json); resumed: the committed purposes in status.json count exactly the records and tokens the parts
    hold, and the card agrees."""
    with emulators(1, served_model_name="SmolLM2-135M-Instruct") as (server,):
        config = write_config(tmp_path, [{"url": server.url, "name": "emu"}], [prompt_source(tmp_path, 12)],
                              sampling={"temperature": 0.8, "max_tokens": 8}, samples_per_prompt=3, flush_records=8)
        killed = run_regen("generate", "--config", str(config), env={"REGEN_FAULT": "kill@3:fsync_dir:/t/data"})
        assert killed.returncode == -9, killed.stderr
        run = tmp_path / "out" / "t"
        assert len(data_parts(run)) == 3
        resumed = run_regen("generate", "--config", str(config))
        assert resumed.returncode == 0, resumed.stderr
    rows = [r for part in data_parts(run) for r in pq.read_table(part, columns=["completion_tokens"]).to_pylist()]
    assert len(rows) == 36
    goodput = orjson.loads((run / "status.json").read_bytes())["goodput"]
    assert sum(goodput["items"][p] for p in COMMITTED) == 36, goodput
    assert sum(goodput["tokens"][p] for p in COMMITTED) == sum(r["completion_tokens"] for r in rows), goodput
    status = orjson.loads(run_regen("status", str(run), "--json").stdout)
    assert status["done"] == 36 and status["goodput"] == goodput


def test_done_counts_commits_not_outcomes_in_the_buffer(tmp_path):
    """Three outcomes finished, two committed: status.json and /metrics say 2 done (plus the earlier sessions'),
    1 buffered; a committed failure counts as failed only once committed."""
    from prometheus_client import generate_latest

    from pipeline.dispatch.metrics import RunMetrics

    run = RunDir(tmp_path / "run")
    progress = Progress(run, total=10, already_done=4, failed_before=0, rejects=0, terminal=False)
    for _ in range(3):
        progress.record(True, 5, "emu")
    progress.record(False, 0, "emu")
    status = progress.status("running")
    assert (status["done"], status["failed"], status["pending"], status["buffered"]) == (4, 0, 6, 4)
    progress.committed([{"prompt_id": "a", "completion_tokens": 5, "finish_reason": "stop", "content": "x"},
                        {"prompt_id": "b", "completion_tokens": 5, "finish_reason": "stop", "content": "y"}], False)
    progress.failures_committed([{"prompt_id": "c"}])
    status = progress.status("running")
    assert (status["done"], status["failed"], status["pending"], status["buffered"]) == (6, 1, 3, 1)
    assert status["this_session"]["done"] == 2 and status["this_session"]["finished"] == 4
    metrics = RunMetrics("r", "m", "f")
    metrics.status(status)
    scrape = generate_latest(metrics.registry).decode()
    assert 'regen_prompts{run="r",state="done"} 6.0' in scrape, "the metric counts commits as status.json does"



def killed_after_its_last_commit(tmp_path, server) -> tuple[Path, Path]:
    """A run of 4 prompts whose one data part is committed (published) and then SIGKILLed at its folder's fsync,
    before the status.json write that would count it: every prompt is done. Returns (config, run)."""
    config = write_config(tmp_path, [{"url": server.url, "name": "emu"}], [prompt_source(tmp_path, 4)],
                          sampling={"temperature": 0.8, "max_tokens": 8})
    killed = run_regen("generate", "--config", str(config), env={"REGEN_FAULT": "kill@1:fsync_dir:/t/data"})
    assert killed.returncode == -9, killed.stderr
    run = tmp_path / "out" / "t"
    assert len(data_parts(run)) == 1
    return config, run


def parts_goodput(run: Path) -> tuple[int, int]:
    """(records, completion tokens) the committed parts hold."""
    rows = [r for part in data_parts(run) for r in pq.read_table(part, columns=["completion_tokens"]).to_pylist()]
    return len(rows), sum(r["completion_tokens"] for r in rows)


def committed_goodput(goodput: dict) -> tuple[int, int]:
    return sum(goodput["items"][p] for p in COMMITTED), sum(goodput["tokens"][p] for p in COMMITTED)


def test_a_run_killed_after_its_last_commit_resumes_complete_keeping_every_records_goodput(tmp_path, ray_cluster):
    """Nothing is pending on the resume, so it only reports the run complete; its status.json must count the records
    of the part the kill left uncounted (from the parts' footers), not keep the killed session's counts."""
    with emulators(1, served_model_name="SmolLM2-135M-Instruct") as (server,):
        config, run = killed_after_its_last_commit(tmp_path, server)
        resumed = run_regen("generate", "--config", str(config))
    assert resumed.returncode == 0 and "is complete" in resumed.stderr, resumed.stderr
    status = orjson.loads((run / "status.json").read_bytes())
    assert committed_goodput(status["goodput"]) == parts_goodput(run), status["goodput"]
    assert status["done"] == 4 and status["buffered"] == 0, status


def test_status_after_a_kill_counts_the_goodput_of_every_committed_part(tmp_path, ray_cluster):
    """`regen status` of a killed run, not resumed: its goodput counts the records of every committed part (their
    footers), as the card does, not only those the killed session's last status.json write had counted."""
    with emulators(1, served_model_name="SmolLM2-135M-Instruct") as (server,):
        _, run = killed_after_its_last_commit(tmp_path, server)
    status = orjson.loads(run_regen("status", str(run), "--json").stdout)
    assert status["goodput"] and committed_goodput(status["goodput"]) == parts_goodput(run), status["goodput"]
