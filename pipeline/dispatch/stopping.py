"""The driver process's own shell: its log (the run's logs/regen.log and the console) and its signals, shared by
`regen generate` (run.py) and `regen capture` (capture.py)."""
from __future__ import annotations

import logging
import signal
import sys
import threading

from ..core import exits
from ..core.errors import RegenError
from ..store.rundir import RunDir
from ..store.status import counts_line

log = logging.getLogger("regen")


def setup_logging(run_dir: RunDir) -> None:
    root = logging.getLogger("regen")
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir.local_logs() / "regen.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("regen: %(message)s"))
    console.addFilter(lambda record: not getattr(record, "file_only", False))  # e.g. progress beside a tqdm bar
    root.addHandler(file_handler)
    root.addHandler(console)
    root.propagate = False


# --- signals ----------------------------------------------------------------------------------------
class StopFlag:
    """SIGINT/SIGTERM stop the run cleanly at any stage, with exit status 130. Before dispatch there is nothing
    to save, so a signal stops at once (KeyboardInterrupt). During dispatch (`graceful`) it asks the dispatch
    to end; the buffer is committed, then the run stops. A second signal stops at once.

    Where the driver waits for another thread (`wait`: the fleet's probes, the ledger read) a first signal is not
    raised where it lands but between two short waits: a KeyboardInterrupt raised inside threading's Event.wait can
    land after its Condition released the lock and before the `with` that releases it again, which then fails with
    RuntimeError (exit 1 and a traceback, not 130). And the handler's own log line never keeps the stop from
    being raised: a signal that lands while the main thread writes a log line to the same stream makes the
    handler's write fail (`reentrant call`), and logging would swallow that error in the interrupted line's
    handling, KeyboardInterrupt and all."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.graceful = False
        self._waiting = False  # in `wait`: a first signal is raised there, not where it lands
        self._unraised = False  # a signal `wait` has not raised yet

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal is None and not self.graceful and self._waiting:
            self.signal, self._unraised = signum, True  # raised by `wait`, at most 0.1 s from now
            return
        if self.signal is not None or not self.graceful:
            self.signal = signum
            _log_safely("%s received: stopping", name)
            raise KeyboardInterrupt
        self.signal = signum
        _log_safely("%s received: committing what is buffered, then stopping", name)

    def wait(self, done: threading.Event) -> None:
        """Until `done` is set, raising KeyboardInterrupt between two short waits once a signal has come (before
        dispatch; during it the caller looks at the flag itself)."""
        self._waiting = True
        try:
            while not done.wait(0.1) and not self._unraised:
                pass
        finally:
            self._waiting = False
        if self._unraised:
            self._unraised = False
            log.warning("%s received: stopping", signal.Signals(self.signal).name)
            raise KeyboardInterrupt

    def __call__(self) -> bool:
        return self.signal is not None


def _log_safely(message: str, name: str) -> None:
    """The handler's log line, which must never be what a signal raises instead of its stop."""
    try:
        log.warning(message, name)
    except Exception:  # noqa: BLE001 - e.g. RuntimeError: reentrant call inside the console's stream
        pass


def end_the_log_of(run_dir: RunDir | None, exc: BaseException) -> None:
    """A run refused before this session opened it (drift found while choosing the run): its log still ends with
    the refusal, as a user reading it after a two-day run expects."""
    if run_dir is None:
        return
    try:
        setup_logging(run_dir)
        log_the_end(run_dir, exc)
        run_dir.publish_logs()
    except (OSError, RegenError) as error:  # the refusal itself is what the user must see: never hide it
        log.warning("could not write the refusal into %s's log: %s", run_dir.path, error)


def log_the_end(run_dir: RunDir, exc: BaseException) -> None:
    """The last line of a run that an exception ends: interrupted or fatal, with the exit code the CLI returns.
    Into the log file only: the CLI prints the error itself."""
    if isinstance(exc, KeyboardInterrupt):
        log.warning("run ended (exit %d): interrupted; %s", exits.INTERRUPTED.code, counts_line(run_dir),
                    extra={"file_only": True})
        return
    code = exits.for_error(exc) if isinstance(exc, RegenError) else 1
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line: the last
    log.error("run ended (exit %d): fatal: %s: %s; %s", code, type(exc).__name__, message, counts_line(run_dir),
              extra={"file_only": True})
