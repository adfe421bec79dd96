"""Every storage failure point, enumerated rather than sampled (issue 13), on POSIX and on S3.

Each operation of tests/storage_scenarios.py (a data commit, a failure commit, a hidden part, the prompt set,
run.json, status.json, the lock or lease) runs once per I/O call in it, with the N-th call faulted, for
N = 1, 2, ... until a run sees no fault. At every point the operation fails cleanly (a StorageError naming
the file and the reason) or completes (the fault retried or absorbed), and after a resume nothing is lost,
nothing doubled, every committed file reads back whole and no temporary file is left or taken for a part.

- POSIX: the seam in pipeline/store/storage.py raises EIO, ENOSPC or EACCES at the N-th call, once or from
  then on (an outage), makes the N-th write(2) short, or raises the KeyboardInterrupt of a second SIGINT.
- S3: tests/s3_fault_proxy.py, a reverse proxy in front of moto, answers the N-th HTTP request with a 500
  (after doing it), a 503, a 403 or a connection reset. "retried": pyarrow's own S3 client, whose SDK
  retries (a persistent retryable fault there takes ~6 s per call, so outages are enumerated without SDK
  retries: "no retry" is one request whose retries ran out, "outage" every request from the N-th on). The
  seam adds the second SIGINT there too.
- SIGKILL: tests/storage_kill_child.py forks a child per point that the seam SIGKILLs at the N-th call; the
  resume and the checks run here, in this process.
What a single fault cannot reach (two faults in one commit, a lost lease) is in tests/test_atomic_commits.py and tests/test_lease.py.
Set REGEN_FAULT_TABLE=path to write every point as JSON (tests/fault_table.py turns it into
docs/storage-faults.md).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from pipeline.store import storage
from pipeline.store.faults import Faults
from pipeline.store.rundir import RunDir
from pipeline.store.storage import Location
from tests.fault_enumeration import REASONS, Point, enumerate_points, file_pattern, problems_report, verify
from tests.s3_fault_proxy import FaultProxy
from tests.storage_scenarios import SCENARIOS

REPO = Path(__file__).resolve().parent.parent
POSIX_FAULTS = [("EIO", "once"), ("EIO", "outage"), ("ENOSPC", "once"), ("ENOSPC", "outage"),
                ("EACCES", "once"), ("EACCES", "outage"), ("short", "once"), ("interrupt", "once")]
# What regen can see of an S3 fault: the request was refused or done, the error surfaced or the SDK retried
# it, the store came back or stayed down. 403 is never retried; 503 and a reset are retried like a 500 that
# was refused, so once their retries run out they are refused-and-surfaced (503/no retry) or an outage.
S3_PLAN = [("500", "retried"), ("500", "no retry"), ("500", "outage"), ("403", "retried"), ("503", "no retry"),
           ("reset", "outage")]
ALL_POINTS: list[Point] = []


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    yield
    target = os.environ.get("REGEN_FAULT_TABLE")
    if target:
        Path(target).write_text(json.dumps([p.__dict__ for p in ALL_POINTS], indent=1))


@pytest.fixture
def fast_dir(tmp_path):
    """Run directories for the POSIX enumerations: on tmpfs where there is one, since a thousand points of
    real fsyncs would measure the disk's latency rather than the code (the call sequences are the same)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="regen-faults-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def disarmed():
    storage.arm(None)
    yield
    storage.arm(None)


class Seam:
    """Arms the storage seam for one enumeration and describes the faulted calls."""

    def __init__(self, fault: str, persistent: bool, ops: frozenset[str] = frozenset()):
        self.fault, self.persistent, self.ops = fault, persistent, ops
        self.plan: Faults | None = None
        self.run_path = ""

    def arm(self, n: int) -> None:
        self.plan = Faults(n, self.fault, persistent=self.persistent, ops=self.ops)
        storage.arm(self.plan)

    def disarm(self) -> list[str]:
        storage.arm(None)
        return [f"{op} {file_pattern(path, self.run_path)}" for op, path in (self.plan.fired if self.plan else [])]


def check_points(points: list[Point]) -> None:
    ALL_POINTS.extend(points)
    assert not [p for p in points if p.problems], problems_report(points)


