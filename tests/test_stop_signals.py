"""An operator's stop always stops: a SIGINT/SIGTERM before dispatch ends `regen generate` with KeyboardInterrupt
(exit 130) wherever it lands (issue 30). Each test places the signal at one point, in process: at every line of
threading's Event.wait and Condition.wait while the driver waits for the fleet's probes or the ledger read, and inside
the write of a log line to the console, as ray.init hands the signals back; and a stop during a name lookup that
never answers."""
from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from pipeline.core.background import Background
from pipeline.dispatch.fleet import EarlyProbe
from pipeline.dispatch.stopping import StopFlag

WAIT_CODE = {threading.Event.wait.__code__, threading.Condition.wait.__code__}
DRIVER_WAITS = {EarlyProbe.__call__.__code__, Background.result.__code__}


@pytest.fixture
def handlers():
    """The test process's own SIGINT/SIGTERM handlers, put back after the test installed a run's."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    sys.settrace(None)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def signal_at_line(n: int) -> dict:
    """SIGTERM at the n-th line run by the first Event.wait (with the Condition.wait in it) that the driver's wait
    for another thread calls (EarlyProbe.__call__, Background.result); then tracing stops. Past its last line, SIGTERM
    as it returns, and `past` is set."""
    state = {"waiting": False, "first": None, "lines": 0, "placed": False, "past": False}

    def lines(frame, event, _arg):
        if state["placed"]:
            return None
        if event == "line":
            state["lines"] += 1
            if state["lines"] == n:
                state["placed"] = True
                sys.settrace(None)
                frame.f_trace = None
                signal.raise_signal(signal.SIGTERM)
        elif event == "return" and frame is state["first"]:  # the first wait is over, with n past its lines:
            state["placed"] = state["past"] = True  # the walk is done; a last signal ends this wait
            sys.settrace(None)
            signal.raise_signal(signal.SIGTERM)
        return lines

    def calls(frame, _event, _arg):
        if state["placed"]:
            return None
        if frame.f_code in DRIVER_WAITS:
            state["waiting"] = True
        elif frame.f_code in WAIT_CODE and state["waiting"]:
            state["first"] = state["first"] or frame
            return lines
        return None

    sys.settrace(calls)
    return state


def probes_wait(stop: StopFlag) -> None:
    """The driver's wait for the fleet's probes (fleet_preflight calling the EarlyProbe), the probes never done."""
    probe = EarlyProbe.__new__(EarlyProbe)
    probe.wait, probe.done, probe.error, probe.reports = stop.wait, threading.Event(), None, []
    probe()


def ledger_wait(stop: StopFlag) -> None:
    """The driver's wait for the ledger read and pending scan (run.py's Background), the read never done."""
    release = threading.Event()
    try:
        Background(release.wait, "regen-ledger").result(stop.wait)
    finally:
        release.set()


@pytest.mark.parametrize("wait", [probes_wait, ledger_wait])
def test_a_signal_anywhere_in_the_drivers_wait_for_another_thread_is_a_stop(handlers, wait):
    """A KeyboardInterrupt raised by the handler after Condition.wait released its lock and before the `with` of
    Event.wait released it again became RuntimeError('release unlocked lock'): exit 1 and a traceback, not 130."""
    n = 1
    while True:
        stop = StopFlag()
        stop.install()
        placed = signal_at_line(n)
        try:
            with pytest.raises(KeyboardInterrupt):
                wait(stop)
        finally:
            sys.settrace(None)
        assert stop.signal == signal.SIGTERM
        if placed["past"]:
            break  # every line of the first wait has had its signal
        n += 1
    assert n > 10  # the waits' lines were walked


class Console(io.StringIO):
    """sys.stderr as the driver's console: a write into it while one is in progress raises RuntimeError, as
    io.BufferedWriter does when a signal handler writes from inside the write(2) that the signal interrupted (a
    console that is a pipe or a terminal: the write can block and be interrupted). The first write carries SIGTERM."""

    def __init__(self) -> None:
        super().__init__()
        self.busy, self.armed = False, True

    def write(self, text: str) -> int:
        if self.busy:
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")
        self.busy = True
        try:
            if self.armed:
                self.armed = False
                signal.raise_signal(signal.SIGTERM)  # its handler runs here, inside this write
            return super().write(text)
        finally:
            self.busy = False


def test_a_signal_while_the_driver_writes_a_log_line_is_a_stop(handlers, monkeypatch):
    """The handler's own log line failed inside the interrupted write; that RuntimeError, raised instead of the
    KeyboardInterrupt, was swallowed by logging's handling of the interrupted line: the signal was lost."""
    console = Console()
    monkeypatch.setattr(sys, "stderr", console)
    regen = logging.getLogger("regen")
    saved = (list(regen.handlers), regen.propagate, regen.level)
    handler = logging.StreamHandler(console)
    regen.handlers[:], regen.propagate = [handler], False
    regen.setLevel(logging.INFO)
    stop = StopFlag()
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            regen.info("source test: read 6, valid 6")  # any line of the driver's, before dispatch
    finally:
        regen.handlers[:], regen.propagate = saved[0], saved[1]
        regen.setLevel(saved[2])
    assert stop.signal == signal.SIGTERM


