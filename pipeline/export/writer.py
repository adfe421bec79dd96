"""What every JSONL export shares: reading a run's committed records, the summary of what was (not) exported, and
the atomic writer (a temporary file beside the output, fsynced, renamed over it only on success)."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from ..core.errors import ConfigError, StorageError
from ..store.rundir import TMP_PREFIX, RunDir
from . import formats
from .messages import normalise_record


class NotARunDirectory(ConfigError):
    """The path given is not a regen run directory (no run.json)."""


@dataclass
class ExportSummary:
    format: str
    mode: str
    out: Path
    records_read: int = 0
    records_exported: int = 0
    rows_written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    specforge_settings: dict[str, Any] = field(default_factory=dict)
    masked_truncated: int = 0  # token formats: truncated records whose last position is masked
    image_rows: int = 0  # speculators: rows written to the image conversations file (in rows_written too)

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count

    def counts(self) -> dict[str, Any]:
        return {"records_read": self.records_read, "records_exported": self.records_exported,
                "rows_written": self.rows_written, "image_rows_written": self.image_rows,
                "masked_truncated": self.masked_truncated, "dropped": dict(sorted(self.dropped.items()))}

    def table(self) -> str:
        lines = [f"export {self.format} ({self.mode} run) -> {self.out}",
                 f"  {'records read':<36}{self.records_read:>10}",
                 f"  {'records exported':<36}{self.records_exported:>10}",
                 f"  {'rows written':<36}{self.rows_written:>10}"]
        if self.image_rows:
            lines.append(f"  {'  of them image conversations':<36}{self.image_rows:>10}")
        lines += [f"  {'dropped: ' + reason:<36}{count:>10}" for reason, count in sorted(self.dropped.items())]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# --- reading ---------------------------------------------------------------------------------------
def read_run_manifest(run_dir: RunDir) -> dict[str, Any]:
    if not run_dir.exists():
        raise NotARunDirectory(f"{run_dir.path} is not a run directory (no run.json)")
    return run_dir.read_manifest()


def committed_part_records(run_dir: RunDir, source_refs: "SourceRefs | None" = None) -> Iterator[list[dict[str, Any]]]:
    """The records of each committed part, one part at a time (an all_turns conversation is never
    split across parts), their messages normalised (export/messages.py). Columns a part written by older code
    lacks read as None, except `source_ref`, joined from the prompt set by `source_refs` where given."""
    for part in RunDir.parts(run_dir.data):
        records = [normalise_record(r) for r in part.read_parquet().to_pylist()]
        if source_refs is not None and records and "source_ref" not in records[0]:
            for record in records:
                record["source_ref"] = source_refs.of(record["prompt_id"])
        yield records


def conversations_in(records: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Group a part's records by conversation (a prompt, or one sample of it: formats.conversation_id), in
    first-seen order, each group ordered by turn_index."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(formats.conversation_id(record), []).append(record)
    for turns in groups.values():
        yield sorted(turns, key=lambda r: r["turn_index"] or 0)


# --- writing ---------------------------------------------------------------------------------------
class AtomicJsonlWriter:
    """Streams JSON lines to a temporary file beside `out`; renames it over `out` only on success."""

    def __init__(self, out: Path, lazy: bool = False):
        """`lazy`: the file is created by the first row only (an export with no such row writes no file)."""
        self.out = out
        self.tmp = out.with_name(f"{TMP_PREFIX}{out.name}.{uuid.uuid4().hex[:8]}")
        self.ids: set[str] = set()
        self.lazy = lazy
        self._handle = None

    def _open(self) -> None:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.tmp, "wb")
        except OSError as exc:
            raise StorageError(f"cannot write {self.out}: {os.strerror(exc.errno) if exc.errno else exc}") from exc

    def __enter__(self) -> "AtomicJsonlWriter":
        if not self.lazy:
            self._open()
        return self

    @property
    def written(self) -> bool:
        return self._handle is not None

    def write(self, row: dict[str, Any]) -> bool:
        """Write one row unless its id was already written."""
        if row["id"] in self.ids:
            return False
        self.ids.add(row["id"])
        if self._handle is None:
            self._open()
        try:
            self._handle.write(orjson.dumps(row) + b"\n")
        except OSError as exc:
            raise StorageError(f"cannot write {self.out}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        return True

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if self._handle is None:
            return
        try:
            if exc_type is None:
                self._handle.flush()
                os.fsync(self._handle.fileno())
            self._handle.close()
            if exc_type is None:
                os.replace(self.tmp, self.out)
                fd = os.open(self.out.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as err:
            self.tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write {self.out}: {os.strerror(err.errno) if err.errno else err}") from err
        finally:
            if exc_type is not None:
                self.tmp.unlink(missing_ok=True)


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


class SourceRefs:
    """The source's own id of each prompt, for runs whose records predate the `source_ref` column (records schema
    6): read once from the prompt set (its `prompt_id` and `source_ref` columns only; every version of it, the first
    one holding an id wins: a prompt two sources held keeps the first source's id, as dedup keeps its record)."""

    def __init__(self, run_dir: RunDir, only: set[str] | None = None):
        """`only`: keep these prompts' ids alone (the card's examples), not the whole set's."""
        self.run_dir, self.only = run_dir, only
        self._refs: dict[str, str] | None = None

    def _load(self) -> dict[str, str]:
        refs: dict[str, str] = {}
        for version in self.run_dir.prompt_set_versions():
            if "source_ref" not in version.parquet_schema().names:
                continue
            for batch in version.parquet_file().iter_batches(columns=["prompt_id", "source_ref"]):
                for pid, ref in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                    if ref is not None and (self.only is None or pid in self.only):
                        refs.setdefault(pid, ref)
        return refs

    def of(self, prompt_id: str) -> str | None:
        if self._refs is None:
            self._refs = self._load()
        return self._refs.get(prompt_id)
