"""The embedded Ray cluster does not outlive its driver.

Ray's node processes share the driver's fate, but its DashboardAgent and RuntimeEnvAgent (children of the raylet,
started even with `include_dashboard=False`) do not: when the raylet dies they notice within 2 s, then spend 60 s
trying to tell the dead GCS why (`publish_error_to_driver`'s fixed timeout), reparented to PID 1. So may a worker
the raylet started just before it died (still connecting), or a process a task started. After a SIGKILL of the
driver nothing in the driver can end them, so `watch` starts a small process that can: it holds the read end of a
pipe whose write end only the driver holds. When the pipe closes (the driver ended, however), it waits `GRACE_S` for
the processes of the cluster to exit on their own, then kills those still running, and looks once more for any the
dying raylet started meanwhile.

The processes of the cluster are those the driver had below it when `watch` was called (each checked by its start
time: a reused pid is left alone) and those started since that hold a file in the cluster's session directory (every
Ray process has its logs there, and a worker's children inherit them), run the driver's Python and are in the
driver's session (a `tail -f` of those logs is none of them). Processes are waited on and killed through pidfds (a
pidfd names one process, never a later one with its pid); a zombie is gone. Linux (/proc) only.

    python -m pipeline.dispatch.reaper FD SID SESSION_DIR|- PID:START [PID:START ...]
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 2.0
_held: list[int] = []  # the driver's write ends: open for its whole life, closed by its end


def _stat(pid: int) -> tuple[int, int, str, int] | None:
    """(parent pid, start time in clock ticks, state, session id), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[19]), fields[0], int(fields[3])


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `root`."""
    parents: dict[int, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None:
            parents.setdefault(stat[0], []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            stat = _stat(child)
            if stat is not None:
                out.append((child, stat[1]))
                todo.append(child)
    return out


def watch(session_dir: str | None = None) -> None:
    """Called by the driver once its embedded cluster runs (`session_dir`: the cluster's, where every one of its
    processes keeps its logs): the cluster's processes are ended with the driver."""
    if not Path("/proc/self/stat").exists():
        return
    processes = descendants(os.getpid())
    if not processes:
        return
    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-m", "pipeline.dispatch.reaper", str(read), str(os.getsid(0)),
                      session_dir or "-", *(f"{pid}:{start}" for pid, start in processes)],
                     pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)  # a signal to the driver's process group does not end it first
    os.close(read)
    _held.append(write)


def _alive(pid: int, start: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[2] not in "ZX"


def _in_session(pid: int, session_dir: str) -> bool:
    """Whether the process holds a file (or its cwd) in the cluster's session directory."""
    inside = session_dir.rstrip("/") + "/"
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in [*names, "cwd"]:
        try:
            target = os.readlink(f"/proc/{pid}/{name if name == 'cwd' else 'fd/' + name}")
        except OSError:
            continue
        if target.startswith(inside):
            return True
    return False


def session_processes(session_dir: str | None, sid: int, since: int) -> list[tuple[int, int]]:
    """The cluster's processes started since `since` (clock ticks) that hold a file in its session directory, run
    this Python and are in session `sid`."""
    if session_dir is None:
        return []
    python, me, out = os.readlink("/proc/self/exe"), os.getpid(), []
    for pid in _pids():
        stat = _stat(pid)
        if pid == me or stat is None or stat[1] < since or stat[3] != sid or stat[2] in "ZX":
            continue
        try:
            if os.readlink(f"/proc/{pid}/exe") != python:
                continue
        except OSError:
            continue
        if _in_session(pid, session_dir):
            out.append((pid, stat[1]))
    return out


def _open(processes: list[tuple[int, int]], opened: dict[int, int | None]) -> None:
    """A pidfd for each process still alive (None where pidfds are not available), into `opened` by pid."""
    for pid, start in processes:
        if pid in opened:
            continue
        try:
            fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        except ProcessLookupError:
            continue
        except OSError:
            fd = None
        if _alive(pid, start):  # after the open: the pidfd names this process (a reused pid has another start)
            opened[pid] = fd
        elif fd is not None:
            os.close(fd)


def _wait(opened: dict[int, int | None], starts: dict[int, int], seconds: float) -> None:
    """Until every process in `opened` has exited (removed from it) or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while opened:
        for pid in [pid for pid, fd in opened.items() if fd is None and not _alive(pid, starts[pid])]:
            del opened[pid]
        left = deadline - time.monotonic()
        if not opened or left <= 0:
            return
        poller = select.poll()
        for fd in opened.values():
            if fd is not None:
                poller.register(fd, select.POLLIN)
        no_pidfd = any(fd is None for fd in opened.values())
        for fd, _ in poller.poll(min(left, 0.1) * 1000 if no_pidfd else left * 1000):  # readable: it exited
            pid = next(pid for pid, pidfd in opened.items() if pidfd == fd)
            os.close(opened.pop(pid))


def _kill(opened: dict[int, int | None], starts: dict[int, int]) -> None:
    for pid, fd in list(opened.items()):
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            elif _alive(pid, starts[pid]):
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    fd, sid = int(argv[0]), int(argv[1])
    session_dir = None if argv[2] == "-" else os.path.realpath(argv[2])  # as /proc names the files held in it
    given = [(int(pid), int(start)) for pid, start in (arg.split(":") for arg in argv[3:])]
    since = min((start for _, start in given), default=0)
    while os.read(fd, 1):  # blocks until the driver's end closes the pipe
        pass
    opened: dict[int, int | None] = {}
    starts: dict[int, int] = {}
    for _ in range(2):  # then once more: a process the dying raylet started while the first ones were waited on
        found = [*given, *session_processes(session_dir, sid, since)]
        starts.update(found)
        _open(found, opened)
        _wait(opened, starts, GRACE_S)
        _kill(opened, starts)
        _wait(opened, starts, GRACE_S)  # a killed process is gone at once; closes the pidfds
        given = []
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the driver's terminal is the driver's to obey
    sys.exit(main(sys.argv[1:]))
