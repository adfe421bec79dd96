"""The run directory: atomic part files, the ledger (done set), the run lock and run.json.

Layout of `outputs/<run>/`:
    run.json            identity: config fingerprint, generation config, prompt-set config, versions
    prompts/            the materialised prompt set, one file per refresh (prompts-000001.parquet, ...)
    rejects/            invalid inputs with their reason, one file per materialisation
    data/part-*.parquet committed records
    failures/part-*.parquet  terminal failures with the server's message
    capture/            `regen capture`'s hidden states, a run directory of its own (store/capture_ledger.py)
    status.json         progress, rewritten atomically
    logs/
The run directory is a local or shared POSIX path or an object-store URI (see storage.py for what an
atomic commit is on each); readers never see a torn part.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from os import PathLike
from pathlib import Path
from typing import Any, Callable

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from . import schema
from ..core.errors import PartExists, StorageError
from .lock import RunLock  # the run's lock lives with its directory
from .storage import TMP_PREFIX, Location, read_columns

log = logging.getLogger("regen")

PART_RE = re.compile(r"^part-(\d{6})-[0-9a-f]{8}\.parquet$")
VERSION_RE = re.compile(r"^prompts-(\d{6})\.parquet$")


def atomic_write(where: str | PathLike[str] | Location, data: bytes) -> None:
    """Write `data` so that the file either does not exist or is complete (storage.Location.write_atomic)."""
    Location.at(where).write_atomic(data)


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class RunDir:
    path: Location

    def __init__(self, path: str | PathLike[str] | Location):
        object.__setattr__(self, "path", Location.at(path))

    @property
    def data(self) -> Location:
        return self.path / "data"

    @property
    def failures(self) -> Location:
        return self.path / "failures"

    @property
    def rejects(self) -> Location:
        return self.path / "rejects"

    @property
    def prompts(self) -> Location:
        return self.path / "prompts"

    @property
    def logs(self) -> Location:
        return self.path / "logs"

    def local_logs(self) -> Path:
        """Where logs are appended: `logs/` on POSIX. An object store cannot append, so a remote run logs to
        a local folder (REGEN_LOG_DIR, default ~/.cache/regen/logs/<run>) and publish_logs uploads it."""
        if self.path.local:
            folder = Path(self.logs)
        else:
            base = os.environ.get("REGEN_LOG_DIR") or Path.home() / ".cache" / "regen" / "logs"
            folder = Path(base) / re.sub(r"[^A-Za-z0-9._-]+", "_", str(self.path))
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def publish_logs(self) -> None:
        """Upload the local logs of a remote run into its `logs/` (whole objects); nothing to do on POSIX."""
        if not self.path.local:
            for log_file in sorted(self.local_logs().glob("*.log")):
                (self.logs / log_file.name).write_atomic(log_file.read_bytes())

    @property
    def manifest_path(self) -> Location:
        return self.path / "run.json"

    @property
    def status_path(self) -> Location:
        return self.path / "status.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def create(self) -> None:
        for sub in (self.data, self.failures, self.rejects, self.prompts, self.logs):
            sub.mkdir()

    # --- run.json and status.json ---------------------------------------------------------------
    def read_manifest(self) -> dict[str, Any]:
        return orjson.loads(self.manifest_path.read_bytes())

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.manifest_path.write_atomic(orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))

    def write_status(self, status: dict[str, Any]) -> bool:
        """status.json is a view of the ledger, not the data: a failed write is logged and the run goes on
        (the next write, or `regen status`, which counts from the ledger, tells the truth). False if it failed."""
        try:
            self.status_path.write_atomic(orjson.dumps(status, option=orjson.OPT_INDENT_2))
            return True
        except StorageError as exc:
            log.warning("status.json not updated (%s); the run goes on", exc)
            return False

    def read_status(self) -> dict[str, Any] | None:
        try:
            return orjson.loads(self.status_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    # --- parts and the ledger --------------------------------------------------------------------
    def cleanup_temp(self) -> list[Location]:
        """Remove temporary files a killed writer left behind; they were never committed."""
        removed = []
        for folder in (self.path, self.data, self.failures, self.rejects, self.prompts, self.logs):
            for tmp in folder.iterdir():
                if tmp.name.startswith(TMP_PREFIX):
                    tmp.unlink()
                    removed.append(tmp)
        return removed

    @staticmethod
    def parts(folder: Location) -> list[Location]:
        return sorted(p for p in folder.iterdir() if PART_RE.match(p.name))

    def next_part(self, folder: Location) -> Location:
        """The name the next part of `folder` gets (one committer per folder)."""
        existing = self.parts(folder)
        seq = int(PART_RE.match(existing[-1].name).group(1)) + 1 if existing else 1
        return folder / f"part-{seq:06d}-{uuid.uuid4().hex[:8]}.parquet"

    def write_part(self, folder: Location, table: pa.Table, path: Location | None = None) -> Location:
        """Commit `table` as a new part (never replacing one: PartExists)."""
        path = path or self.next_part(folder)
        path.write_parquet_atomic(table, exclusive=True, compression="zstd")
        return path

    def ids_in(self, folder: Location) -> set[str]:
        """The ledger: prompt_ids of committed parts, reading the id column only."""
        parts = self.parts(folder)
        if not parts:
            return set()
        return set(read_columns(parts, ["prompt_id"]).column(0).to_pylist())

    def committed_ids(self) -> set[str]:
        return self.ids_in(self.data)

    def failed_ids(self) -> set[str]:
        return self.ids_in(self.failures)

    def read_table(self, folder: Location, columns: list[str] | None = None) -> pa.Table | None:
        parts = self.parts(folder)
        if not parts:
            return None
        return pa.concat_tables(p.read_parquet(columns=columns) for p in parts)

    # --- the materialised prompt set --------------------------------------------------------------
    def prompt_set_versions(self) -> list[Location]:
        return _versions(self.prompts, "prompts-")

    def write_prompt_set(self, prompts: pa.Table, rejects: pa.Table) -> Location:
        """A new version, numbered past the newest (with one deleted by hand, len + 1 named the newest). A
        rejects file whose prompt set was never written (a start that was killed) is that version's: replaced."""
        taken = [int(m.group(1)) for p in self.prompt_set_versions() if (m := VERSION_RE.match(p.name))]
        version = max(taken, default=0) + 1
        (self.rejects / f"rejects-{version:06d}.parquet").write_atomic(table_bytes(rejects))
        path = self.prompts / f"prompts-{version:06d}.parquet"
        path.write_atomic(table_bytes(prompts))  # last: its presence means the set is complete
        return path

    def load_prompt_set(self) -> pa.Table | None:
        versions = self.prompt_set_versions()
        return versions[-1].read_parquet() if versions else None

    def rejects_table(self) -> pa.Table | None:
        versions = _versions(self.rejects, "rejects-")
        return versions[-1].read_parquet() if versions else None


