"""The enumeration engine: run a scenario (tests/storage_scenarios.py) once per I/O call, faulting the N-th,
for N = 1, 2, ... until a run sees no fault, and check the invariants at every point.

A point's outcome is what the operation did: "ok" (it completed: the fault was retried or absorbed),
"logged" (status.json: the failure was logged, the run goes on), "error" (a StorageError naming the file
and the reason; "error?" when it said the commit may have happened), "interrupt" (the KeyboardInterrupt
of a second signal), "killed". Anything else, or a broken invariant, is a problem.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.core.errors import PartExists, RunLocked, StorageError
from pipeline.store.rundir import RunDir
from tests.storage_scenarios import Scenario

MAX_POINTS = 400  # every loop is bounded: no operation here has nearly this many I/O calls
REASONS = {"EIO": "Input/output error", "ENOSPC": "no space left on device", "EACCES": "Permission denied"}


@dataclass
class Point:
    scenario: str
    backend: str
    fault: str
    mode: str
    n: int
    call: str  # the faulted call: "op file" (POSIX seam) or "REQUEST file" (S3 proxy)
    outcome: str
    problems: list[str] = field(default_factory=list)


def file_pattern(path: str, run_path: str) -> str:
    """A path relative to its run, with its unique parts starred: data/.tmp-part-*.parquet.*"""
    run_path = run_path.rstrip("/")
    if path.split("?", 1)[0].rstrip("/") == run_path:
        return "."
    rel = path.split(run_path + "/", 1)[-1] if run_path in path else path.rsplit("/", 1)[-1]
    rel = rel.split("?", 1)[0]
    return re.sub(r"[0-9a-f]{8,}|\d{6,}", "*", rel) or "."


def run_point(scenario: Scenario, run: RunDir, arm: Callable[[], object], disarm: Callable[[], list[str]],
              expect_reason: str | None) -> tuple[str, list[str], list[str]]:
    """One point: prepare, arm, operate, after (still armed), disarm, between, resume, check.
    Returns (outcome, problems, the faulted calls as `disarm` describes them)."""
    problems: list[str] = []
    scenario.prepare(run)
    arm()
    try:
        try:
            result = scenario.operate(run)
            outcome = "logged" if result is False else "ok"
        except KeyboardInterrupt:
            outcome = "interrupt"
        except (StorageError, RunLocked) as exc:
            outcome = "error?" if getattr(exc, "maybe_committed", False) else "error"
            if isinstance(exc, PartExists) or type(exc) is RunLocked:
                problems.append(f"{type(exc).__name__} from a store fault: {exc}")
            message = str(exc)
            if str(run.path) not in message:
                problems.append(f"the error does not name the file: {message}")
            if expect_reason and expect_reason not in message:
                problems.append(f"the error does not give the reason ({expect_reason}): {message}")
        except Exception as exc:  # noqa: BLE001 - an untyped error is exactly what the enumeration looks for
            outcome = "untyped"
            problems.append(f"untyped {type(exc).__name__}: {exc}")
        try:
            scenario.after(run)
        except (StorageError, KeyboardInterrupt):
            pass  # a persistent fault is still there; the process would now exit
        except Exception as exc:  # noqa: BLE001
            problems.append(f"after the fault, untyped {type(exc).__name__}: {exc}")
    finally:
        hit = disarm()
    return outcome, problems + verify(scenario, run), hit


def verify(scenario: Scenario, run: RunDir) -> list[str]:
    """Between, resume, check: the first step that fails, as a problem."""
    for step in (scenario.between, scenario.resume, scenario.check):
        try:
            step(run)
        except Exception as exc:  # noqa: BLE001 - any failure here is a broken invariant to report
            return [f"{step.__name__}: {type(exc).__name__}: {exc}"]
    return []


def enumerate_points(scenario_cls: type[Scenario], backend: str, fault: str, mode: str,
                     make_run: Callable[[int], RunDir], arm: Callable[[int], object],
                     disarm: Callable[[], list[str]], expect_reason: str | None = None,
                     deadline_s: float = 120) -> list[Point]:
    """Points N = 1, 2, ... until an operation runs with no fault (that last, unfaulted run is checked too).
    `disarm` returns the faulted calls, described."""
    points: list[Point] = []
    deadline = time.monotonic() + deadline_s
    for n in range(1, MAX_POINTS + 1):
        run = make_run(n)
        outcome, problems, hit = run_point(scenario_cls(), run, lambda: arm(n), disarm, expect_reason)
        if not hit:
            if problems:
                points.append(Point(scenario_cls.name, backend, fault, mode, n, "(no fault)", outcome, problems))
            return points
        points.append(Point(scenario_cls.name, backend, fault, mode, n, hit[0], outcome, problems))
        assert time.monotonic() < deadline, f"{scenario_cls.name} {fault}: enumeration past {deadline_s} s"
    raise AssertionError(f"{scenario_cls.name} {fault}: more than {MAX_POINTS} I/O calls")


def problems_report(points: list[Point]) -> str:
    bad = [p for p in points if p.problems]
    lines = [f"{p.backend} {p.scenario} {p.fault}/{p.mode} at call {p.n} ({p.call}) -> {p.outcome}: "
             + "; ".join(p.problems) for p in bad[:40]]
    return f"{len(bad)} of {len(points)} points broke an invariant:\n" + "\n".join(lines)
