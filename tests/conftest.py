"""Shared, expensive fixtures: one Ray cluster and one local llama.cpp fleet per test session.

Ray runs as a real head node (`ray start --head`) in a private temp dir; every `regen generate`
subprocess joins it through RAY_ADDRESS, as a driver on a real head node would.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A Ray head on 127.0.0.1 for the session. Yields its address and temp dir (for log greps)."""
    # A loopback-only test cluster: Ray binds 127.0.0.1 instead of the machine's interface address,
    # and needs no auth token (drivers here are all local subprocesses).
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp_dir = Path(f"/tmp/regen-ray-{os.getpid()}")  # short: Ray's socket paths have a length limit
    shutil.rmtree(temp_dir, ignore_errors=True)
    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        check=True, capture_output=True,
    )
    address = f"127.0.0.1:{port}"
    os.environ["RAY_ADDRESS"] = address
    yield {"address": address, "temp_dir": temp_dir}
    os.environ.pop("RAY_ADDRESS", None)
    stop_cluster(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


def stop_cluster(temp_dir: Path) -> None:
    """Stop this session's Ray head only (`ray stop` would stop every Ray cluster on the machine)."""
    import psutil

    ours = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in arg for arg in proc.info["cmdline"] or []):
                ours += [proc, *proc.children(recursive=True)]  # the raylet's workers and actors too
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in ours:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ours, timeout=10)


@pytest.fixture(scope="session")
def llama_fleet(tmp_path_factory):
    """Two llama.cpp servers (SmolLM2-135M) on 127.0.0.1, each with 4 slots of 512 tokens."""
    pytest.importorskip("xllamacpp")
    from pipeline.config import LocalFleet
    from pipeline.localfleet import LocalFleetProcesses

    fleet = LocalFleet(servers=2, base_port=free_port(), slots=4, ctx_per_slot=512, threads=1)
    # base_port + 1 must be free too
    processes = LocalFleetProcesses(fleet, tmp_path_factory.mktemp("llama-logs")).start()
    yield fleet
    processes.stop()


@pytest.fixture(scope="session")
def emulator_fleet(tmp_path_factory):
    """Two SGLang-faithful emulators (Kimi preset, instant answers), each with its own request log."""
    from pipeline.emulator import start_emulator

    logs = tmp_path_factory.mktemp("emulator-logs")
    servers = [start_emulator(preset="kimi", request_log=str(logs / f"e{i}.jsonl")) for i in range(2)]
    yield servers
    for server in servers:
        server.stop()
