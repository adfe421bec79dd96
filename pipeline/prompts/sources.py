"""Source definitions (one small YAML file per source) and the readers of local files.

A reader yields `RawRecord`s (or a `Reject` for a record that cannot even be parsed); a format adapter
(`adapters.py`) turns a record into raw OpenAI-style messages; validation is `prompt_set.normalise`'s job.
Readers stream: no file is ever read whole. What a reader saw (the container, salvaged cuts, NUL bytes)
goes into a `ReadStats`.
"""
from __future__ import annotations

import glob as globlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import orjson
import yaml

from ..core.errors import ConfigError
from .errors import Cut, SourceError, TruncatedSource, read_error
from .adapters import source_ref, to_messages  # noqa: F401  (part of this module's interface)
from .records import RAW_MAX_CHARS, InvalidRecord, RawRecord, Reject, RejectCode  # noqa: F401

KINDS = ("jsonl", "json", "parquet", "hf")
FORMATS = ("sharegpt", "openai", "alpaca", "prompt")
DEFAULT_FIELD = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction", "prompt": "prompt"}
BOM = b"\xef\xbb\xbf"
_PARQUET_BATCH_ROWS = 1024


@dataclass
class ReadStats:
    """What the readers of one source saw, beyond the records themselves."""

    containers: dict[str, str] = field(default_factory=dict)  # file or dataset -> what it turned out to be
    cuts: list[Cut] = field(default_factory=list)  # salvaged files: where each was cut
    nul_bytes_removed: int = 0  # raw NUL bytes taken out of JSON text (JSON allows none outside escapes)


@dataclass(frozen=True)
class SourceSpec:
    name: str
    kind: str
    path: str
    format: str
    split: str = "train"
    subset: str | None = None
    field: str | None = None  # the conversation (or instruction, prompt) field of a record
    id_field: str | None = None
    limit: int | None = None
    records_field: str | None = None  # kind json: the key (dotted for nesting) of the object holding the records
    salvage: bool = False  # keep the complete records of a file cut short, and report the cut
    data_files: tuple[str, ...] = ()  # kind hf: which files of the folder (or hub repository) to read
    spec_file: Path | None = None  # relative paths resolve against its directory (else the working directory)

    @property
    def base_dir(self) -> Path:
        return self.spec_file.parent if self.spec_file is not None else Path.cwd()

    @property
    def conversation_field(self) -> str:
        return self.field or DEFAULT_FIELD[self.format]

    def local_path(self) -> Path:
        path = Path(self.path).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def shown(self, file: Path) -> str:
        """A file as messages and origins name it: relative to the spec's folder where it can be."""
        try:
            return file.relative_to(self.base_dir).as_posix()
        except ValueError:
            return str(file)


# key -> (accepted types, required)
_SPEC_KEYS: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": ((str,), True),
    "kind": ((str,), True),
    "path": ((str,), True),
    "format": ((str,), True),
    "split": ((str,), False),
    "subset": ((str,), False),
    "field": ((str,), False),
    "id_field": ((str,), False),
    "limit": ((int,), False),
    "records_field": ((str,), False),
    "salvage": ((bool,), False),
    "data_files": ((str, list), False),
}


