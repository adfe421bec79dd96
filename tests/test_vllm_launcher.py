"""The launcher of a local vLLM server (pipeline/endpoints/vllm_serve.py) stops the server's whole process group,
its EngineCore and workers included, whichever goes first: the server itself (a real SIGKILL of its pid, as the
OOM killer sends), or the driver (its lifeline closes). The server is a stand-in that forks an engine process like
vLLM's (tests/standin_vllm_server.py): the launcher code is the same, without vLLM's 45 s start."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import LocalFleet
from pipeline.core.errors import RunFatal
from pipeline.endpoints.localfleet import VLLM_SERVE, LocalFleetProcesses
from pipeline.endpoints.preflight import run_preflight_command
from tests.helpers import free_port, wait_for

STANDIN = Path(__file__).with_name("standin_vllm_server.py")
SAMPLE_SPEC = Path(__file__).resolve().parent.parent / "prompts_sources" / "sample_prompts.yaml"


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def launched(tmp_path):
    read_end, write_end = os.pipe()
    pids = tmp_path / "pids"
    log = open(tmp_path / "launcher.log", "wb")
    launcher = subprocess.Popen([sys.executable, str(VLLM_SERVE), "--server-script", str(STANDIN), "--lifeline-fd",
                                 str(read_end), "--", str(pids)], pass_fds=(read_end,), start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
    os.close(read_end)
    wait_for(pids.exists, 20, what="the stand-in server started")
    server, engine = map(int, pids.read_text().split())
    state = {"launcher": launcher, "server": server, "engine": engine, "lifeline": write_end,
             "log": tmp_path / "launcher.log"}
    yield state
    for pid in (server, engine):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait(10)
    if state["lifeline"] is not None:
        os.close(write_end)
    log.close()


def test_a_sigkilled_api_server_takes_its_engine_processes_with_it(launched):
    assert alive(launched["engine"]) and os.getpgid(launched["engine"]) == launched["server"]
    os.kill(launched["server"], signal.SIGKILL)
    wait_for(lambda: not alive(launched["engine"]), 20, interval=0.1, what="the engine process stopped")
    assert launched["launcher"].wait(20) == 128 + signal.SIGKILL, "the launcher exits with the server's status"
    assert "exited by itself" in launched["log"].read_text()


def test_the_driver_going_stops_the_server_and_its_engine_processes(launched):
    os.close(launched["lifeline"])  # what the kernel does when the driver exits, SIGKILL included
    launched["lifeline"] = None
    wait_for(lambda: not alive(launched["engine"]) and not alive(launched["server"]), 30, interval=0.1,
             what="the server and its engine process stopped")
    launched["launcher"].wait(20)
    assert "the driver is gone" in launched["log"].read_text()


def test_the_drivers_sigterm_stops_the_server_and_its_engine_processes(launched):
    launched["launcher"].terminate()
    assert launched["launcher"].wait(30) == 128 + signal.SIGTERM
    assert not alive(launched["engine"]) and not alive(launched["server"])


# --- a server that does not start ----------------------------------------------------------------------------
def broken_fleet(tmp_path) -> dict:
    """A vLLM fleet whose python has no vLLM (regen's own): its launcher starts, its server fails to import."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {"engine": "vllm", "servers": 1, "base_port": free_port(), "vllm_python": sys.executable,
            "model_path": str(model), "start_timeout_s": 60}


def test_a_vllm_that_does_not_start_says_why_with_its_log(tmp_path):
    fleet = LocalFleet(**broken_fleet(tmp_path))
    with pytest.raises(RunFatal) as info:
        LocalFleetProcesses(fleet, tmp_path / "logs").start()
    log = tmp_path / "logs" / f"vllm-{fleet.base_port}.log"
    assert "exited with status 1 while starting" in str(info.value)
    assert f"(its log: {log}), ending:" in str(info.value)
    assert "No module named" in str(info.value), "the last lines of its log"


def test_regen_preflight_keeps_the_log_of_a_server_that_did_not_start(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"run_name": "r", "model": "SmolLM2-135M-Instruct",
                                      "sources": [{"spec": str(SAMPLE_SPEC)}],
                                      "local_fleet": broken_fleet(tmp_path)}))
    assert run_preflight_command(str(config)) == 1
    error = capsys.readouterr().err
    assert "No module named" in error
    log = Path(error.split("(its log: ", 1)[1].split(")", 1)[0])
    assert log.exists() and "No module named" in log.read_text()
    shutil.rmtree(log.parent)