def committed_part(where: Location, expected_rows: int) -> bool:
    """Resolve a commit whose outcome is unknown by looking: True if the part is there under its final name
    and reads back whole (its footer names `expected_rows` rows), False if it is not there. A part that is
    there but is not that whole Parquet file is removed, so it can never be mistaken for committed. Raises
    StorageError (maybe_committed) if the store cannot be read: the outcome stays unknown, nothing is removed."""
    try:
        if not where.exists():
            return False
        try:
            if where.parquet_file().metadata.num_rows == expected_rows:
                return True
        except FileNotFoundError:
            return False
        except pa.ArrowInvalid:  # bytes that are not a whole Parquet file (a read error is a StorageError)
            pass
        where.unlink()
        return False
    except StorageError as exc:
        exc.maybe_committed = True
        raise


def _versions(folder: Location, prefix: str) -> list[Location]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(prefix) and p.name.endswith(".parquet"))


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


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def _numbered_runs(output_dir: str | PathLike[str], run_name: str) -> dict[int, Location]:
    """`<run>` (number 1) and its successors `<run>-rN` that exist, with or without a run.json. A `<run>-rN`
    whose run.json names another run is that run (a user's own run called e.g. `exp-r2`), not a successor."""
    root = Location.at(output_dir)
    runs = {}
    for path in root.iterdir():
        suffix = path.name[len(run_name) + 2:]
        if path.name == run_name:
            runs[1] = path
        elif path.name.startswith(f"{run_name}-r") and suffix.isdigit() and int(suffix) >= 2:
            manifest = path / "run.json"
            if manifest.exists() and orjson.loads(manifest.read_bytes()).get("run_name", run_name) != run_name:
                continue
            runs[int(suffix)] = path
    return runs


