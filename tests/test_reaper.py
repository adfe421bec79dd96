"""The reaper (pipeline/dispatch/reaper.py) ends the processes of an embedded cluster once its driver is gone: those
the driver had when the reaper started, and those started since that hold a file of the cluster's session directory
(a worker the dying raylet had just started, a task's child); never another process. Here the cluster's processes
are plain sleepers, so the test needs no Ray: it is about which processes the reaper takes, and that it waits on
their exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.dispatch.reaper import _stat, main

SLEEPER = ("import sys, time; f = sys.argv[1] != '-' and open(sys.argv[1], 'a'); print('ready', flush=True); "
           "time.sleep(600)")


def sleeper(holds: Path | None = None) -> subprocess.Popen:
    """A process that holds `holds` open (a log, as Ray's processes hold theirs), once it says so."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, str(holds) if holds else "-"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_the_reaper_ends_the_clusters_processes_started_before_and_after_it_and_no_other(tmp_path):
    session = tmp_path / "session_1" / "logs"
    session.mkdir(parents=True)
    given = sleeper()  # as the driver's children when it called watch(): gcs, raylet, the agents
    read, write = os.pipe()
    reaper = subprocess.Popen([sys.executable, "-m", "pipeline.dispatch.reaper", str(read), str(os.getsid(0)),
                               str(session.parent), f"{given.pid}:{_stat(given.pid)[1]}"], pass_fds=(read,))
    os.close(read)
    late = sleeper(session / "worker-1.out")  # started after the reaper, with a file of the cluster's session
    other = sleeper(tmp_path / "session_10.log")  # started after it too: not of the cluster
    try:
        os.close(write)  # the driver ends
        assert reaper.wait(timeout=120) == 0  # it returns once those it killed have exited
        assert given.wait(timeout=0.1) == -9 and late.wait(timeout=0.1) == -9
        assert other.poll() is None
    finally:
        for proc in (given, late, other, reaper):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_zombie_or_a_reused_pid_is_not_the_process_the_reaper_was_given(tmp_path):
    """A process given to the reaper that has exited (a zombie its parent has not reaped) is gone; a pid given with
    another start time (reused since) is left alone."""
    zombie, reused = sleeper(), sleeper()
    zombie.kill()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
    read, write = os.pipe()
    os.close(write)
    try:
        assert main([str(read), str(os.getsid(0)), "-", f"{zombie.pid}:{_stat(zombie.pid)[1]}",
                     f"{reused.pid}:{_stat(reused.pid)[1] + 1}"]) == 0
        assert reused.poll() is None
    finally:
        os.close(read)
        reused.kill()
        reused.wait()
        zombie.wait()
