"""End-to-end behaviour against SGLang-faithful emulators: prompt refresh, rejects, secrets, drift,
the run lock, a full disk and SIGINT. Real `regen` subprocesses, a real Ray head, real files."""
from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.emulator import make_config, start_emulator
from pipeline.emulator.model import expected_chat
from pipeline.endpoints.preflight import PROBE_RID_PREFIX
from tests.helpers import (
    all_prompt_ids, committed_ids, data_parts, run_regen, start_regen, temp_files, wait_for, write_config,
    write_prompts, write_source,
)

REPO = Path(__file__).resolve().parent.parent
MODEL = "moonshotai/Kimi-K2.5"


def endpoints_of(servers) -> list[dict]:
    return [{"url": s.url, "concurrency": 4, "name": f"emu-{i}"} for i, s in enumerate(servers)]


def request_log_lines(servers, skip: list[int] | None = None) -> list[list[dict]]:
    """Each server's own request log, less the first `skip[i]` lines."""
    logs = []
    for i, server in enumerate(servers):
        path = Path(server.options["request_log"])
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()] if path.exists() else []
        logs.append(lines[(skip or [0] * len(servers))[i]:])
    return logs


def rows_of(run: Path, folder: str = "data") -> list[dict]:
    return [r for p in sorted((run / folder).glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_records_equal_the_servers_answers_and_thinking_is_split(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 40)
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [write_source(tmp_path, prompts)], model=MODEL,
                          thinking=True, sampling={"temperature": 0.0, "max_tokens": 64})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    rows = rows_of(tmp_path / "out" / "t")
    assert len(rows) == 40
    for row in rows:
        expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 64, "temperature": 0.0,
                                  "chat_template_kwargs": {"thinking": True}},
                                 make_config(preset="kimi"))
        assert (row["content"], row["reasoning_content"], row["finish_reason"]) == (
            expected["content"], expected["reasoning_content"], expected["finish_reason"])
        assert row["completion_tokens"] == expected["completion_tokens"]
    assert all(r["weight_version"] == "default" and r["model"] == MODEL for r in rows)


def test_refresh_sends_exactly_the_new_prompts(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    rows = write_prompts(prompts, 30)
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [write_source(tmp_path, prompts)], model=MODEL)
    assert run_regen("generate", "--config", str(config)).returncode == 0
    run = tmp_path / "out" / "t"
    before = [len(log) for log in request_log_lines(emulator_fleet)]

    kept = rows[5:]  # the first 5 are removed from the source
    added = write_prompts(tmp_path / "new.jsonl", 5, start=1000)
    shuffled = kept + added
    random.Random(7).shuffle(shuffled)
    prompts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in shuffled))

    result = run_regen("generate", "--config", str(config), "--refresh-prompts")
    assert result.returncode == 0, result.stderr
    sent = [line for log in request_log_lines(emulator_fleet, skip=before) for line in log
            if not line["rid"].startswith(PROBE_RID_PREFIX)]  # the preflight's tiny probes are not prompts
    # Exactly the new prompts reach the servers (a prompt may be sent twice when the tail is hedged).
    assert {line["messages"][-1]["content"] for line in sent} == {r["prompt"] for r in added}
    assert "5 added, 5 vanished" in result.stderr
    ids = committed_ids(run)
    assert len(ids) == len(set(ids)) == 35, "the 5 removed prompts keep their records"


def test_malformed_source_rejects_each_defect_and_runs_the_rest(tmp_path, ray_cluster, emulator_fleet):
    spec = write_source(tmp_path, REPO / "tests" / "data" / "malformed.jsonl", fmt="sharegpt")
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [spec], model=MODEL)
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    rejects = pq.read_table(sorted((run / "rejects").glob("*.parquet"))[-1]).to_pylist()
    assert len(rejects) >= 8
    assert len({r["reason"] for r in rejects}) >= 8, "each defect has its own reason"
    assert all(r["origin"].startswith("malformed.jsonl:") or ":" in r["origin"] for r in rejects)
    assert len(committed_ids(run)) == len(all_prompt_ids(run)) >= 1, "the valid prompts ran"
    status = run_regen("status", str(run))
    assert f"rejected inputs {len(rejects)}" in status.stdout


