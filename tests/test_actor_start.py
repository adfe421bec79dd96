"""How a session's endpoint actors start (pipeline/dispatch/startup.py): the first ones before the preflight, empty
until it passes, the rest a few at a time, and work goes to each actor as soon as it is ready. Real `regen generate`
subprocesses on a real Ray head, against SGLang emulators that log every request they get, and the run's own log."""
from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from pipeline.endpoints.probes import PROBE_RID_PREFIX
from tests.helpers import (
    all_prompt_ids, emulators, prompt_source, regen_log_says, regen_running, run_regen, set_speed,
    wait_while_running, write_config,
)

MODEL = "moonshotai/Kimi-K2.5"
SHORT_CONTEXT = 200  # below max_tokens + min_prompt_tokens: the preflight refuses it


def requests_to(log: Path) -> list[dict]:
    """The generation requests an emulator got (its request log), preflight probes included."""
    data = log.read_bytes() if log.exists() else b""
    return [orjson.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()]  # lines written whole


def logged_at(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_server_the_preflight_refuses_gets_no_request_from_its_early_started_actor(tmp_path, ray_cluster):
    """Both actors start before the preflight (actor_start_concurrency 2), one for the misconfigured server: the run
    is refused, and the servers saw the preflight's probes and nothing else."""
    with emulators(1, preset="kimi", context_length=SHORT_CONTEXT, request_log=str(tmp_path / "e0.jsonl")) as bad, \
            emulators(1, preset="kimi", request_log=str(tmp_path / "e1.jsonl")) as good:
        endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(bad + good)]
        config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 6)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 32},
                              ray={"address": ray_cluster["address"], "actor_start_concurrency": 2})
        out = run_regen("generate", "--config", str(config), timeout=180)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "fleet preflight refused the run" in out.stderr and "emu-0" in out.stderr
    assert not (tmp_path / "out" / "t").exists()  # a refused new run leaves no directory (its log went with it)
    said = out.stderr
    assert "started 2 of 2 endpoint actors while the run is read and the fleet probed" in said
    assert said.index("started 2 of 2 endpoint actors") < said.index("fleet preflight refused the run")
    for log in (tmp_path / "e0.jsonl", tmp_path / "e1.jsonl"):
        got = requests_to(log)
        assert got and all(r["rid"].startswith(PROBE_RID_PREFIX) for r in got), [r["rid"] for r in got]


def test_one_actor_starts_first_and_takes_work_before_the_others_are_ready(tmp_path, ray_cluster):
    """actor_start_concurrency 1 over four servers: one actor starts before the preflight, the other three once it
    is ready; the log tells each ready in turn, a prompt is done before the last actor is ready (work went to the
    first at once), and every prompt is committed once."""
    run, console = tmp_path / "out" / "t", tmp_path / "console.txt"
    first_log = tmp_path / "e0.jsonl"
    with emulators(1, preset="kimi", tok_per_s=40, request_log=str(first_log)) as first, \
            emulators(3, preset="kimi", tok_per_s=40) as others:
        servers = first + others
        endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)]
        config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 80)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16},
                              ray={"address": ray_cluster["address"], "actor_start_concurrency": 1})
        with regen_running("generate", "--config", str(config), log=console) as proc:
            # emu-0 alone would finish the 80 prompts before three actors start on a loaded machine: once it has
            # answered a prompt the servers slow down, until the log says all four actors are ready
            wait_while_running(proc, console, lambda: any(not r["rid"].startswith(PROBE_RID_PREFIX)
                                                          for r in requests_to(first_log)), 240, "emu-0's first prompt")
            set_speed(servers, 2)
            wait_while_running(proc, console, regen_log_says(run, "4 of 4 endpoint actors ready"), 240,
                               "the four actors ready")
            set_speed(servers, 40)
            assert proc.wait(timeout=240) == 0, console.read_text()[-2000:]
    run = tmp_path / "out" / "t"
    lines = (run / "logs" / "regen.log").read_text().splitlines()
    assert any("started 1 of 4 endpoint actors while the run is read and the fleet probed (1 at a time)" in line
               for line in lines)
    ready = [line for line in lines if " endpoint actors ready after " in line]
    assert [line.split(" regen.dispatch: ")[1].split(" endpoint")[0] for line in ready] == [
        "1 of 4", "2 of 4", "3 of 4", "4 of 4"]
    assert "(emu-0)" in ready[0]  # the one started early
    rows = [r for p in sorted((run / "data").glob("part-*.parquet"))
            for r in pq.read_table(p, columns=["prompt_id", "created_at"]).to_pylist()]
    assert Counter(Counter(r["prompt_id"] for r in rows).values()) == {1: 80}
    assert {r["prompt_id"] for r in rows} == all_prompt_ids(run)
    first_record = min(r["created_at"].timestamp() for r in rows)
    assert first_record < logged_at(ready[-1]), "work went out only once every actor was ready"
