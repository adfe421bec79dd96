"""The Committer: buffers finished records and failures and commits them as parts (invariant 4: a part is
committed whole or not at all; a unit of work, a sample of a prompt (core/work.py record_unit), is committed
once). A commit whose outcome is unknown is settled by looking (`committed_part`); SIGINT and SIGTERM wait until a
commit is settled (`signals_deferred`)."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable

import pyarrow as pa

from . import schema
from ..core.errors import PartExists, StorageError
from ..core.work import record_unit
from .lock import RunLock
from .ledger_index import PartUnits, SegmentWriter
from .rundir import RunDir, committed_part

log = logging.getLogger("regen.commit")


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until a commit and its settling are over, then reach the handlers they would
    have reached (a second Ctrl-C then stops at once), so an interrupt never leaves a commit half known. Python
    runs signal handlers in the main thread only, so that is where they can be held; elsewhere a commit whose
    outcome is unknown is still resolved by looking."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, handler)
        for signum in held:
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


class Committer:
    """The single committer: buffers results, drops any unit (a prompt, or one sample of it) already committed or
    buffered, and commits a part when the buffer is full or old enough. A SIGKILL loses only the buffer."""

    def __init__(self, run_dir: RunDir, done: set[str], flush_records: int, flush_interval_s: float,
                 records_schema: pa.Schema = schema.RECORDS, lock: RunLock | None = None,
                 unindexed: dict[str, list[PartUnits]] | None = None):
        """`lock`: the run's lock; a driver that has lost it (a lease taken over or expired) commits nothing.
        `unindexed`: by folder name, the parts the resume read one by one (ledger_index.py): the first segments'.
        The committer takes them: the dict is emptied."""
        self.run_dir, self.lock = run_dir, lock
        self.records_schema = records_schema  # the run's own (schema.records_schema of its run.json)
        self.done = done  # unit ids committed (data + terminal failures): this session's, or from the ledger too
        self.flush_records, self.flush_interval_s = flush_records, flush_interval_s
        self.records: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.buffered: set[str] = set()
        self.dropped_duplicates = 0
        self.committed = 0
        self.committed_failures = 0
        self._oldest = time.monotonic()
        self.commit_seconds = 0.0  # time spent writing parts (the commit overhead)
        # kind -> (part, its unit ids, its rows) of a commit whose outcome is not known yet
        self._unsettled: dict[str, tuple[Location, frozenset[str], int]] = {}
        # told the rows of each records part once it is known committed (the goodput count, store/goodput.py)
        self.on_committed: Callable[[list[dict[str, Any]]], None] | None = None
        self.on_failures_committed: Callable[[list[dict[str, Any]]], None] | None = None  # and of a failures part
        # a records part's footer metadata, from its rows, committed with them (goodput.part_footer)
        self.footer: Callable[[list[dict[str, Any]]], dict[bytes, bytes]] | None = None
        carried = dict(unindexed or {})
        if unindexed is not None:
            unindexed.clear()  # taken: what handed them over (the pending scan) may live as long as the session
        self.index = {kind: SegmentWriter(folder, carried.get(folder.name))
                      for kind, folder in (("records", run_dir.data), ("failures", run_dir.failures))}

    def _accept(self, unit: str) -> bool:
        """`unit`: the unit's id, so that sample 1 of a prompt is not a duplicate of its sample 0."""
        if unit in self.done or unit in self.buffered:
            self.dropped_duplicates += 1
            return False
        if not self.buffered:
            self._oldest = time.monotonic()
        self.buffered.add(unit)
        return True

    def add_records(self, rows: list[dict[str, Any]]) -> bool:
        """All rows of one unit (one per regenerated turn) are committed together, in one part."""
        if self._accept(record_unit(rows[0])):
            self.records.extend(rows)
            return True
        return False

    def add_failure(self, row: dict[str, Any]) -> bool:
        if self._accept(record_unit(row)):
            self.failures.append(row)
            return True
        return False

    def due(self) -> bool:
        pending = len(self.buffered)
        return pending >= self.flush_records or (
            pending > 0 and time.monotonic() - self._oldest >= self.flush_interval_s
        )

    def maybe_flush(self) -> None:
        if self.due():
            self.flush()

    def flush(self) -> None:
        """Commit the buffer: records, then failures, each as one part."""
        started = time.monotonic()
        try:
            self._commit("records")
            self._commit("failures")
        finally:
            self.commit_seconds += time.monotonic() - started

    def _commit(self, kind: str) -> None:
        """Rows leave the buffer only once their part is known to be committed. A commit whose outcome is
        unknown (an error after the rename, or a second signal in the middle) is remembered and resolved
        by looking at the store before anything else is written, so a buffer is never committed twice."""
        folder, part_schema = ((self.run_dir.data, self.records_schema) if kind == "records"
                               else (self.run_dir.failures, schema.FAILURES))
        unsettled = self._unsettled.get(kind)
        if unsettled is not None:
            path, ids, n_rows = unsettled
            if committed_part(path, n_rows):  # raises StorageError if it cannot look: still unknown
                self._settle(kind, ids, n_rows)
            self._unsettled.pop(kind, None)
        rows = getattr(self, kind)
        if not rows:
            return
        if self.lock is not None:
            self.lock.check()  # LeaseLost: another driver may own these prompts now
        path = self.run_dir.next_part(folder)
        ids = frozenset(record_unit(row) for row in rows)
        self._unsettled[kind] = (path, ids, len(rows))
        try:
            table = pa.Table.from_pylist(rows, schema=part_schema)
            if kind == "records" and self.footer is not None:
                table = table.replace_schema_metadata({**(part_schema.metadata or {}), **self.footer(rows)})
            with signals_deferred():
                self.run_dir.write_part(folder, table, path)
                self._settle(kind, ids, len(rows))
                self._unsettled.pop(kind, None)
            log.info("committed %d %s in %s", len(rows), kind, getattr(path, "name", path), extra={"file_only": True})
        except PartExists:
            self._unsettled.pop(kind, None)  # that name was never ours: nothing of this buffer was committed
            raise
        except StorageError as exc:
            # before the publish, certainly nothing was committed; after it, look (if looking fails too,
            # the commit stays unsettled and the next flush looks again)
            if exc.maybe_committed and committed_part(path, len(rows)):
                self._settle(kind, ids, len(rows))
            self._unsettled.pop(kind, None)
            raise
        self.index[kind].committed(path, table)

    def _settle(self, kind: str, ids: frozenset[str], n_rows: int) -> None:
        """Idempotent, so that a settle interrupted by a signal can simply be done again."""
        if not ids <= self.done:
            if kind == "records":
                self.committed += n_rows
                if self.on_committed is not None:
                    self.on_committed([row for row in self.records if record_unit(row) in ids])
            else:
                self.committed_failures += n_rows
                if self.on_failures_committed is not None:
                    self.on_failures_committed([row for row in self.failures if record_unit(row) in ids])
        self.done |= ids
        self.buffered -= ids
        setattr(self, kind, [row for row in getattr(self, kind) if record_unit(row) not in ids])
