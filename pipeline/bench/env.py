"""What the benchmarks stand on: a private Ray head, emulated fleets, configs, samplers.

Everything here is started by the benchmark and stopped by it, by process id: the Ray head lives in its own
temp dir, and only the processes whose command line names that dir (and their children) are ended.
"""
from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import orjson
import yaml

REPO = Path(__file__).resolve().parents[2]
MODEL = "moonshotai/Kimi-K2.5"  # the emulator's default served model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _psutil():
    try:
        import psutil
    except ImportError as exc:  # a dev extra; `make setup` installs it
        raise SystemExit("the benchmarks need psutil: .venv/bin/pip install psutil") from exc
    return psutil


# --- Ray ----------------------------------------------------------------------------------------------
class RayHead:
    """`ray start --head` on 127.0.0.1 in a private temp dir (as tests/conftest.py does)."""

    ENV: ClassVar[dict[str, str]] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def __init__(self) -> None:
        self.temp_dir = Path(f"/tmp/regen-bench-ray-{os.getpid()}")  # short: Ray's socket paths are limited
        self.address: str | None = None
        self.startup_s: float | None = None
        self.restarts = 0  # another user's `ray stop --force` ends every Ray on the machine, ours included

    def start(self) -> RayHead:
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        port = free_port()
        ray_bin = str(Path(sys.executable).with_name("ray"))
        t0 = time.perf_counter()
        subprocess.run(
            [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             f"--dashboard-port={free_port()}", "--disable-usage-stats", f"--temp-dir={self.temp_dir}"],
            check=True, capture_output=True, env={**os.environ, **self.ENV},
        )
        self.startup_s = time.perf_counter() - t0
        self.address = f"127.0.0.1:{port}"
        return self

    def alive(self) -> bool:
        psutil = _psutil()
        for proc in self.processes():
            try:
                if proc.name() == "gcs_server" and proc.status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    def ensure(self) -> RayHead:
        """Start the head again if something outside the benchmark ended it."""
        if not self.alive():
            self.stop()
            self.restarts += 1
            first = self.startup_s
            self.start()
            self.startup_s = first
        return self

    def env(self) -> dict[str, str]:
        return {**self.ENV, "RAY_ADDRESS": self.address or ""}

    def processes(self) -> list:
        """This head's processes (their command line names our temp dir) and all their descendants."""
        psutil = _psutil()
        roots = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.temp_dir) in part for part in proc.info["cmdline"] or []):
                    roots.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        seen = {p.pid: p for p in roots}
        for root in roots:
            try:
                for child in root.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue
        return list(seen.values())

    def actor_processes(self) -> list:
        """regen's endpoint actors in this cluster (Ray titles them ray::EndpointWorker...)."""
        psutil = _psutil()
        out = []
        for proc in self.processes():
            try:
                if "EndpointWorker" in " ".join(proc.cmdline()) or "EndpointWorker" in proc.name():
                    out.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def stop(self) -> None:
        psutil = _psutil()
        procs = self.processes()
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# --- emulated fleets ----------------------------------------------------------------------------------
@contextmanager
def emulators(n: int, logs: Path | None = None, per: list[dict] | None = None, **options: Any) -> Iterator[list]:
    """n SGLang emulators (Kimi preset); `per[i]` overrides options of the i-th."""
    from ..emulator import start_emulator

    servers = []
    try:
        for i in range(n):
            opts = {"preset": "kimi", **options, **((per or [{}] * n)[i])}
            if logs is not None:
                opts["request_log"] = str(logs / f"e{i}.jsonl")
            servers.append(start_emulator(**opts))
        yield servers
    finally:
        for server in servers:
            server.stop()


def write_prompts(path: Path, n: int, words: int = 12) -> Path:
    """n distinct short prompts in the `prompt` format (one JSON object a line)."""
    filler = " ".join(["detail"] * max(0, words - 8))
    path.write_bytes(b"".join(
        orjson.dumps({"prompt": f"Question {i}: explain item {i * 7919 % 100003} in one short sentence. {filler}"})
        + b"\n" for i in range(n)))
    return path


