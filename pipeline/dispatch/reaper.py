"""The embedded Ray cluster does not outlive its driver.

Ray's node processes share the driver's fate, but its DashboardAgent and RuntimeEnvAgent (children of the raylet,
started even with `include_dashboard=False`) do not: when the raylet dies they notice within 2 s, then spend 60 s
trying to tell the dead GCS why (`publish_error_to_driver`'s fixed timeout), reparented to PID 1. After a SIGKILL of
the driver nothing in the driver can end them, so `watch` starts a small process that can: it holds the read end of
a pipe whose write end only the driver holds. When the pipe closes (the driver ended, however), it waits
`GRACE_S` for the processes of the cluster to exit on their own, then kills those still running. It kills only
the processes it was given, each checked by its start time (a reused pid is left alone). Linux (/proc) only.

    python -m pipeline.dispatch.reaper FD PID:START [PID:START ...]
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 2.0
_held: list[int] = []  # the driver's write ends: open for its whole life, closed by its end


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `root`."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                parents.setdefault(stat[0], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            stat = _stat(child)
            if stat is not None:
                out.append((child, stat[1]))
                todo.append(child)
    return out


def watch() -> None:
    """Called by the driver once its embedded cluster runs: the cluster's processes are ended with the driver."""
    if not Path("/proc/self/stat").exists():
        return
    processes = descendants(os.getpid())
    if not processes:
        return
    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-m", "pipeline.dispatch.reaper", str(read),
                      *(f"{pid}:{start}" for pid, start in processes)],
                     pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)  # a signal to the driver's process group does not end it first
    os.close(read)
    _held.append(write)


def _alive(pid: int, start: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == start


def main(argv: list[str]) -> int:
    fd, processes = int(argv[0]), [tuple(int(x) for x in arg.split(":")) for arg in argv[1:]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.read(fd, 1):  # blocks until the driver's end closes the pipe
        pass
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(pid, start) for pid, start in processes):
        time.sleep(0.1)
    for pid, start in processes:
        if _alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
