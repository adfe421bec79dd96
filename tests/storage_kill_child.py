"""The SIGKILL enumeration's child (Ray-free): `python -m tests.storage_kill_child BASE SCENARIO...`.

For each scenario of tests/storage_scenarios.py and N = 1, 2, ...: fork; the forked process prepares a run
directory under BASE (a local folder or an s3:// URI), arms the storage seam to SIGKILL itself at its N-th
I/O call and runs the operation through the real Committer / HiddenPartWriter / RunDir / RunLock code. One
JSON line per point: {"scenario", "n", "run", "signal"}; the first N the operation survives (it made fewer
calls) ends the scenario, and its line lists the calls. The test then resumes and checks each run in its
own process. Forking from a process that has imported but not used pyarrow (no S3 client, no thread pool
yet) costs milliseconds where a fresh interpreter costs half a second.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

from pipeline.store import storage
from pipeline.store.faults import Faults
from pipeline.store.rundir import RunDir
from tests.storage_scenarios import SCENARIOS

MAX_POINTS = 400


def run_uri(base: str, *names: str) -> str:
    head, _, query = base.partition("?")
    return "/".join([head.rstrip("/"), *names]) + (f"?{query}" if query else "")


def child(name: str, uri: str, n: int, report_fd: int) -> None:
    try:
        run = RunDir(uri)
        scenario = SCENARIOS[name]()
        scenario.prepare(run)
        plan = Faults(n, "kill")
        storage.arm(plan)
        scenario.operate(run)
        storage.arm(None)
        os.write(report_fd, json.dumps(plan.calls).encode())
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def main(base: str, names: list[str]) -> int:
    for name in names:
        for n in range(1, MAX_POINTS + 1):
            uri = run_uri(base, name.replace("/", "_").replace(" ", "_").replace(".", "_"), str(n))
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                child(name, uri, n, write_end)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as report:
                calls = report.read()
            _, status = os.waitpid(pid, 0)
            signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            if signal is None and os.WEXITSTATUS(status) != 0:
                print(f"{name} at call {n}: the child failed (exit {os.WEXITSTATUS(status)})", file=sys.stderr)
                return 1
            line = {"scenario": name, "n": n, "run": uri, "signal": signal}
            if signal is None:
                line["calls"] = json.loads(calls)
            print(json.dumps(line), flush=True)
            if signal is None:
                break
        else:
            print(f"{name}: more than {MAX_POINTS} I/O calls", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
