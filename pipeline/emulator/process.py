"""Run the emulator in a subprocess (for pytest fixtures and dry runs)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .config import make_config, options_to_argv
from .server import free_port

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class EmulatorProcess:
    """A `python -m pipeline.emulator` subprocess. `.url`, `.stop()`, `.kill()` (SIGKILL), `.restart()`."""

    def __init__(self, port: int, options: dict[str, Any], host: str = "127.0.0.1",
                 wait_healthy: bool = True, timeout: float = 20.0):
        make_config(**options)                       # fail fast on unknown options, in the caller
        self.host, self.port, self.options = host, port, dict(options)
        self.wait_healthy, self.timeout = wait_healthy, timeout
        fd, self.log_path = tempfile.mkstemp(prefix=f"emulator-{port}-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "pipeline.emulator", "--host", self.host, "--port", str(self.port),
                *options_to_argv(self.options)]

    def start(self) -> "EmulatorProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=_REPO_ROOT, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:       # 503: up but not healthy
                last = e
                if not self.wait_healthy:
                    return
            except (OSError, urllib.error.URLError) as e:
                last = e
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"emulator on {self.url} not ready after {self.timeout}s ({last}):\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0, remove_log: bool = True) -> None:
        """SIGTERM, then SIGKILL if it does not exit in `timeout` seconds. Removes the log file unless asked."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if remove_log:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL (no cleanup, like a crashed server)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def restart(self, **changes: Any) -> "EmulatorProcess":
        """Stop (if running) and start again on the same port, optionally with changed options."""
        self.stop(remove_log=False)
        self.options.update(changes)
        return self.start()

    def __enter__(self) -> "EmulatorProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmulatorProcess({self.url}, pid={self.pid}, alive={self.alive()})"


def start_emulator(port: int = 0, *, wait_healthy: bool = True, timeout: float = 20.0,
                   **options: Any) -> EmulatorProcess:
    """Start `python -m pipeline.emulator` on 127.0.0.1:port (0: a free port) and wait for /health = 200.

    `options` are EmulatorConfig fields (e.g. preset="kimi", tok_per_s=50, fault_500=0.1, enable_metrics=True).
    """
    host = options.pop("host", "127.0.0.1")
    if not port:
        port = free_port(host)
    return EmulatorProcess(port, options, host=host, wait_healthy=wait_healthy, timeout=timeout)
