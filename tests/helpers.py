"""Small helpers shared by the tests: configs, prompt files, running the real `regen` command."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import pyarrow.parquet as pq
import yaml

TOPICS = ["rivers", "volcanoes", "bread", "bicycles", "owls", "glaciers", "violins", "tides", "bees", "comets",
          "maps", "clocks", "salt", "kites", "moss", "lighthouses", "copper", "tea", "deserts", "coral"]
ASKS = ["Name one fact about {t}.", "Give a one-line tip about {t}.", "In five words, describe {t}.",
        "Why are {t} interesting? One sentence.", "Write a short title for an essay on {t}."]


def free_port() -> int:
    """A port free now, with the next one free too (fleets take consecutive ports)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 64000:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port


def write_prompts(path: Path, n: int, start: int = 0) -> list[dict[str, Any]]:
    """n distinct short prompts in the `prompt` format (one JSON object a line)."""
    rows = []
    for i in range(start, start + n):
        ask = ASKS[i % len(ASKS)].format(t=TOPICS[(i // len(ASKS)) % len(TOPICS)])
        rows.append({"prompt": f"{ask} (#{i})"})
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return rows


def write_source(tmp: Path, data: Path, fmt: str = "prompt", name: str = "test") -> Path:
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"name": name, "kind": "jsonl", "path": str(data), "format": fmt}))
    return spec


def write_config(tmp: Path, endpoints: list[dict], specs: list[Path], **overrides: Any) -> Path:
    cfg = {
        "run_name": "t",
        "output_dir": str(tmp / "out"),
        "model": "SmolLM2-135M-Instruct",
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "sources": [{"spec": str(s)} for s in specs],
        "endpoints": endpoints,
        "flush_interval_s": 1,
        "flush_records": 16,
        # An endpoint whose actor has not answered yet counts as down: on a loaded 2-core machine a run's actors
        # can take 30 s and more to start. A test that proves the deadline sets its own.
        "dead_fleet_deadline_s": 120,
        "status_interval_s": 0.5,
    }
    cfg.update(overrides)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def post_json(url: str, body: dict, timeout: float = 30) -> tuple[int, Any]:
    """(status, the JSON answer) of a POST to a server, an error status's body included."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def set_faults(server, **settings) -> None:
    """Change an emulator's run-time settings (POST /admin/faults); `reset_faults` puts back its launch values."""
    status, answer = post_json(server.url + "/admin/faults", settings, timeout=10)
    assert status == 200, answer


def reset_faults(*servers) -> None:
    for server in servers:
        status, answer = post_json(server.url + "/admin/reset", {}, timeout=10)
        assert status == 200, answer


def set_speed(servers, tok_per_s: float) -> None:
    """Every emulator's decode speed: requests that start from now on run at it (those in flight keep theirs)."""
    for server in servers:
        set_faults(server, tok_per_s=tok_per_s)


def regen_log_says(run: Path, text: str):
    """A predicate: the run's own log (RUN/logs/regen.log) holds `text`."""
    log = run / "logs" / "regen.log"
    return lambda: log.exists() and text in log.read_text(errors="replace")


def wait_while_running(proc: subprocess.Popen, output: Path, predicate, timeout: float, what: str) -> None:
    """Wait for `predicate` while regen runs: a run that ends first fails the test at once, with its output. A test
    that needs an event during a run holds the servers slow (`set_speed`) until it has seen it: on a loaded machine
    a Ray actor can take 30 s to start, longer than a fast run lasts."""
    def seen() -> bool:
        running = proc.poll() is None  # read before the predicate: a run that logs the event and ends passes
        if predicate():
            return True
        assert running, f"the run ended (exit {proc.returncode}) before {what}:\n" + \
            output.read_text(errors="replace")[-3000:]
        return False

    wait_for(seen, timeout, 0.1, what)


