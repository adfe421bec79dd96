"""Edges of the early actor start (pipeline/dispatch/startup.py) that a user meets: the endpoints file edited while
the run is read and the fleet probed, signals during the start. Real `regen generate` subprocesses on a real Ray
head, against SGLang emulators that log every request they get."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from pipeline.endpoints.probes import PROBE_RID_PREFIX
from tests.helpers import (
    committed_ids, emulators, prompt_source, regen_cmd, regen_running, set_faults, wait_for, wait_while_running,
    write_config,
)
from tests.test_actor_start import MODEL, SHORT_CONTEXT, requests_to


def run_log(tmp_path: Path) -> str:
    path = tmp_path / "out" / "t" / "logs" / "regen.log"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("edit", ["concurrency", "replaced"])
def test_an_endpoint_edited_into_the_file_during_the_preflight_still_gets_work(tmp_path, ray_cluster, edit):
    """Two actors (one CPU each, the cluster's two) start early for the endpoints file's first two servers; while a
    third endpoint whose generation hangs (its probe's 30 s timeout; its other routes answer) holds the preflight, the
    second server's concurrency is edited (`concurrency`) or it is replaced by another server (`replaced`). The early
    actor of the old entry must not sit on the CPU the new entry's actor needs: the edited (or new) server gets
    prompts. A server the fleet's preflight did not judge joins through its own, after the held-out third endpoint's
    actor has started: with 0.6 CPU an actor, the cluster's two CPUs hold the first server's, the third's and the
    new one's only if the old entry's early actor is gone. The first server answers slowly until the edited one has
    taken work: alone, it would finish the run before a new actor starts on a loaded machine."""
    fleet = tmp_path / "fleet.txt"
    logs = [tmp_path / f"e{i}.jsonl" for i in range(3)]
    edited_log = logs[1 if edit == "concurrency" else 2]
    console = tmp_path / "console.txt"
    with emulators(1, preset="kimi", tok_per_s=1, request_log=str(logs[0])) as first, \
            emulators(1, preset="kimi", tok_per_s=20, request_log=str(logs[1])) as second, \
            emulators(1, preset="kimi", tok_per_s=20, request_log=str(logs[2])) as third, \
            emulators(1, preset="kimi", health_ok_while_hung=True) as holding:
        urls = [s.url for s in first + second + holding]
        fleet.write_text("".join(f"{url} 2\n" for url in urls))
        config = write_config(tmp_path, [], [prompt_source(tmp_path, 40)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16}, endpoints_file=str(fleet),
                              endpoints_file_interval_s=1, dead_fleet_deadline_s=120,
                              ray={"address": ray_cluster["address"], "actor_start_concurrency": 2,
                                   "actor_num_cpus": 1 if edit == "concurrency" else 0.6})
        with regen_running("generate", "--config", str(config), "--start-with-passing", log=console) as proc:
            wait_for(lambda: "started 2 of 3 endpoint actors" in run_log(tmp_path), 120, 0.02, "the early actors")
            assert " regen: dispatch: " not in run_log(tmp_path), "the preflight was over before the edit"
            edited = f"{urls[1]} 3" if edit == "concurrency" else f"{third[0].url} 2"
            fleet.write_text(f"{urls[0]} 2\n{edited}\n{urls[2]} 2\n")
            wait_while_running(proc, console, lambda: any(not r["rid"].startswith(PROBE_RID_PREFIX)
                                                          for r in requests_to(edited_log)), 240,
                               "a prompt sent to the edited server")
            set_faults(first[0], tok_per_s=20)
            proc.wait(timeout=240)
    assert proc.returncode == 0, console.read_text()[-3000:]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def still_running(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return alive


def generate_without_a_ray_address(tmp_path: Path, config: Path) -> subprocess.Popen:
    """`regen generate` with no Ray address in its environment (it starts an embedded cluster), its console
    into tmp_path/console.txt."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    with open(tmp_path / "console.txt", "wb") as out:
        return subprocess.Popen(regen_cmd("generate", "--config", str(config)), stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def assert_interrupted_before_its_first_commit(tmp_path, console: str) -> None:
    """A run stopped by a signal before its first commit. Before the dispatch, a new run is undone as a refused start
    is (docs/resume-and-drift.md): the console's last line says interrupted and no run directory is left (its log
    went with it). Once the dispatch started (Ray's start may hold the signal until it returns), the run stays,
    resumable, and the console's last line is the run's end line."""
    lines = [line for line in console.strip().splitlines() if line.startswith("regen: ")]  # not Ray's own lines
    if (tmp_path / "out" / "t").exists():
        assert lines[-1].split(": ", 1)[1].startswith("run ended (exit 130): interrupted"), console[-3000:]
        assert run_log(tmp_path).strip().splitlines()[-1].split(": ", 1)[1].startswith("run ended (exit 130)")
    else:
        assert lines[-1].endswith("regen: interrupted"), console[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_embedded_ray_cluster_starts_stops_the_run_and_leaves_no_ray_process(tmp_path, sig):
    """No Ray address: the session starts its own cluster before it reads the run. A signal while it starts: exit
    130, the log's last line says interrupted, and none of the cluster's processes outlives the driver."""
    with emulators(1, preset="kimi", request_log=str(tmp_path / "e0.jsonl")) as servers:
        config = write_config(tmp_path, [{"url": servers[0].url, "concurrency": 2}], [prompt_source(tmp_path, 6)],
                              model=MODEL, sampling={"temperature": 0.0, "max_tokens": 8})
        driver = generate_without_a_ray_address(tmp_path, config)
        seen: dict[int, psutil.Process] = {}
        try:
            def ray_starting() -> bool:
                for proc in descendants(driver.pid):
                    seen[proc.pid] = proc
                return any("gcs_server" in " ".join(p.cmdline()) for p in seen.values() if p.is_running())

            wait_for(ray_starting, 120, 0.05, "the embedded cluster's gcs_server")
            assert "endpoint actors while the run is read" not in run_log(tmp_path)
            driver.send_signal(sig)
            end = time.monotonic() + 60
            while driver.poll() is None and time.monotonic() < end:
                for proc in descendants(driver.pid):
                    seen[proc.pid] = proc
                time.sleep(0.05)
            code = driver.wait(timeout=5)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        # what dies with its parent goes within seconds (5 s was a guess a loaded machine can miss); 20 s stays
        # below the minute after which Ray's own processes give up on a lost GCS, so none can pass by timing out
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not still_running(list(seen.values())), 20, 0.2, "the cluster's processes to exit")
        left = still_running(list(seen.values()))
        for proc in seen.values():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    console = (tmp_path / "console.txt").read_text(errors="replace")
    assert code == 130, console[-3000:]
    assert not left, left
    assert_interrupted_before_its_first_commit(tmp_path, console)
    assert not [r for r in requests_to(tmp_path / "e0.jsonl") if not r["rid"].startswith(PROBE_RID_PREFIX)]


def test_a_fleet_the_preflight_refuses_is_refused_without_starting_an_embedded_ray_cluster(tmp_path):
    """No Ray address: the session would start a whole cluster of its own (several seconds, and Ray's lines on the
    terminal) to refuse a misconfigured fleet. The refusal comes first, as before the early start: exit 1, the
    refusal on the terminal, no Ray process ever started, no actor line in the log."""
    with emulators(1, preset="kimi", context_length=SHORT_CONTEXT) as bad:
        config = write_config(tmp_path, [{"url": bad[0].url, "concurrency": 2}], [prompt_source(tmp_path, 6)],
                              model=MODEL, sampling={"temperature": 0.0, "max_tokens": 32})
        driver = generate_without_a_ray_address(tmp_path, config)
        started: set[str] = set()
        try:
            end = time.monotonic() + 120
            while driver.poll() is None and time.monotonic() < end:
                for proc in descendants(driver.pid):
                    try:
                        started.update(part for part in ("gcs_server", "raylet") if part in " ".join(proc.cmdline()))
                    except psutil.NoSuchProcess:
                        continue
                time.sleep(0.02)
            code = driver.wait(timeout=5)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    console = (tmp_path / "console.txt").read_text(errors="replace")
    assert code == 1, console[-3000:]
    assert "fleet preflight refused the run" in console
    assert not started, f"Ray started to refuse the run: {started}"
    assert "endpoint actors" not in run_log(tmp_path)


def endpoint_actor_processes(temp_dir: Path) -> list[str]:
    """The endpoint actors of the Ray cluster in temp_dir (a worker of its raylet): not another xdist worker's
    cluster's, nor another run's on the machine."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "RayEndpointWorker" in cmd and any(f"{temp_dir}/" in " ".join(parent.cmdline())
                                                  for parent in proc.parents()):
                found.append(f"{proc.pid} {cmd[:100]}")
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_preflight_kills_the_early_actors_and_sends_nothing(tmp_path, ray_cluster, sig):
    """The early actors run while an endpoint whose generation hangs (for its probe's 30 s timeout; its other routes
    answer) holds the preflight; a signal then: exit 130, the log's last line says interrupted, the servers got no
    prompt, and no endpoint actor is left in the cluster. (An endpoint that accepts and never answers held the
    preflight only for the 5 s of its information requests: too short for two actors to start on a loaded machine.)"""
    with emulators(2, preset="kimi", request_log=str(tmp_path / "e.jsonl")) as servers, \
            emulators(1, preset="kimi", health_ok_while_hung=True) as (hung,):
        endpoints = [{"url": s.url, "concurrency": 2} for s in (*servers, hung)]
        config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 6)], model=MODEL,
                              ray={"address": ray_cluster["address"], "actor_start_concurrency": 2})
        with regen_running("generate", "--config", str(config), "--start-with-passing",
                           log=tmp_path / "console.txt") as proc:
            wait_for(lambda: "started 2 of 3 endpoint actors" in run_log(tmp_path), 120, 0.02, "the early actors")
            wait_for(lambda: len(endpoint_actor_processes(ray_cluster["temp_dir"])) >= 2, 25, 0.1,
                     "the early actors' processes")
            assert " regen: dispatch: " not in run_log(tmp_path)
            proc.send_signal(sig)
            code = proc.wait(timeout=60)
    console = (tmp_path / "console.txt").read_text(errors="replace")
    assert code == 130, console[-3000:]
    assert_interrupted_before_its_first_commit(tmp_path, console)
    assert not [r for r in requests_to(tmp_path / "e.jsonl") if not r["rid"].startswith(PROBE_RID_PREFIX)]
    wait_for(lambda: not endpoint_actor_processes(ray_cluster["temp_dir"]), 30, 0.5, "the early actors to end")


def test_a_first_actor_ray_cannot_place_does_not_keep_the_rest_from_starting(tmp_path, ray_cluster):
    """actor_start_concurrency 1 and the first endpoint pinned to a resource no node has: its early actor never
    starts. The second endpoint's actor still starts (once the first has held the start for START_HOLD_S), every
    prompt is committed once by it, and the run ends."""
    with emulators(2, preset="kimi", request_log=str(tmp_path / "e.jsonl")) as servers:
        endpoints = [{"url": servers[0].url, "concurrency": 2, "name": "pinned",
                      "ray_resources": {"no_such_node": 1}},
                     {"url": servers[1].url, "concurrency": 2, "name": "free"}]
        config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 6)], model=MODEL,
                              ray={"address": ray_cluster["address"], "actor_start_concurrency": 1})
        with regen_running("generate", "--config", str(config), log=tmp_path / "console.txt") as proc:
            code = proc.wait(timeout=180)
    said = run_log(tmp_path)
    assert code == 0, said[-3000:]
    assert "1 of 2 endpoint actors ready" in said and "(free)" in said
    assert len(committed_ids(tmp_path / "out" / "t")) == 6


def test_a_replacement_actor_is_not_counted_again_among_the_ready(caplog):
    """`_restart_due` clears a slot's `answered`: the replacement's first answer counted as one more actor ready,
    so "2 of 2 endpoint actors ready" could be logged while the other endpoint's actor had not answered."""
    from pipeline.core.config import Endpoint
    from pipeline.dispatch.slot import Slot
    from pipeline.dispatch.startup import StartGate

    slots = {label: Slot(Endpoint.model_validate({"url": f"http://127.0.0.1:{port}", "name": label}), None)
             for label, port in (("a", 1), ("b", 2))}
    gate = StartGate(slots, None, [], None)
    with caplog.at_level("INFO", logger="regen.dispatch"):
        gate.answered(slots["a"])
        slots["a"].answered = True
        slots["a"].answered = False  # its actor died and a replacement started
        gate.answered(slots["a"])
        assert gate.ready == 1 and "2 of 2" not in caplog.text
        gate.answered(slots["b"])
    assert gate.ready == 2 and "2 of 2 endpoint actors ready" in caplog.text
