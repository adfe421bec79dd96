"""The readers of local files: JSON Lines, Parquet and Arrow here, one JSON array in jsonarray.py.

A reader yields `RawRecord`s (or a `Reject` for a record that cannot even be parsed) and streams: no file is
ever read whole. What it saw (the container, salvaged cuts, NUL bytes) goes into the source's `ReadStats`.
"""
from __future__ import annotations

import glob as globlib
from pathlib import Path
from typing import Iterator

import orjson

from ..core.errors import ConfigError
from .errors import Cut, SourceError, read_error
from .jsonarray import read_json
from .reading import BOM, ReadStats, cut_or_salvage, first_bytes
from .records import RAW_MAX_CHARS, RawRecord, Reject, RejectCode
from .spec import SourceSpec

_PARQUET_BATCH_ROWS = 1024
_BINARY_BATCH_ROWS = 64  # a table with binary columns (the bytes of a `datasets` Image column): fewer rows a batch


def batch_rows(schema) -> int:
    """The rows a batch of this Arrow schema is read in: memory holds one batch of records as Python objects."""
    return _BINARY_BATCH_ROWS if any(_has_binary(f.type) for f in schema) else _PARQUET_BATCH_ROWS


def _has_binary(dtype) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype):
        return True
    return any(_has_binary(dtype.field(i).type) for i in range(dtype.num_fields))


def read_file(spec: SourceSpec, file: Path, kind: str, stats: ReadStats) -> Iterator[RawRecord | Reject]:
    """One local file, read by the reader of `kind` (jsonl, json, parquet or arrow)."""
    shown = spec.shown(file)
    stats.file = file
    try:
        if kind == "jsonl":
            yield from _read_jsonl(spec, file, shown, stats)
        elif kind == "json":
            yield from read_json(spec, file, shown, stats)
        elif kind == "parquet":
            yield from _read_parquet(spec, file, shown, stats)
        elif kind == "arrow":
            yield from _read_arrow(spec, file, shown, stats)
        else:
            raise ConfigError(f"source {spec.name!r}: unknown kind {kind!r}")
    except (SourceError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a reader raises becomes one line naming source and cause
        raise read_error(spec.name, exc, shown) from exc


def resolve_files(spec: SourceSpec) -> list[Path]:
    pattern = spec.local_path()
    if globlib.has_magic(str(pattern)):
        files = sorted(Path(p) for p in globlib.glob(str(pattern), recursive=True) if Path(p).is_file())
        if not files:
            raise SourceError(spec.name, f"path {spec.path!r} matches no file (looked for {pattern})")
        return files
    if pattern.is_dir():
        raise SourceError(spec.name, f"path {spec.path!r} is a folder, not a file",
                          "name a file or a glob such as 'data/*.jsonl', or use kind: hf for a dataset folder")
    if not pattern.is_file():
        raise SourceError(spec.name, f"path {spec.path!r} is not a file (looked for {pattern})",
                          "check `path`; a relative path is read from the spec file's folder")
    return [pattern]


def _read_jsonl(spec: SourceSpec, file: Path, shown: str, stats: ReadStats) -> Iterator[RawRecord | Reject]:
    _check_json_lines(spec, file, shown)
    stats.containers[shown] = "JSON Lines"
    size = file.stat().st_size
    records, offset = 0, 0  # offset: where the current line starts, in the file's bytes
    with file.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            start, offset = offset, offset + len(line)
            if lineno == 1:
                line = line.removeprefix(BOM)
            if b"\x00" in line:
                stats.nul_bytes_removed += line.count(b"\x00")
                line = line.replace(b"\x00", b"")
            if not line.strip():
                continue
            origin = f"{shown}:{lineno}"
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                if offset == size and not line.endswith(b"\n"):
                    # the last line has no newline and does not parse: the file was cut in the middle of it
                    cut_or_salvage(spec, Cut(shown, start, records, size, size, truncated=True), stats)
                    return
                text = line.decode("utf-8", errors="replace").rstrip("\r\n")
                reason = f"the line is not valid JSON ({e})"
                yield Reject(spec.name, origin, reason, text[:RAW_MAX_CHARS], RejectCode.BAD_JSON.value)
                continue
            records += 1
            yield RawRecord(spec.name, origin, data)


def _check_json_lines(spec: SourceSpec, file: Path, shown: str) -> None:
    """A JSON document named as JSON Lines is said so at once, never rejected line by line."""
    head = first_bytes(file)
    first_line = head.split(b"\n", 1)[0].strip()
    if head.startswith(b"["):
        raise SourceError(spec.name, f"{shown} is one JSON array, not JSON Lines", "set `kind: json` in the spec")
    whole_line = b"\n" in head  # the first line ends within what was read
    if whole_line and (first_line == b"{" or (first_line.startswith(b"{") and first_line.endswith(b"["))):
        raise SourceError(spec.name, f"{shown} is one JSON document spread over many lines, not JSON Lines",
                          "set `kind: json` (and `records_field` to the key holding the records)")


def _read_parquet(spec: SourceSpec, file: Path, shown: str, stats: ReadStats) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    row = 0
    with pq.ParquetFile(file) as pf:
        stats.containers[shown] = f"Parquet, columns {', '.join(pf.schema_arrow.names)}"
        for batch in pf.iter_batches(batch_size=batch_rows(pf.schema_arrow)):
            for data in batch.to_pylist():
                yield RawRecord(spec.name, f"{shown}#{row}", data)
                row += 1


def _read_arrow(spec: SourceSpec, file: Path, shown: str, stats: ReadStats) -> Iterator[RawRecord]:
    """An Arrow file as `datasets` writes it (the IPC stream format), or the IPC file format."""
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
            table_schema = reader.schema
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pa.ipc.open_file(source)
            batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            table_schema = file_reader.schema
        stats.containers[shown] = f"Arrow, columns {', '.join(table_schema.names)}"
        rows = batch_rows(table_schema)
        row = 0
        for batch in batches:
            for offset in range(0, batch.num_rows, rows):
                for data in batch.slice(offset, rows).to_pylist():
                    yield RawRecord(spec.name, f"{shown}#{row}", data)
                    row += 1