def test_api_key_comes_from_the_environment_and_is_never_written(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 10)
    endpoints = [{**e, "api_key_env": "REGEN_TEST_SECRET"} for e in endpoints_of(emulator_fleet)]
    config = write_config(tmp_path, endpoints, [write_source(tmp_path, prompts)], model=MODEL)
    env = {k: v for k, v in os.environ.items() if k != "REGEN_TEST_SECRET"}
    missing = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--config", str(config)],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "REGEN_TEST_SECRET" in missing.stderr

    secret = f"sk-regen-{uuid.uuid4().hex}"
    result = run_regen("generate", "--config", str(config), env={"REGEN_TEST_SECRET": secret})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    places = [tmp_path / "out", Path(ray_cluster["temp_dir"])]
    leaks = [p for root in places for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, f"the API key was written to {leaks}"
    assert (tmp_path / "out" / "t" / "run.json").exists() and (tmp_path / "out" / "t" / "logs" / "regen.log").exists()


def test_config_drift_is_refused_and_new_run_is_accepted(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 10)
    spec = write_source(tmp_path, prompts)
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [spec], model=MODEL)
    assert run_regen("generate", "--config", str(config)).returncode == 0
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [spec], model=MODEL,
                          sampling={"temperature": 0.5, "max_tokens": 8})
    drift = run_regen("generate", "--config", str(config))
    assert drift.returncode == 3
    assert "sampling.temperature: 0.0 -> 0.5" in drift.stderr and "--new-run" in drift.stderr
    fresh = run_regen("generate", "--config", str(config), "--new-run")
    assert fresh.returncode == 0, fresh.stderr
    assert len(committed_ids(tmp_path / "out" / "t-r2")) == 10
    again = run_regen("generate", "--config", str(config))
    assert again.returncode == 0 and "is complete" in again.stderr, "the new run is the one resumed"


def test_second_driver_is_refused_and_a_stale_lock_is_taken_over(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 10)
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [write_source(tmp_path, prompts)], model=MODEL)
    run = tmp_path / "out" / "t"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipeline.store.rundir import RunDir, RunLock
        lock = RunLock(RunDir(Path({str(run)!r}))).acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    refused = run_regen("generate", "--config", str(config))
    assert refused.returncode == 4 and f"pid {holder.pid}" in refused.stderr
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    taken = run_regen("generate", "--config", str(config))
    assert taken.returncode == 0, taken.stderr
    assert f"took over a stale lock left by pid {holder.pid}" in taken.stderr
    assert len(committed_ids(run)) == 10


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): the full-disk test needs root")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_full_disk_stops_cleanly_and_resumes(tmp_path, ray_cluster, emulator_fleet, small_tmpfs):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 400)
    config = write_config(tmp_path, endpoints_of(emulator_fleet), [write_source(tmp_path, prompts)], model=MODEL,
                          output_dir=str(small_tmpfs), sampling={"temperature": 0.0, "max_tokens": 400},
                          flush_records=40)
    filler = small_tmpfs / "filler"
    try:  # leave room for the prompt set and a few parts only
        with open(filler, "wb") as handle:
            handle.write(b"\0" * (2 * 1024 * 1024))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    os.truncate(filler, os.path.getsize(filler) - 160 * 1024)
    full = run_regen("generate", "--config", str(config))
    assert full.returncode == 1, full.stderr
    assert "no space left on device" in full.stderr
    run = small_tmpfs / "t"
    done_while_full = committed_ids(run)  # every committed part is readable
    assert len(done_while_full) < 400 and len(done_while_full) == len(set(done_while_full))
    assert not temp_files(run), "no torn or temporary part is left"

    filler.unlink()
    resumed = run_regen("generate", "--config", str(config))
    assert resumed.returncode == 0, resumed.stderr
    ids = committed_ids(run)
    assert len(ids) == len(set(ids)) == 400


def test_sigint_commits_the_buffer_then_resume_completes(tmp_path, ray_cluster):
    # The last prompt hangs (not hedged, no request deadline in reach) until the server restarts for the resume:
    # the run is surely live when SIGINTed (it took about 12 s, over if the test got there late).
    slow = start_emulator(preset="kimi", tok_per_s=40, poison_text="(#119)", poison_fault="hang")
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 120)
        config = write_config(tmp_path, endpoints_of([slow]), [write_source(tmp_path, prompts)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16}, flush_records=10_000,
                              flush_interval_s=600, hedge_tail=False, request_timeout_s=600)
        run = tmp_path / "out" / "t"
        proc = start_regen("generate", "--config", str(config), log=tmp_path / "log")

        def buffered() -> bool:
            status = run / "status.json"
            return status.exists() and orjson.loads(status.read_bytes())["this_session"]["finished"] >= 8

        wait_for(buffered, 120, what="records in the buffer")
        assert not data_parts(run), "nothing is committed before the flush interval"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        interrupted = committed_ids(run)
        assert len(interrupted) >= 8, "the buffer is committed on SIGINT"
        assert orjson.loads((run / "status.json").read_bytes())["state"] == "interrupted"
        slow.restart(poison_text=None)
        resumed = run_regen("generate", "--config", str(config))
        assert resumed.returncode == 0, resumed.stderr
        ids = committed_ids(run)
        assert len(ids) == len(set(ids)) == 120
    finally:
        slow.stop()