def regen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def run_regen(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(regen_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def start_regen(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(regen_cmd(*args), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_gone(pidfds: dict[int, int], timeout: float) -> list[int]:
    """Wait until every process (pid: its pidfd, readable once it has exited) is gone, or `timeout` passes; the
    pids still running then."""
    import select

    deadline, left = time.monotonic() + timeout, dict(pidfds)
    while left and time.monotonic() < deadline:
        poller = select.poll()
        for pidfd in left.values():
            poller.register(pidfd, select.POLLIN)
        for pidfd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            left = {pid: fd for pid, fd in left.items() if fd != pidfd}
    return sorted(left)


@contextlib.contextmanager
def regen_running(*args: str, log: Path | None = None):
    """`regen *args` started in the background; killed on the way out if the test left it running."""
    proc = start_regen(*args, log=log)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sigkill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def data_parts(run: Path) -> list[Path]:
    return sorted((run / "data").glob("part-*.parquet"))


def committed_ids(run: Path) -> list[str]:
    """All prompt_ids of committed parts, duplicates included (every part must be readable)."""
    ids: list[str] = []
    for part in data_parts(run):
        ids += pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()
    return ids


def all_prompt_ids(run: Path) -> set[str]:
    latest = sorted((run / "prompts").glob("prompts-*.parquet"))[-1]
    return set(pq.read_table(latest, columns=["prompt_id"]).column(0).to_pylist())


def temp_files(run: Path) -> list[Path]:
    return [p for p in run.rglob(".tmp-*")]


@contextlib.contextmanager
def emulators(n: int, **options: Any):
    """n SGLang emulators for one test, stopped afterwards."""
    from pipeline.emulator import start_emulator

    servers = [start_emulator(**options) for _ in range(n)]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def prompt_source(tmp: Path, n: int) -> Path:
    """A source spec of n distinct short prompts."""
    write_prompts(tmp / "p.jsonl", n)
    return write_source(tmp, tmp / "p.jsonl")


def require_installed(what: str) -> None:
    """A cached install (the vLLM venv, its model) is missing: under `make test`, which installs it and names it in
    REGEN_VLLM_PYTHON, that is a failure; a bare `pytest` run without it skips."""
    if os.environ.get("REGEN_VLLM_PYTHON"):
        pytest.fail(f"{what} is missing although `make test` installed it")
    pytest.skip(f"{what} is missing: run `make vllm`")


def commit_a_failure(run: Path | str) -> None:
    """Bind a run's identity as its first commit does: one terminal failure, committed as the run commits it (a
    run that has committed nothing takes whatever config reruns it: docs/resume-and-drift.md)."""
    import pyarrow as pa

    from pipeline.store import schema
    from pipeline.store.rundir import RunDir, now_utc

    run_dir = RunDir(str(run))
    prompts = run_dir.load_prompt_set()
    prompt_id = prompts.column("prompt_id")[0].as_py() if prompts is not None and prompts.num_rows else "p0"
    row = {"prompt_id": prompt_id, "source": "test", "error_class": "TerminalForPrompt", "status": 400,
           "message": "committed by the test", "endpoint": "test", "attempts": 1, "config_fingerprint": None,
           "created_at": now_utc()}
    run_dir.write_part(run_dir.failures, pa.Table.from_pylist([row], schema=schema.FAILURES))


def handed_out(table, cfg, folder: Path | str | None = None, fingerprint: str | None = None):
    """A RecordBuilder over `table` as a run reads its prompt set (a pinned Parquet file, by position), with every
    prompt handed out as the dispatcher hands them out: (builder, {prompt_id: WorkItem})."""
    import tempfile

    import pyarrow.parquet as pq

    from pipeline.store.prompt_reader import PromptSetReader
    from pipeline.store.records import RecordBuilder
    from pipeline.store.storage import Location

    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="regen-prompts-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prompts-000001.parquet"
    pq.write_table(table, path)
    reader = PromptSetReader(Location.at(path))
    builder = RecordBuilder(reader, cfg, fingerprint=fingerprint)
    pending = reader.pending(set(), set(), True, cfg.prefix_affinity_chars).pending
    return builder, {item.prompt_id: item for item in builder.work_items(pending)}


async def exchange_all(worker, items: list, rounds: int = 600) -> list:
    """Hand `items` to an EndpointWorker and collect their outcomes: each exchange waits on the worker's event, at
    most 0.5 s, for `rounds` exchanges at most; the worker is closed after."""
    outcomes = list((await worker.exchange(items, wait_s=1.0)).outcomes)
    for _ in range(rounds):
        if len(outcomes) == len(items):
            break
        outcomes += (await worker.exchange([], wait_s=0.5)).outcomes
    await worker.close()
    return outcomes


# A `regen generate` subprocess SIGKILLed at its first read of status.json: after run.json and the prompt set are
# written, before its preflight: a run that has committed nothing (a start refused there leaves no trace).
KILLED_BEFORE_ITS_PREFLIGHT = {"REGEN_FAULT": "kill@1:read:/status.json"}
KILLED = -9


@contextlib.contextmanager
def left_as_a_kill_leaves_it():
    """In-process `regen generate` calls refused before their first commit keep what they wrote (run.json, the
    prompt set), as a start SIGKILLed at that point leaves its run: a run that has committed nothing. A refused
    start itself puts the run back as it was (store/untouched.py); tests of what an unbound run does start here."""
    from unittest import mock

    with mock.patch("pipeline.store.untouched.Untouched.undo_after", return_value=False):
        yield


def one_source_config(tmp_path, name: str, spec_fields: dict) -> str:
    """A config of one source (its spec written beside it) and a dead endpoint: for reading the sources only."""
    import yaml

    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"name": name, **spec_fields}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": name, "model": "m", "sources": [{"spec": str(spec)}],
                                      "endpoints": [{"url": "http://127.0.0.1:1"}]}))
    return str(config)


def staged_by_source_ref(config: str):
    """The prompt set the config's sources stage (discarded after): ({source_ref: row}, the first source's report)."""
    import pyarrow.parquet as pq

    from pipeline.core.config import load_config
    from pipeline.store.promptset import stage_prompt_set

    result = stage_prompt_set(load_config(config))
    try:
        rows = pq.read_table(str(result.prompts.path)).to_pylist()
        return {r["source_ref"]: r for r in rows}, result.result.reports[0]
    finally:
        result.discard()
