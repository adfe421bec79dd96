"""The driver process's own shell: its log (the run's logs/regen.log and the console) and its signals, shared by
`regen generate` (run.py) and `regen capture` (capture.py)."""
from __future__ import annotations

import logging
import signal
import sys

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
    to end; the buffer is committed, then the run stops. A second signal stops at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.graceful = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None or not self.graceful:
            self.signal = signum
            log.warning("%s received: stopping", name)
            raise KeyboardInterrupt
        self.signal = signum
        log.warning("%s received: committing what is buffered, then stopping", name)

    def __call__(self) -> bool:
        return self.signal is not None


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
