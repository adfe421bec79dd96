"""Work done in a thread while the driver does something else (a resume reads its ledger while Ray starts)."""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """`work()` in a daemon thread, started at once; `result()` waits for it and returns what it returned, or raises
    what it raised. The wait is in short steps, so a signal reaches the main thread as it would anywhere else."""

    def __init__(self, work: Callable[[], T], name: str):
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), name=name, daemon=True).start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by result()
            self._error = exc
        finally:
            self._done.set()

    def wait(self, wait: Callable[[threading.Event], None] | None = None) -> None:
        """Until the work is done, whatever it gave. `wait`: how to wait for it (a caller's that obeys a signal
        between two short waits); by default short waits too."""
        if wait is not None:
            wait(self._done)
            return
        while not self._done.wait(0.1):
            pass

    def result(self, wait: Callable[[threading.Event], None] | None = None) -> T:
        self.wait(wait)
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
