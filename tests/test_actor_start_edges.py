"""Edges of the early actor start (pipeline/dispatch/startup.py) that a user meets: the endpoints file edited while
the run is read and the fleet probed, signals during the start. Real `regen generate` subprocesses on a real Ray
head, against SGLang emulators that log every request they get."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pipeline.endpoints.probes import PROBE_RID_PREFIX
from tests.helpers import emulators, prompt_source, start_regen, wait_for, write_config
from tests.test_actor_start import MODEL, requests_to


def run_log(tmp_path: Path) -> str:
    path = tmp_path / "out" / "t" / "logs" / "regen.log"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("edit", ["concurrency", "replaced"])
def test_an_endpoint_edited_into_the_file_during_the_preflight_still_gets_work(tmp_path, ray_cluster, edit):
    """Two actors (one CPU each, the cluster's two) start early for the endpoints file's first two servers; while a
    third endpoint that never answers holds the preflight, the second server's concurrency is edited (`concurrency`)
    or it is replaced by another server (`replaced`). The early actor of the old entry must not sit on the CPU the new
    entry's actor needs: the edited (or new) server gets prompts."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts connections (the kernel's backlog) and never answers: the preflight waits for it
    fleet = tmp_path / "fleet.txt"
    logs = [tmp_path / f"e{i}.jsonl" for i in range(3)]
    try:
        with emulators(1, preset="kimi", tok_per_s=20, request_log=str(logs[0])) as first, \
                emulators(1, preset="kimi", tok_per_s=20, request_log=str(logs[1])) as second, \
                emulators(1, preset="kimi", tok_per_s=20, request_log=str(logs[2])) as third:
            urls = [s.url for s in first + second] + [f"http://127.0.0.1:{hole.getsockname()[1]}"]
            fleet.write_text("".join(f"{url} 2\n" for url in urls))
            config = write_config(tmp_path, [], [prompt_source(tmp_path, 40)], model=MODEL,
                                  sampling={"temperature": 0.0, "max_tokens": 16}, endpoints_file=str(fleet),
                                  endpoints_file_interval_s=1, dead_fleet_deadline_s=120,
                                  ray={"address": ray_cluster["address"], "actor_start_concurrency": 2,
                                       "actor_num_cpus": 1})
            proc = start_regen("generate", "--config", str(config), "--start-with-passing",
                               log=tmp_path / "console.txt")
            try:
                wait_for(lambda: "started 2 of 3 endpoint actors" in run_log(tmp_path), 120, 0.02, "the early actors")
                assert " regen.dispatch: dispatch: " not in run_log(tmp_path), "the preflight was over before the edit"
                edited = f"{urls[1]} 3" if edit == "concurrency" else f"{third[0].url} 2"
                fleet.write_text(f"{urls[0]} 2\n{edited}\n{urls[2]} 2\n")
                proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        hole.close()
    console = (tmp_path / "console.txt").read_text()
    assert proc.returncode == 0, console[-3000:]
    generations = [r for r in requests_to(logs[1 if edit == "concurrency" else 2]) if not r["rid"].startswith(PROBE_RID_PREFIX)]
    assert generations, run_log(tmp_path)[-4000:]