def resolve_run_dir(output_dir: str | PathLike[str], run_name: str, new_run: bool,
                    resumable: Callable[["RunDir"], bool] = lambda run: True) -> RunDir:
    """`outputs/<run>` or its successors `<run>-r2`, `<run>-r3`, ... started by --new-run.

    Without --new-run the newest run of that name is resumed (the drift guard then checks it).
    With --new-run the newest run is resumed only if `resumable(it)`; otherwise a successor starts.
    """
    runs = _numbered_runs(output_dir, run_name)
    started = [runs[n] for n in sorted(runs) if (runs[n] / "run.json").exists()]
    if not started:
        return RunDir(Location.at(output_dir) / run_name)
    newest = RunDir(started[-1])
    if not new_run or resumable(newest):
        return newest
    return successor_run_dir(output_dir, run_name)


def successor_run_dir(output_dir: str | PathLike[str], run_name: str) -> RunDir:
    """The next successor: one past the highest number that exists, so a deleted one's number is never reused
    while a later one exists (a directory without run.json, left by a start that was killed, counts too)."""
    runs = _numbered_runs(output_dir, run_name)
    return RunDir(Location.at(output_dir) / f"{run_name}-r{max(runs, default=1) + 1}")


class Committer:
    """The single committer: buffers results, drops any prompt already committed or buffered, and
    commits a part when the buffer is full or old enough. A SIGKILL loses only the buffer."""

    def __init__(self, run_dir: RunDir, done: set[str], flush_records: int, flush_interval_s: float,
                 records_schema: pa.Schema = schema.RECORDS, lock: RunLock | None = None):
        """`lock`: the run's lock; a driver that has lost it (a lease taken over or expired) commits nothing."""
        self.run_dir, self.lock = run_dir, lock
        self.records_schema = records_schema  # the run's own (schema.records_schema of its run.json)
        self.done = done  # committed data + terminal failures (unless retried)
        self.flush_records, self.flush_interval_s = flush_records, flush_interval_s
        self.records: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.buffered: set[str] = set()
        self.dropped_duplicates = 0
        self.committed = 0
        self.committed_failures = 0
        self._oldest = time.monotonic()
        self.commit_seconds = 0.0  # time spent writing parts (the commit overhead)
        # kind -> (part, its prompt ids, its rows) of a commit whose outcome is not known yet
        self._unsettled: dict[str, tuple[Location, frozenset[str], int]] = {}

    def _accept(self, prompt_id: str) -> bool:
        if prompt_id in self.done or prompt_id in self.buffered:
            self.dropped_duplicates += 1
            return False
        if not self.buffered:
            self._oldest = time.monotonic()
        self.buffered.add(prompt_id)
        return True

    def add_records(self, rows: list[dict[str, Any]]) -> bool:
        """All rows of one prompt (one per regenerated turn) are committed together, in one part."""
        if self._accept(rows[0]["prompt_id"]):
            self.records.extend(rows)
            return True
        return False

    def add_failure(self, row: dict[str, Any]) -> bool:
        if self._accept(row["prompt_id"]):
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
        ids = frozenset(row["prompt_id"] for row in rows)
        self._unsettled[kind] = (path, ids, len(rows))
        try:
            with signals_deferred():
                self.run_dir.write_part(folder, pa.Table.from_pylist(rows, schema=part_schema), path)
                self._settle(kind, ids, len(rows))
                self._unsettled.pop(kind, None)
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

    def _settle(self, kind: str, ids: frozenset[str], n_rows: int) -> None:
        """Idempotent, so that a settle interrupted by a signal can simply be done again."""
        if not ids <= self.done:
            if kind == "records":
                self.committed += n_rows
            else:
                self.committed_failures += n_rows
        self.done |= ids
        self.buffered -= ids
        setattr(self, kind, [row for row in getattr(self, kind) if row["prompt_id"] not in ids])
