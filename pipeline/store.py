"""The run directory: atomic part files, the ledger (done set), the run lock and run.json.

Layout of `outputs/<run>/`:
    run.json            identity: config fingerprint, generation config, prompt-set config, versions
    prompts/            the materialised prompt set, one file per refresh (prompts-000001.parquet, ...)
    rejects/            invalid inputs with their reason, one file per materialisation
    data/part-*.parquet committed records
    failures/part-*.parquet  terminal failures with the server's message
    hidden/             hidden-state parts (later)
    status.json         progress, rewritten atomically
    logs/
A part is written under a hidden temporary name, fsynced, then renamed: readers never see a torn file.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from . import schema
from .errors import RunLocked, StorageError

TMP_PREFIX = ".tmp-"
PART_RE = re.compile(r"^part-(\d{6})-[0-9a-f]{8}\.parquet$")
# Test-only fault injection: SIGKILL this process between a part's fsync and its rename, on the Nth part.
FAULT_KILL_BEFORE_RENAME = "REGEN_FAULT_KILL_BEFORE_RENAME"
_parts_committed = 0


def _storage_error(exc: OSError, path: Path) -> StorageError:
    reason = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only filesystem"}.get(
        exc.errno, os.strerror(exc.errno) if exc.errno else str(exc)
    )
    return StorageError(f"cannot write {path}: {reason}. Nothing committed was lost; free space and rerun to resume.")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _maybe_inject_kill() -> None:
    global _parts_committed
    _parts_committed += 1
    target = os.environ.get(FAULT_KILL_BEFORE_RENAME)
    if target and int(target) == _parts_committed:
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write(path: Path, data: bytes, *, fault_point: bool = False) -> None:
    """Write `data` to `path` so that `path` either does not exist or is complete."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if fault_point:
            _maybe_inject_kill()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _storage_error(exc, path) from exc


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def data(self) -> Path:
        return self.path / "data"

    @property
    def failures(self) -> Path:
        return self.path / "failures"

    @property
    def rejects(self) -> Path:
        return self.path / "rejects"

    @property
    def prompts(self) -> Path:
        return self.path / "prompts"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def manifest_path(self) -> Path:
        return self.path / "run.json"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def create(self) -> None:
        try:
            for sub in (self.data, self.failures, self.rejects, self.prompts, self.logs, self.path / "hidden"):
                sub.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _storage_error(exc, self.path) from exc

    # --- run.json and status.json ---------------------------------------------------------------
    def read_manifest(self) -> dict[str, Any]:
        return orjson.loads(self.manifest_path.read_bytes())

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write(self.manifest_path, orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))

    def write_status(self, status: dict[str, Any]) -> None:
        atomic_write(self.status_path, orjson.dumps(status, option=orjson.OPT_INDENT_2))

    def read_status(self) -> dict[str, Any] | None:
        try:
            return orjson.loads(self.status_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    # --- parts and the ledger --------------------------------------------------------------------
    def cleanup_temp(self) -> list[Path]:
        """Remove temporary files a killed writer left behind; they were never committed."""
        removed = []
        for folder in (self.path, self.data, self.failures, self.rejects, self.prompts):
            if folder.is_dir():
                for tmp in folder.glob(f"{TMP_PREFIX}*"):
                    tmp.unlink(missing_ok=True)
                    removed.append(tmp)
        return removed

    @staticmethod
    def parts(folder: Path) -> list[Path]:
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.iterdir() if PART_RE.match(p.name))

    def write_part(self, folder: Path, table: pa.Table) -> Path:
        existing = self.parts(folder)
        seq = int(PART_RE.match(existing[-1].name).group(1)) + 1 if existing else 1
        path = folder / f"part-{seq:06d}-{uuid.uuid4().hex[:8]}.parquet"
        atomic_write(path, table_bytes(table), fault_point=True)
        return path

    def ids_in(self, folder: Path) -> set[str]:
        """The ledger: prompt_ids of committed parts, reading the id column only."""
        ids: set[str] = set()
        for part in self.parts(folder):
            ids.update(pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist())
        return ids

    def committed_ids(self) -> set[str]:
        return self.ids_in(self.data)

    def failed_ids(self) -> set[str]:
        return self.ids_in(self.failures)

    def read_table(self, folder: Path, columns: list[str] | None = None) -> pa.Table | None:
        parts = self.parts(folder)
        if not parts:
            return None
        return pa.concat_tables(pq.read_table(p, columns=columns) for p in parts)

    # --- the materialised prompt set --------------------------------------------------------------
    def prompt_set_versions(self) -> list[Path]:
        return sorted(self.prompts.glob("prompts-*.parquet"))

    def write_prompt_set(self, prompts: pa.Table, rejects: pa.Table) -> Path:
        version = len(self.prompt_set_versions()) + 1
        atomic_write(self.rejects / f"rejects-{version:06d}.parquet", table_bytes(rejects))
        path = self.prompts / f"prompts-{version:06d}.parquet"
        atomic_write(path, table_bytes(prompts))  # last: its presence means the set is complete
        return path

    def load_prompt_set(self) -> pa.Table | None:
        versions = self.prompt_set_versions()
        return pq.read_table(versions[-1]) if versions else None

    def rejects_table(self) -> pa.Table | None:
        versions = sorted(self.rejects.glob("rejects-*.parquet"))
        return pq.read_table(versions[-1]) if versions else None


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def resolve_run_dir(output_dir: str | Path, run_name: str, fingerprint: str, new_run: bool) -> RunDir:
    """`outputs/<run>` or its successors `<run>-r2`, `<run>-r3`, ... created by --new-run.

    Without --new-run the newest run of that name is resumed (the drift guard then checks it).
    With --new-run, the newest run is reused only if it already has this fingerprint.
    """
    root = Path(output_dir)
    candidates = [root / run_name] + sorted(
        (p for p in root.glob(f"{run_name}-r*") if p.name[len(run_name) + 2 :].isdigit()),
        key=lambda p: int(p.name[len(run_name) + 2 :]),
    )
    existing = [RunDir(p) for p in candidates if (p / "run.json").exists()]
    if not existing:
        return RunDir(root / run_name)
    newest = existing[-1]
    if not new_run or newest.read_manifest().get("fingerprint") == fingerprint:
        return newest
    return RunDir(root / f"{run_name}-r{len(candidates) + 1}")