def load_source_spec(path: str | Path) -> SourceSpec:
    """Read and strictly validate one source YAML file. Every error names the file and the key."""
    spec_file = Path(path).resolve()
    try:
        doc = yaml.safe_load(spec_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{spec_file}: cannot read source file: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{spec_file}: not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{spec_file}: a source file must be a mapping of keys to values")

    for key, value in doc.items():
        if key not in _SPEC_KEYS:
            allowed = ", ".join(_SPEC_KEYS)
            raise ConfigError(f"{spec_file}: unknown key {key!r} (allowed: {allowed})")
        types, _ = _SPEC_KEYS[key]
        # bool is an int subclass; `limit: true` is a typo, not a number
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            want = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{spec_file}: key {key!r} must be a {want}, got {type(value).__name__} {value!r}")
    for key, (_, required) in _SPEC_KEYS.items():
        if required and doc.get(key) in (None, ""):
            raise ConfigError(f"{spec_file}: missing required key {key!r}")

    kind = doc["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{spec_file}: key 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    if doc["format"] not in FORMATS:
        raise ConfigError(f"{spec_file}: key 'format' must be one of {', '.join(FORMATS)}, got {doc['format']!r}")
    for key, kinds in (("subset", ("hf",)), ("data_files", ("hf",)), ("records_field", ("json", "hf"))):
        if doc.get(key) is not None and kind not in kinds:
            raise ConfigError(f"{spec_file}: key {key!r} applies only to kind {' or '.join(kinds)}")
    if doc.get("limit") is not None and doc["limit"] < 1:
        raise ConfigError(f"{spec_file}: key 'limit' must be at least 1, got {doc['limit']}")
    for key in ("split", "field", "id_field", "subset", "records_field"):
        if doc.get(key) == "":
            raise ConfigError(f"{spec_file}: key {key!r} must not be empty")
    data_files = doc.get("data_files") or ()
    data_files = (data_files,) if isinstance(data_files, str) else tuple(data_files)
    if not all(isinstance(f, str) and f for f in data_files):
        raise ConfigError(f"{spec_file}: key 'data_files' must be a file name, a glob, or a list of them")

    return SourceSpec(
        name=doc["name"], kind=kind, path=doc["path"], format=doc["format"], split=doc.get("split") or "train",
        subset=doc.get("subset"), field=doc.get("field"), id_field=doc.get("id_field"), limit=doc.get("limit"),
        records_field=doc.get("records_field"), salvage=bool(doc.get("salvage")), data_files=data_files,
        spec_file=spec_file,
    )


# --- readers -----------------------------------------------------------------------------------
def read_records(spec: SourceSpec, stats: ReadStats | None = None,
                 stream_hub: bool = False) -> Iterator[RawRecord | Reject]:
    """Stream the records of a source, in file order. Unparseable records come out as `Reject`s; a source that
    cannot be read at all raises SourceError. `stream_hub`: stream a hub dataset rather than download it."""
    stats = stats if stats is not None else ReadStats()
    if spec.kind == "hf":
        from .hf import read_hf

        yield from read_hf(spec, stats, stream_hub)
        return
    for file in resolve_files(spec):
        yield from read_file(spec, file, spec.kind, stats)


def read_file(spec: SourceSpec, file: Path, kind: str, stats: ReadStats) -> Iterator[RawRecord | Reject]:
    """One local file, read by the reader of `kind` (jsonl, json, parquet or arrow)."""
    shown = spec.shown(file)
    try:
        if kind == "jsonl":
            yield from _read_jsonl(spec, file, shown, stats)
        elif kind == "json":
            from .jsonarray import read_json

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


def first_bytes(file: Path, n: int = 4096) -> bytes:
    """The start of a file without its BOM and leading whitespace: enough to tell a JSON array from JSON Lines."""
    with file.open("rb") as fh:
        head = fh.read(n)
    return head.removeprefix(BOM).lstrip()


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


def cut_or_salvage(spec: SourceSpec, cut: Cut, stats: ReadStats) -> None:
    """A file cut short: an error unless the spec salvages what came before the cut."""
    if not spec.salvage:
        raise TruncatedSource(spec.name, cut.file, cut)
    stats.cuts.append(cut)


def _read_parquet(spec: SourceSpec, file: Path, shown: str, stats: ReadStats) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    row = 0
    with pq.ParquetFile(file) as pf:
        stats.containers[shown] = f"Parquet, columns {', '.join(pf.schema_arrow.names)}"
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
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
            names = reader.schema.names
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pa.ipc.open_file(source)
            batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            names = file_reader.schema.names
        stats.containers[shown] = f"Arrow, columns {', '.join(names)}"
        row = 0
        for batch in batches:
            for offset in range(0, batch.num_rows, _PARQUET_BATCH_ROWS):
                for data in batch.slice(offset, _PARQUET_BATCH_ROWS).to_pylist():
                    yield RawRecord(spec.name, f"{shown}#{row}", data)
                    row += 1
