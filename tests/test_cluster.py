"""Cluster mode: a two-raylet Ray cluster losing a node mid-run, live fleet changes through an endpoints
file, and prefix-aware routing against plain least-loaded routing."""
from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.emulator import start_emulator
from tests.conftest import stop_cluster
from tests.helpers import (
    committed_ids, data_parts, emulators, free_port, prompt_source, regen_log_says, run_regen, set_faults, set_speed,
    start_regen, wait_for, wait_while_running,
    write_config, write_prompts, write_source,
)

MODEL = "moonshotai/Kimi-K2.5"
pytestmark = pytest.mark.slow


def rows_of(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def status_of(run: Path) -> dict:
    try:
        return orjson.loads((run / "status.json").read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}


@pytest.fixture
def two_node_cluster(tmp_path):
    """`ray start --head` plus a second `ray start --address=...`: two raylets on two loopback addresses."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head_dir, worker_dir = Path(f"/tmp/regen-h-{os.getpid()}"), Path(f"/tmp/regen-w-{os.getpid()}")
    port = free_port()
    common = ["--num-cpus=1", "--disable-usage-stats"]
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.2", f"--port={port}",
                    "--include-dashboard=false", f"--temp-dir={head_dir}", *common], check=True, capture_output=True,
                   env=env)
    subprocess.run([ray_bin, "start", f"--address=127.0.0.2:{port}", "--node-ip-address=127.0.0.3",
                    "--labels=regen-rack=b", f"--temp-dir={worker_dir}", *common], check=True, capture_output=True,
                   env=env)
    yield {"env": {"RAY_ADDRESS": f"127.0.0.2:{port}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
           "worker_dir": worker_dir}
    stop_cluster(worker_dir)
    stop_cluster(head_dir)
    shutil.rmtree(head_dir, ignore_errors=True)
    shutil.rmtree(worker_dir, ignore_errors=True)


def test_losing_a_worker_node_moves_its_work_to_the_survivors(tmp_path, two_node_cluster):
    # The servers answer slowly (about 100 s of work) until the node is gone: the run lasts until the second
    # node's actors work and the test has killed it, unless they take minutes to start; then the test fails
    # saying so (an event, not a guess at start-up times)
    with emulators(4, preset="kimi", tok_per_s=4) as servers:
        config = write_config(tmp_path, [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"}
                                         for i, s in enumerate(servers)],
                              [prompt_source(tmp_path, 200)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16}, flush_records=4, status_interval_s=0.2)
        run, console = tmp_path / "out" / "t", tmp_path / "log"
        proc = start_regen("generate", "--config", str(config), env=two_node_cluster["env"], log=console)
        try:
            def working_on_both_nodes() -> bool:
                nodes = {e.get("node") for e in status_of(run).get("endpoints", {}).values() if e.get("requests")}
                return len(committed_ids(run)) >= 4 and {"127.0.0.2", "127.0.0.3"} <= nodes

            wait_while_running(proc, console, working_on_both_nodes, 240, "progress on both nodes")
            stop_cluster(two_node_cluster["worker_dir"])  # SIGKILL the second node's raylet and its workers
            set_speed(servers, 40)
            assert proc.wait(timeout=300) == 0, console.read_text()[-3000:]
        finally:
            proc.kill()
        assert status_of(run)["actor_restarts"] >= 1, "the lost node held endpoint actors"
        ids = committed_ids(run)
        assert len(ids) == len(set(ids)) == 200


def test_actors_are_pinned_by_resource_or_label_and_the_rest_spread(tmp_path, two_node_cluster):
    pins = [{"name": "on-head", "ray_resources": {"node:127.0.0.2": 0.01}},
            {"name": "on-rack-b", "ray_labels": {"regen-rack": "b"}}, {"name": "free-0"}, {"name": "free-1"}]
    # slow (about 100 s of work for three endpoints) until all four actors are ready, so that each takes work
    with emulators(4, preset="kimi", tok_per_s=1) as servers:
        config = write_config(tmp_path, [{"url": s.url, "concurrency": 4, **pin} for s, pin in zip(servers, pins)],
                              [prompt_source(tmp_path, 160)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 8}, status_interval_s=0.2,
                              ray={"actor_start_concurrency": 4})  # all four at once: each must take work
        run, console = tmp_path / "out" / "t", tmp_path / "log"
        proc = start_regen("generate", "--config", str(config), env=two_node_cluster["env"], log=console)
        try:
            wait_while_running(proc, console, regen_log_says(run, "4 of 4 endpoint actors ready"), 240,
                               "the four actors ready")
            set_speed(servers, 50)
            assert proc.wait(timeout=300) == 0, console.read_text()[-3000:]
        finally:
            proc.kill()
    endpoints = status_of(run)["endpoints"]
    assert all(stats.get("requests", 0) > 0 for stats in endpoints.values()), endpoints
    nodes = {label: stats["node"] for label, stats in endpoints.items()}
    assert nodes["on-head"] == "127.0.0.2" and nodes["on-rack-b"] == "127.0.0.3"
    assert {nodes["free-0"], nodes["free-1"]} == {"127.0.0.2", "127.0.0.3"}, "unpinned actors spread"


def test_an_actor_ray_cannot_place_gets_no_work_and_the_run_completes(tmp_path, ray_cluster):
    with emulators(2, preset="kimi", tok_per_s=400) as servers:
        endpoints = [{"url": servers[0].url, "concurrency": 4, "name": "placed"},
                     {"url": servers[1].url, "concurrency": 4, "name": "nowhere", "ray_labels": {"rack": "none"}}]
        config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 40)], model=MODEL, hedge_tail=False,
                              sampling={"temperature": 0.0, "max_tokens": 8})
        result = run_regen("generate", "--config", str(config), timeout=120)
    assert result.returncode == 0, result.stderr
    rows = rows_of(tmp_path / "out" / "t")
    assert len(rows) == 40 and {r["endpoint"] for r in rows} == {"placed"}


def test_endpoints_file_adds_and_drains_endpoints_live(tmp_path, ray_cluster):
    first = start_emulator(preset="kimi", tok_per_s=40)
    second = start_emulator(preset="kimi", tok_per_s=40)
    try:
        fleet_file = tmp_path / "endpoints.txt"
        # first at concurrency 2, and slowed while second's actor starts: alone, it could take every prompt before
        # second's actor started on a loaded machine
        fleet_file.write_text(f"# the fleet\n{first.url} 2\n")
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 240)
        config = write_config(tmp_path, [], [write_source(tmp_path, prompts)], model=MODEL,
                              endpoints_file=str(fleet_file), endpoints_file_interval_s=0.3,
                              sampling={"temperature": 0.0, "max_tokens": 16}, flush_records=10,
                              status_interval_s=0.2)
        run = tmp_path / "out" / "t"
        first_label, second_label = first.url.split("://")[1], second.url.split("://")[1]
        proc = start_regen("generate", "--config", str(config), log=tmp_path / "log")
        wait_for(lambda: len(committed_ids(run)) >= 20, 120, what="the first endpoint working")
        set_faults(first, tok_per_s=4)  # held slow until the new endpoint works: the run cannot end before it joins
        fleet_file.write_text(f"{first.url} 2\n{second.url} 4\n")
        wait_for(lambda: any(r["endpoint"] == second_label for r in rows_of(run)), 240, what="the new endpoint's work")
        set_faults(first, tok_per_s=40)
        fleet_file.write_text(f"{second.url} 4\n")
        wait_for(lambda: first_label not in status_of(run).get("endpoints", {}), 60, what="the removed one to drain")
        drained_at = len(committed_ids(run))
        assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
        log = (tmp_path / "log").read_text()
        assert f"endpoint {second_label} joins the fleet" in log and f"endpoint {first_label} leaves the fleet: drained" in log
        rows = rows_of(run)
        counts = collections.Counter(r["endpoint"] for r in rows)
        assert counts[first_label] > 0 and counts[second_label] > 0
        assert len(rows) == len({r["prompt_id"] for r in rows}) == 240
        assert drained_at < 240, "the drain happened mid-run"
    finally:
        first.stop()
        second.stop()


FAMILY_SYSTEM = ("You are assistant number {f}. You work for the {f}th department of a large library and you answer "
                 "questions about its collection, its opening hours, its reading rooms, its rules for borrowing rare "
                 "books, and the history of the building, always politely, briefly and accurately, in plain words.")


def run_routing(tmp_path: Path, name: str, affinity_chars: int) -> tuple[float, float]:
    """Cache hit rate (cached / prompt tokens) and makespan of 288 prompts in 48 prefix families. The servers
    answer slowly until all four actors are ready: on a loaded machine an actor may start after the run's end,
    and the endpoints that started first would take every family (an event, not a guess at start-up times)."""
    servers = [start_emulator(preset="kimi", enable_cache_report=True, cache_max_tokens=1500, tok_per_s=2)
               for _ in range(4)]
    try:
        lines = [orjson.dumps({"messages": [{"role": "system", "content": FAMILY_SYSTEM.format(f=i % 48)},
                                            {"role": "user", "content": f"Question {i}: when do you open?"}]})
                 for i in range(288)]
        work = tmp_path / name
        work.mkdir()
        (work / "p.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        config = write_config(work, [{"url": s.url, "concurrency": 4, "name": f"emu-{i}"}
                                     for i, s in enumerate(servers)],
                              [write_source(work, work / "p.jsonl", fmt="openai")], model=MODEL,
                              prefix_affinity_chars=affinity_chars, sampling={"temperature": 0.0, "max_tokens": 8})
        run = work / "out" / "t"
        started = time.monotonic()
        proc = start_regen("generate", "--config", str(config), log=work / "log")
        try:
            wait_while_running(proc, work / "log", regen_log_says(run, "4 of 4 endpoint actors ready"), 240,
                               "the four endpoint actors")
            set_speed(servers, 400)
            assert proc.wait(timeout=300) == 0, (work / "log").read_text()[-3000:]
        finally:
            proc.kill()
        makespan = time.monotonic() - started
        rows = rows_of(run)
        assert len(rows) == 288
        return sum(r["cached_tokens"] or 0 for r in rows) / sum(r["prompt_tokens"] for r in rows), makespan
    finally:
        for server in servers:
            server.stop()


def test_prefix_affinity_raises_the_cache_hit_rate(tmp_path, ray_cluster):
    affinity_hits, affinity_makespan = run_routing(tmp_path, "affinity", 200)
    plain_hits, plain_makespan = run_routing(tmp_path, "plain", 0)
    print(f"\nrouting: cache hit rate {affinity_hits:.1%} with prefix affinity vs {plain_hits:.1%} least-loaded; "
          f"makespan {affinity_makespan:.1f}s vs {plain_makespan:.1f}s (incl. start-up)")
    assert affinity_hits > plain_hits + 0.10


def test_simulate_runs_the_real_pipeline_on_a_sample_and_predicts(ray_cluster):
    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "pipeline", "simulate", "configs/local.yaml", "--endpoints", "2",
                             "--tok-s", "50", "--sample", "40", "--speedup", "10"],
                            capture_output=True, text=True, cwd=repo, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sampled 40 of 112 prompts" in result.stdout
    tokens = int(next(line for line in result.stdout.splitlines() if "predicted tokens" in line)
                 .split()[2].replace(",", ""))
    assert tokens > 112, "every prompt is predicted to produce tokens"
    assert "predicted wall time" in result.stdout and "predicted disk" in result.stdout
    wall = next(line for line in result.stdout.splitlines() if line.startswith("predicted wall time"))
    assert " at concurrency " in wall and "per endpoint" in wall, wall  # the concurrency it predicted at
    # Issue 23: it says that the real fleet was not checked, and how to check it.
    assert ("this ran against 2 emulated SGLang endpoints on 127.0.0.1, serving SmolLM2-135M-Instruct: none of the "
            "config's real endpoints (local-0, local-1) was contacted or checked. `regen preflight configs/local.yaml` "
            "checks them") in result.stdout