class RunLock:
    """One driver per run directory. The OS lock dies with its process, so a stale lock left by a
    SIGKILL is taken over at once; `lock.json` names the holder for the refusal message."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._lock = filelock.FileLock(str(run_dir.path / "run.lock"), timeout=0)
        self.holder_path = run_dir.path / "lock.json"
        self.previous_holder: dict[str, Any] | None = None

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.holder_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def acquire(self) -> "RunLock":
        self.run_dir.path.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            holder = self.holder() or {}
            raise RunLocked(
                f"{self.run_dir.path} is in use by another regen driver "
                f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')})"
            ) from None
        self.previous_holder = self.holder()  # a holder file under a free lock: a stale lock, taken over
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_utc().isoformat(timespec="seconds")}
        atomic_write(self.holder_path, json.dumps(me).encode())
        return self

    def is_held(self) -> bool:
        probe = filelock.FileLock(str(self.run_dir.path / "run.lock"), timeout=0)
        try:
            probe.acquire()
        except filelock.Timeout:
            return True
        probe.release()
        return False

    def release(self) -> None:
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Committer:
    """The single committer: buffers results, drops any prompt already committed or buffered, and
    commits a part when the buffer is full or old enough. A SIGKILL loses only the buffer."""

    def __init__(self, run_dir: RunDir, done: set[str], flush_records: int, flush_interval_s: float):
        self.run_dir = run_dir
        self.done = done  # committed data + terminal failures (unless retried)
        self.flush_records, self.flush_interval_s = flush_records, flush_interval_s
        self.records: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.buffered: set[str] = set()
        self.dropped_duplicates = 0
        self.committed = 0
        self.committed_failures = 0
        self._oldest = time.monotonic()

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
        """Commit the buffer. Each part's rows leave the buffer only once that part is renamed, so a
        failed write (full disk) keeps them buffered and never commits them twice."""
        if self.records:
            self.run_dir.write_part(self.run_dir.data, pa.Table.from_pylist(self.records, schema=schema.RECORDS))
            self.committed += len(self.records)
            self._settle(self.records)
            self.records = []
        if self.failures:
            self.run_dir.write_part(self.run_dir.failures, pa.Table.from_pylist(self.failures, schema=schema.FAILURES))
            self.committed_failures += len(self.failures)
            self._settle(self.failures)
            self.failures = []

    def _settle(self, rows: list[dict[str, Any]]) -> None:
        ids = {row["prompt_id"] for row in rows}
        self.done |= ids
        self.buffered -= ids
