"""The driver process's own shell: its log (the run's logs/regen.log and the console) and its signals, shared by
`regen generate` (run.py) and `regen capture` (capture.py)."""
from __future__ import annotations

import logging
import signal
import sys

from ..store.rundir import RunDir

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
