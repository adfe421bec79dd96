"""The local llama.cpp fleet dies with its driver, and a port already in use is refused, never reused.

Real servers (xllamacpp + SmolLM2-135M), a real driver process killed with SIGKILL, psutil to find what is
left; and a stand-in for a stale server: a plain HTTP server on 127.0.0.1 that answers /health."""
from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from pipeline.core.config import LocalFleet
from pipeline.core.errors import RunFatal
from pipeline.endpoints import localfleet
from pipeline.endpoints.localfleet import LocalFleetProcesses
from tests.helpers import (
    committed_ids, data_parts, free_port, run_regen, sigkill, start_regen, wait_for, write_config, write_prompts,
    write_source,
)


def port_in_use(port: int) -> bool:
    """Something listens on 127.0.0.1:port."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def server_processes(driver_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(driver_pid).children(recursive=True)
            if "pipeline.endpoints.localfleet" in " ".join(p.cmdline())]


def kill_leftovers(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


@pytest.mark.llama
def test_local_servers_die_with_a_sigkilled_driver(tmp_path):
    pytest.importorskip("xllamacpp")
    port = free_port()
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipeline.core.config import LocalFleet
        from pipeline.endpoints.localfleet import LocalFleetProcesses
        fleet = LocalFleet(servers=2, base_port={port}, slots=1, ctx_per_slot=256, threads=1)
        LocalFleetProcesses(fleet, Path({str(tmp_path)!r})).start()
        print("serving", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    servers: list[psutil.Process] = []
    try:
        assert driver.stdout.readline().strip() == "serving"
        servers = server_processes(driver.pid)
        assert len(servers) == 2 and port_in_use(port) and port_in_use(port + 1)
        sigkill(driver)
        gone, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"servers outlived their driver: {[p.pid for p in alive]}"
        assert not port_in_use(port) and not port_in_use(port + 1), "their ports are free again"
    finally:
        if driver.poll() is None:
            sigkill(driver)
        kill_leftovers(servers)


class _StaleServer(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.requests.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_in_use_is_refused_and_never_talked_to(tmp_path, monkeypatch):
    monkeypatch.setattr(localfleet, "PORT_RELEASE_WAIT_S", 1.0, raising=False)  # how long a port may take to free
    port = free_port()
    stale = http.server.ThreadingHTTPServer(("127.0.0.1", port), _StaleServer)
    threading.Thread(target=stale.serve_forever, daemon=True).start()
    try:
        fleet = LocalFleetProcesses(LocalFleet(servers=2, base_port=port), tmp_path)
        with pytest.raises(RunFatal, match=f"127.0.0.1:{port} is in use"):
            fleet.start()
        assert _StaleServer.requests == [], "regen never talks to a server it did not start"
        assert fleet.processes == []
    finally:
        stale.shutdown()
        stale.server_close()


@pytest.mark.llama
@pytest.mark.slow
def test_a_sigkilled_regen_leaves_no_server_and_its_resume_starts_its_own(tmp_path, ray_cluster):
    pytest.importorskip("xllamacpp")
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 24)
    port = free_port()
    config = write_config(tmp_path, [], [write_source(tmp_path, prompts)], return_token_ids=False,
                          sampling={"temperature": 0.0, "max_tokens": 8}, flush_records=4, dead_fleet_deadline_s=60,
                          local_fleet={"servers": 2, "base_port": port, "slots": 2, "ctx_per_slot": 512})
    run = tmp_path / "out" / "t"
    driver = start_regen("generate", "--config", str(config), log=tmp_path / "log")
    servers: list[psutil.Process] = []
    try:
        wait_for(lambda: len(server_processes(driver.pid)) == 2, 60, what="the local servers")
        servers = server_processes(driver.pid)
        wait_for(lambda: len(data_parts(run)) >= 1, 180, what="a committed part")
        sigkill(driver)
        gone, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"servers outlived regen: {[p.pid for p in alive]}"
        resumed = run_regen("generate", "--config", str(config))
        assert resumed.returncode == 0, resumed.stderr
        ids = committed_ids(run)
        assert len(ids) == len(set(ids)) == 24
        assert not port_in_use(port) and not port_in_use(port + 1), "the resume stopped its servers"
    finally:
        if driver.poll() is None:
            sigkill(driver)
        kill_leftovers(servers)


def test_a_stop_cut_short_still_kills_the_servers_and_closes_their_lifelines(tmp_path):
    """A second Ctrl-C arrives while stop() waits for a server that ignores SIGTERM. Before the fix the
    interrupt left that server running and its lifeline pipe (the driver's write end) open: a leaked
    descriptor, and a server that lives on until the driver exits."""
    import os
    import signal

    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                                 "time.sleep(60)"], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline().strip() == b"up"
    stubborn.stdout.close()
    read_end, write_end = os.pipe()
    fleet = LocalFleetProcesses(LocalFleet(), tmp_path, processes=[stubborn], lifelines=[write_end])
    # Python's own Ctrl-C handler, whatever an earlier test in this process installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fleet.stop()
        stubborn.wait(timeout=5)
        assert stubborn.returncode is not None, "the server is gone"
        assert os.read(read_end, 1) == b"", "the lifeline's write end is closed (end of file for the server)"
        assert fleet.lifelines == [] and fleet.processes == []
    finally:
        signal.signal(signal.SIGINT, previous)
        if stubborn.poll() is None:
            stubborn.kill()
        os.close(read_end)


def test_a_vllm_capture_server_gets_both_flags_and_only_the_connector_folder_on_its_path(tmp_path):
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    fleet = LocalFleet(engine="vllm", servers=1, model_path=str(model), hidden_states_dir=str(tmp_path / "hs"))
    cmd = localfleet.vllm_command(fleet, 18500, 3)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert (kv["kv_connector"], kv["kv_role"]) == ("CpuHiddenStatesConnector", "kv_producer")
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    path = localfleet.vllm_environment(fleet, 0)["PYTHONPATH"]
    assert (Path(path) / f"{kv['kv_connector_module_path']}.py").exists()
    plain = LocalFleet(engine="vllm", servers=1, model_path=str(model))
    assert "--kv-transfer-config" not in localfleet.vllm_command(plain, 18500, 3)
    with pytest.raises(ValueError, match="need engine: vllm"):
        LocalFleet(hidden_states_dir=str(tmp_path / "hs"))


def test_a_vision_language_vllm_server_and_an_emulator_fleet_get_their_launch_arguments(tmp_path):
    """configs/local_vlm.yaml's fields become vLLM's flags (paths resolved against the config's folder, `~` expanded);
    configs/local_images.yaml's fleet runs the emulator's preset with a lifeline; each field only with its engine."""
    from pipeline.core.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "local_vlm.yaml")
    assert cfg.local_fleet.model_path == str(Path.home() / ".cache/regen/models/tiny-kimi-k25")
    fleet = LocalFleet(engine="vllm", attention_backend="CPU_MLA", allowed_local_media_path=str(tmp_path),
                       extra_args=["--enable-scale-out"])
    cmd = localfleet.vllm_command(fleet, 18500, 3)
    assert cmd[cmd.index("--attention-backend"):] == ["--attention-backend", "CPU_MLA", "--allowed-local-media-path",
                                                     str(tmp_path), "--enable-scale-out"]
    emulator = LocalFleet(engine="emulator", emulator_preset="plain", model_alias="m", slots=3)
    cmd = localfleet.emulator_command(emulator, 18500, 7)
    assert cmd[1:3] == ["-m", "pipeline.emulator"] and cmd[cmd.index("--preset") + 1] == "plain"
    assert cmd[cmd.index("--lifeline-fd") + 1] == "7" and cmd[cmd.index("--capacity") + 1] == "3"
    for wrong in ({"attention_backend": "CPU_MLA"}, {"extra_args": ["--x"]},
                  {"engine": "vllm", "emulator_preset": "plain"}):
        with pytest.raises(ValueError, match="need"):
            LocalFleet(**wrong)
