"""The Ray cluster regen starts itself (no address, or Ray's `local`) listens on loopback only: a Ray head
reachable from the network runs anyone's code."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from pipeline.emulator import start_emulator
from tests.helpers import prompt_source, regen_cmd, wait_for, write_config


MODEL = "moonshotai/Kimi-K2.5"


def listening_addresses(root: psutil.Process) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.setdefault(proc.name(), set()).add(conn.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def test_the_embedded_ray_cluster_binds_only_to_loopback(tmp_path):
    """`regen generate` without a Ray address starts its own cluster: every port it opens is on loopback."""
    with_slow_answers = start_emulator(preset="kimi", tok_per_s=20)
    try:
        config = write_config(tmp_path, [{"url": with_slow_answers.url, "concurrency": 2}],
                              [prompt_source(tmp_path, 40)], model=MODEL, sampling={"temperature": 0.0,
                                                                                    "max_tokens": 16})
        # as a user's shell has it: no cluster to join, and none of the test cluster's Ray settings
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        with open(tmp_path / "driver.log", "wb") as log:
            driver = subprocess.Popen(regen_cmd("generate", "--config", str(config)), stdout=log,
                                      stderr=subprocess.STDOUT, env=env)
        try:
            root = psutil.Process(driver.pid)
            seen: dict[str, set[str]] = {}

            def ray_is_up() -> bool:
                seen.update(listening_addresses(root))
                return "gcs_server" in seen and "raylet" in seen and any(
                    name.startswith("ray::") for name in seen)

            wait_for(ray_is_up, timeout=90, interval=0.5, what="the embedded Ray cluster to listen")
            time.sleep(2)
            seen.update(listening_addresses(root))
        finally:
            driver.send_signal(signal.SIGINT)
            driver.wait(timeout=60)
    finally:
        with_slow_answers.stop()
    exposed = {name: ips for name, ips in seen.items() if not all(is_loopback(ip) for ip in ips)}
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.parametrize("address, environ, embedded", [
    (None, {}, True), (None, {"RAY_ADDRESS": ""}, True), ("local", {}, True), (None, {"RAY_ADDRESS": "local"}, True),
    ("auto", {}, False), (None, {"RAY_ADDRESS": "127.0.0.1:6379"}, False), ("ray://head:10001", {}, False)])
def test_which_addresses_start_the_loopback_cluster(address, environ, embedded):
    from pipeline.dispatch.cluster import embedded_ray

    assert embedded_ray(address, environ) is embedded