# --- POSIX -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_posix_fault_at_every_io_call(fast_dir, name):
    scenario = SCENARIOS[name]
    points: list[Point] = []
    for fault, mode in POSIX_FAULTS:
        seam = Seam(fault, mode == "outage", frozenset({"write"}) if fault == "short" else frozenset())

        def make_run(n: int, fault=fault, mode=mode, seam=seam) -> RunDir:
            run = RunDir(fast_dir / f"{fault}-{mode}" / str(n) / "run")
            seam.run_path = run.path.path
            return run

        points += enumerate_points(scenario, "POSIX", fault, mode, make_run, seam.arm, seam.disarm,
                                   expect_reason=REASONS.get(fault))
    check_points(points)
    assert points, "the operation made no I/O call"
    by_fault = {(p.fault, p.mode): {q.outcome for q in points if (q.fault, q.mode) == (p.fault, p.mode)}
                for p in points}
    assert by_fault[("short", "once")] <= {"ok"}, "a short write is completed by the next write"
    assert by_fault[("interrupt", "once")] <= {"interrupt", "ok", "logged"}
    if name == "status.json":
        assert all(p.outcome in ("ok", "logged", "interrupt") for p in points), "a status write never ends the run"


# --- S3 --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3(object_store):
    moto_port = int(re.search(r"endpoint_override=127\.0\.0\.1:(\d+)", object_store("x")).group(1))
    proxy = FaultProxy(moto_port).start()
    no_retry = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{proxy.port}", scheme="http", allow_delayed_open=True,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    yield proxy, no_retry
    proxy.stop()


def s3_location(proxy: FaultProxy, prefix: str, fs: pafs.FileSystem | None = None) -> Location:
    query = f"endpoint_override=127.0.0.1:{proxy.port}&scheme=http"
    if fs is None:
        return Location.at(f"s3://regen-test/{prefix}?{query}")
    return Location(f"regen-test/{prefix}", "s3", query, fs)


def s3_enumeration(proxy: FaultProxy, fs: pafs.FileSystem | None, name: str, fault: str, mode: str,
                   prefix: str) -> list[Point]:
    state = {"run": ""}

    def make_run(n: int) -> RunDir:
        where = s3_location(proxy, f"{prefix}/{fault}/{mode}/{n}/run", fs)
        state["run"] = "/" + where.path
        return RunDir(where)

    def disarm() -> list[str]:
        return [f"{what.split(' ')[0]} {file_pattern(what.split(' ', 1)[1], state['run'])}"
                for what in proxy.disarm().fired]

    return enumerate_points(SCENARIOS[name], "S3", fault, mode, make_run,
                            lambda n: proxy.arm(n, fault, persistent=mode == "outage"), disarm)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_s3_fault_at_every_request(s3, name):
    proxy, no_retry = s3
    scenario = SCENARIOS[name]
    prefix = f"enum-{time.time_ns()}/{name.replace('/', '_')}"
    points: list[Point] = []
    for fault, mode in S3_PLAN:
        points += s3_enumeration(proxy, None if mode == "retried" else no_retry, name, fault, mode, prefix)
    seam = Seam("interrupt", False)

    def make_run(n: int) -> RunDir:
        run = RunDir(s3_location(proxy, f"{prefix}/interrupt/{n}/run"))
        seam.run_path = run.path.path
        return run

    points += enumerate_points(scenario, "S3", "interrupt", "once", make_run, seam.arm, seam.disarm)
    check_points(points)
    if name == "status.json":
        assert all(p.outcome in ("ok", "logged", "interrupt") for p in points), "a status write never ends the run"
    retried = {p.outcome for p in points if p.mode == "retried" and p.fault != "403"}
    assert "ok" in retried, "the SDK retries a single 500, 503 or reset"


# --- SIGKILL ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["POSIX", "S3"])
def test_sigkill_at_every_io_call_then_resume(fast_dir, request, backend):
    if backend == "S3":
        proxy, _ = request.getfixturevalue("s3")
        base = s3_location(proxy, f"kill-{time.time_ns()}").uri
    else:
        base = str(fast_dir)
    child = subprocess.run([sys.executable, "-m", "tests.storage_kill_child", base, *SCENARIOS],
                           capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert child.returncode == 0, child.stderr[-3000:]
    results = [json.loads(line) for line in child.stdout.splitlines()]
    points: list[Point] = []
    for name in SCENARIOS:
        mine = [r for r in results if r["scenario"] == name]
        assert mine and mine[-1]["signal"] is None and mine[-1]["calls"], f"{name}: no unfaulted end: {mine[-3:]}"
        calls, calls_run = mine[-1]["calls"], Location.at(mine[-1]["run"]).path  # the unfaulted run's calls
        assert all(r["signal"] == 9 for r in mine[:-1]) and len(mine) == len(calls) + 1, mine
        for r in mine:
            problems = verify(SCENARIOS[name](), RunDir(Location.at(r["run"])))  # a fresh process's resume
            call = f"{calls[r['n'] - 1][0]} {file_pattern(calls[r['n'] - 1][1], calls_run)}" if r["signal"] else "(no fault)"
            points.append(Point(name, backend, "SIGKILL", "once", r["n"], call, "killed" if r["signal"] else "ok",
                                problems))
    check_points(points)