def test_a_sigterm_as_ray_hands_the_signals_back_is_a_stop(handlers, monkeypatch):
    """ray.init replaces the SIGTERM handler with its own (sys.exit); join_ray turns that SystemExit into the
    run's stop and puts the run's handlers back. A SIGTERM after ray.init returned and before they were back
    escaped as SystemExit(15): exit status 15 and a run log ending "fatal: SystemExit", not 130."""
    from pipeline.dispatch import cluster

    class Stop(StopFlag):
        def install(self) -> None:
            signal.raise_signal(signal.SIGTERM)  # lands just before the run's handlers are back
            super().install()

    def ray_init(_address):  # what ray.init leaves behind: its own SIGTERM handler
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))

    monkeypatch.setattr(cluster, "init_ray", ray_init)
    with pytest.raises(KeyboardInterrupt):
        cluster.join_ray(None, Stop())


RESOLVER_THAT_NEVER_ANSWERS = '''
import os, socket, time
_getaddrinfo = socket.getaddrinfo
def getaddrinfo(host, *args, **kwargs):
    if host == "never-answers.test":
        open(os.environ["LOOKUP_BEGAN"], "w").close()
        time.sleep(600)
    return _getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = getaddrinfo
'''


def test_a_stop_during_a_lookup_that_never_answers_exits(tmp_path):
    """The probes' name lookups ran in the event loop's default executor, whose threads the interpreter joins at
    exit: after a SIGTERM during the preflight the driver said "interrupted" and stayed until the lookup returned
    (here never; with a resolver that does not answer, its timeouts). The resolver is made to hang through a
    sitecustomize on the driver's PYTHONPATH."""
    from tests.helpers import regen_cmd, wait_for, write_config, write_prompts, write_source

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RESOLVER_THAT_NEVER_ANSWERS)
    write_prompts(tmp_path / "p.jsonl", 3)
    config = write_config(tmp_path, [{"url": "http://never-answers.test:8000", "name": "slow"}],
                          [write_source(tmp_path, tmp_path / "p.jsonl")], model="moonshotai/Kimi-K2.5",
                          dead_fleet_deadline_s=300)
    began, log = tmp_path / "began", tmp_path / "log"
    env = {**os.environ, "LOOKUP_BEGAN": str(began),
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(regen_cmd("generate", "--config", str(config)), stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        wait_for(began.exists, 120, what="the probe's lookup")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: b"received: stopping" in log.read_bytes(), 120, what="the signal's line")
        assert proc.wait(timeout=120) == 130  # the lookup sleeps 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_daemon_lookups_answer_as_aiohttps_own():
    import asyncio
    import socket

    from pipeline.endpoints.lookups import resolver

    async def lookups():
        found = await resolver().resolve("localhost", 8000)
        with pytest.raises(socket.gaierror):
            await resolver().resolve("no-such-host.invalid", 8000)
        return found

    assert {(r["host"], r["port"]) for r in asyncio.run(lookups())} & {("127.0.0.1", 8000), ("::1", 8000)}