def write_config(folder: Path, urls: list[str], concurrency: list[int] | int, prompts: Path, max_tokens: int,
                 run_name: str = "bench", **overrides: Any) -> Path:
    """A regen config: these endpoints, one JSONL source, default flush settings unless overridden."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "source.yaml"
    spec.write_text(yaml.safe_dump({"name": "bench", "kind": "jsonl", "path": str(prompts), "format": "prompt"}))
    conc = concurrency if isinstance(concurrency, list) else [concurrency] * len(urls)
    cfg = {
        "run_name": run_name,
        "output_dir": str(folder / "out"),
        "model": MODEL,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
        "sources": [{"spec": str(spec)}],
        "endpoints": [{"url": u, "concurrency": c, "name": f"e{i}"} for i, (u, c) in enumerate(zip(urls, conc))],
        **overrides,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_regen(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`regen generate --config X` (as `python -m pipeline`), its output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pipeline", "generate", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **env})


def wait_regen(proc: subprocess.Popen, log: Path, timeout: float, alive=None) -> int:
    """Wait for regen; stop it (SIGTERM) past `timeout`, or as soon as `alive()` says the Ray head is gone."""
    deadline = time.monotonic() + timeout
    last_check = time.monotonic()
    while time.monotonic() < deadline:
        try:
            return proc.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
        if alive is not None and time.monotonic() - last_check > 2:
            last_check = time.monotonic()
            if not alive():
                deadline = 0
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"regen did not finish (timeout {timeout:.0f}s or the Ray head died):\n"
                       f"{log.read_text(errors='replace')[-3000:]}")


def committed(run: Path) -> tuple[int, float | None]:
    """(rows committed, time of the last commit) of a run directory."""
    import pyarrow.parquet as pq

    parts = sorted((run / "data").glob("part-*.parquet"))
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    return rows, max((p.stat().st_mtime for p in parts), default=None)


def run_client(args: list[str], timeout: float = 900) -> dict:
    """A baseline client (pipeline.bench.clients) in its own process; returns its JSON line."""
    out = subprocess.run([sys.executable, "-m", "pipeline.bench.clients", *args], capture_output=True, text=True,
                         cwd=REPO, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"baseline client failed:\n{out.stderr[-3000:]}")
    return orjson.loads(out.stdout.strip().splitlines()[-1])


# --- samplers -----------------------------------------------------------------------------------------
class StatsPoller(threading.Thread):
    """Polls each emulator's /admin/stats on a kept-alive connection every `interval` seconds."""

    def __init__(self, urls: list[str], interval: float = 0.05):
        super().__init__(daemon=True)
        self.urls, self.interval = urls, interval
        self.samples: list[tuple[float, list[dict]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        conns = [http.client.HTTPConnection(u.split("://")[1], timeout=5) for u in self.urls]
        while not self._halt.is_set():
            t = time.time()
            row = []
            for i, conn in enumerate(conns):
                try:
                    conn.request("GET", "/admin/stats")
                    row.append(orjson.loads(conn.getresponse().read()))
                except (OSError, http.client.HTTPException, ValueError):
                    conns[i] = http.client.HTTPConnection(self.urls[i].split("://")[1], timeout=5)
                    row.append({})
            self.samples.append((t, row))
            self._halt.wait(max(0.0, self.interval - (time.time() - t)))

    def stop(self) -> StatsPoller:
        self._halt.set()
        self.join(10)
        return self

    def first_activity(self, after: float = 0.0, skip: int = 0) -> float | None:
        """When requests first showed up (in flight or finished), to within one interval. The first `skip`
        requests are not counted: regen's preflight sends a probe or two per endpoint seconds before dispatch."""
        base = None
        prev_t = None
        for t, row in self.samples:
            total = sum(s.get("in_flight", 0) + s.get("requests_finished", 0) for s in row)
            if base is None:
                base = total
            elif total > base + skip and t >= after:
                return t - self.interval / 2 if prev_t is None else (t + prev_t) / 2
            prev_t = t
        return None


class RssSampler(threading.Thread):
    """RSS of the regen driver (and its children) and of the cluster's endpoint actors, every `interval` s."""

    def __init__(self, pid: int, head: RayHead | None, run: Path | None = None, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.head, self.run_path, self.interval = pid, head, run, interval
        self.samples: list[dict] = []  # t, driver_mb, actors_mb, done
        self._halt = threading.Event()

    def run(self) -> None:
        psutil = _psutil()
        try:
            driver = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        actors: list = []
        last_scan = 0.0
        while not self._halt.is_set():
            t = time.time()
            try:
                if driver.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: its RSS reads 0
                    break
                rss = driver.memory_info().rss + sum(c.memory_info().rss for c in driver.children(recursive=True))
            except psutil.NoSuchProcess:
                break
            if self.head is not None and (not actors or t - last_scan > 5):
                actors, last_scan = self.head.actor_processes(), t
            actor_rss = 0
            for proc in actors:
                try:
                    actor_rss += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.samples.append({"t": t, "driver_mb": rss / 2**20, "actors_mb": actor_rss / 2**20,
                                 "done": self._done()})
            self._halt.wait(self.interval)

    def _done(self) -> int | None:
        if self.run_path is None:
            return None
        try:
            return orjson.loads((self.run_path / "status.json").read_bytes())["this_session"]["done"]
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> RssSampler:
        self._halt.set()
        self.join(10)
        return self


def actor_pids_when_ready(head: RayHead, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = head.actor_processes()
        if len(procs) >= n:
            return [p.pid for p in procs]
        time.sleep(0.2)
    return [p.pid for p in head.actor_processes()]


def median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
