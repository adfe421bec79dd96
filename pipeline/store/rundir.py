"""The run directory: atomic part files, the ledger (done set), the run lock and run.json.

Layout of `outputs/<run>/`:
    run.json            identity: config fingerprint, generation config, prompt-set config, versions
    prompts/            the materialised prompt set, one file per refresh (prompts-000001.parquet, ...)
    rejects/            invalid inputs with their reason, one file per materialisation
    data/part-*.parquet committed records
    failures/part-*.parquet  terminal failures with the server's message
    index/data/, index/failures/  the ledger index: segments derived from the parts (ledger_index.py)
    images/<sha[:2]>/<sha>   each image of the prompt set once, by its content (images.store: copy; run_images.py)
    capture/            `regen capture`'s hidden states, a run directory of its own (store/capture_ledger.py)
    status.json         progress, rewritten atomically
    logs/
The run directory is a local or shared POSIX path or an object-store URI (see storage.py for what an
atomic commit is on each); readers never see a torn part.
"""
from __future__ import annotations

import logging
import os
import re
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
from ..core.errors import StorageError
from ..core.images import IMAGES_DIR
from .lock import RunLock  # the run's lock lives with its directory
from .prompt_reader import PromptSetReader, pinned_reader
from .ledger_index import LedgerRead, index_folder, read_ledger, units_of
from .partread import read_part_columns
from .storage import TMP_PREFIX, Location

log = logging.getLogger("regen")

PART_RE = re.compile(r"^part-(\d{6})-[0-9a-f]{8}\.parquet$")
VERSION_RE = re.compile(r"^prompts-(\d{6})\.parquet$")
PROMPT_GROUP_ROWS = 1024


def _remove_temp(folder: Location) -> list[Location]:
    removed = [tmp for tmp in folder.iterdir() if tmp.name.startswith(TMP_PREFIX)]
    for tmp in removed:
        tmp.unlink()
    return removed


def _part_units(parts: list[Location]) -> list[pa.Array]:
    """The unit ids of each part, reading the id columns only (every part of one run has its run's columns: the
    first one's say whether records name samples)."""
    with_samples = "sample_index" in parts[0].parquet_schema().names
    tables = read_part_columns(parts, ["prompt_id", "sample_index"] if with_samples else ["prompt_id"])
    ids = units_of(pa.concat_tables(tables, promote_options="default"))  # a column a part lacks: nulls
    out, start = [], 0
    for table in tables:
        out.append(ids.slice(start, table.num_rows))
        start += table.num_rows
    return out


def atomic_write(where: str | PathLike[str] | Location, data: bytes) -> None:
    """Write `data` so that the file either does not exist or is complete (storage.Location.write_atomic)."""
    Location.at(where).write_atomic(data)


def table_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=row_group_size)
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

    @property
    def images(self) -> Location:
        """RUN/images/: its own temporary files are at its top, its images one level down (run_images.py)."""
        return self.path / IMAGES_DIR

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
        for folder in (self.path, self.data, self.failures, self.rejects, self.prompts, self.logs, self.images):
            removed += _remove_temp(folder)
        for folder in (index_folder(self.data), index_folder(self.failures)):
            try:
                removed += _remove_temp(folder)
            except (StorageError, OSError) as exc:  # derived: a resume reads the parts instead (ledger_index.py)
                log.warning("could not clean %s (%s); the ledger index there is passed over", folder, exc)
        return removed

    @staticmethod
    def parts(folder: Location) -> list[Location]:
        return sorted(p for p in folder.iterdir() if PART_RE.match(p.name))

    def record_rows(self) -> int:
        """The records committed (rows of the data parts, from their footers): with all_turns one per regenerated
        turn, so more than the units."""
        return sum(part.parquet_file().metadata.num_rows for part in self.parts(self.data))

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
        """The ledger as a set of unit ids (`unit_ids`)."""
        return set(self.unit_ids(folder).to_pylist())

    def unit_ids(self, folder: Location) -> pa.Array:
        """The ledger: the unit ids (core/work.py unit_id) of committed parts, as one Arrow array (a unit of several
        rows, e.g. the turns of an all_turns record, is there as often). Built in Arrow from the id columns only
        (`units_of`), and from the ledger index's segments where they are valid (ledger_index.py)."""
        return self.ledger(folder).ids

    def ledger(self, folder: Location) -> LedgerRead:
        """`unit_ids`, with the parts no index segment covered (read one by one: the committer's next segment)."""
        read = read_ledger(folder, self.parts(folder), _part_units)
        for why in read.passed_over:
            log.info("ledger index of %s: passed over %s; its parts are read one by one", folder.name, why,
                     extra={"file_only": True})
        return read

    def committed_ids(self) -> set[str]:
        return self.ids_in(self.data)

    def failed_ids(self) -> set[str]:
        return self.ids_in(self.failures)

    def committed_units(self) -> pa.Array:
        return self.unit_ids(self.data)

    def failed_units(self) -> pa.Array:
        return self.unit_ids(self.failures)

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
        # small row groups: a run reads the set by position, a group at a time (prompt_reader.py)
        # last: its presence means the set is complete
        path.write_atomic(table_bytes(prompts, row_group_size=PROMPT_GROUP_ROWS))
        return path

    def load_prompt_set(self) -> pa.Table | None:
        """The whole newest set in memory (small sets and tests only; a run reads it through `prompt_set_reader`)."""
        versions = self.prompt_set_versions()
        return versions[-1].read_parquet() if versions else None

    def prompt_set_reader(self, version: int | None = None) -> PromptSetReader | None:
        """One version, pinned (a refresh adds a newer one), read by position a row group at a time. `version`: the
        one run.json records (`prompt_set_version`, counted as store/resume.py counts it); None: the newest."""
        return pinned_reader(self.prompt_set_versions(), version)

    def rejects_count(self) -> int:
        """Rows of the newest rejects file, from its footer."""
        versions = _versions(self.rejects, "rejects-")
        return versions[-1].parquet_file().metadata.num_rows if versions else 0

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
