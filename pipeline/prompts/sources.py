"""Source definitions (one small YAML file per source), readers and format adapters.

A reader yields `RawRecord`s (or a `Reject` for a record that cannot even be parsed) and a format adapter turns a
record into raw OpenAI-style messages. Validation of roles and contents is `prompts.normalise`'s job.
"""
from __future__ import annotations

import glob as globlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import orjson
import yaml

from ..core.errors import ConfigError

KINDS = ("jsonl", "parquet", "hf")
FORMATS = ("sharegpt", "openai", "alpaca", "prompt")
DEFAULT_FIELD = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction", "prompt": "prompt"}
RAW_MAX_CHARS = 2000
_PARQUET_BATCH_ROWS = 1024


class RejectCode(str, Enum):
    """Why a record was rejected, for code and counts; the human sentence is `reason`."""

    BAD_JSON = "bad_json"
    NOT_OBJECT = "not_object"
    MISSING_FIELD = "missing_field"
    BAD_CONVERSATION = "bad_conversation"  # the conversation field is not a list
    BAD_MESSAGE = "bad_message"  # a message is not an object or lacks its role/content key
    EMPTY = "empty_conversation"
    NO_USER_TURN = "no_user_turn"
    NON_STRING_CONTENT = "non_string_content"
    BLANK_CONTENT = "blank_content"
    UNKNOWN_ROLE = "unknown_role"
    NOT_ALTERNATING = "roles_not_alternating"
    SYSTEM_NOT_FIRST = "system_not_first"
    NOTHING_TO_SEND = "nothing_to_send"


class InvalidRecord(ValueError):
    """A record that cannot become a prompt. `reason` is a sentence meant for a human."""

    def __init__(self, code: RejectCode, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass(frozen=True)
class Reject:
    source: str
    origin: str
    reason: str
    raw: str  # the record text, truncated to RAW_MAX_CHARS
    code: str = ""  # a RejectCode value


@dataclass(frozen=True)
class RawRecord:
    source: str
    origin: str  # "sample/sharegpt.jsonl:17", "data.parquet#3", "HuggingFaceH4/ultrachat_200k[train_sft]#1234"
    data: Any


@dataclass(frozen=True)
class SourceSpec:
    name: str
    kind: str
    path: str
    format: str
    split: str = "train"
    subset: str | None = None
    field: str | None = None
    id_field: str | None = None
    limit: int | None = None
    spec_file: Path | None = None  # relative paths resolve against its directory (else the working directory)

    @property
    def base_dir(self) -> Path:
        return self.spec_file.parent if self.spec_file is not None else Path.cwd()

    @property
    def conversation_field(self) -> str:
        return self.field or DEFAULT_FIELD[self.format]


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
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            want = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{spec_file}: key {key!r} must be a {want}, got {type(value).__name__} {value!r}")
    for key, (_, required) in _SPEC_KEYS.items():
        if required and doc.get(key) in (None, ""):
            raise ConfigError(f"{spec_file}: missing required key {key!r}")

    if doc["kind"] not in KINDS:
        raise ConfigError(f"{spec_file}: key 'kind' must be one of {', '.join(KINDS)}, got {doc['kind']!r}")
    if doc["format"] not in FORMATS:
        raise ConfigError(f"{spec_file}: key 'format' must be one of {', '.join(FORMATS)}, got {doc['format']!r}")
    if doc.get("subset") is not None and doc["kind"] != "hf":
        raise ConfigError(f"{spec_file}: key 'subset' applies only to kind 'hf'")
    if doc.get("limit") is not None and doc["limit"] < 1:
        raise ConfigError(f"{spec_file}: key 'limit' must be at least 1, got {doc['limit']}")
    for key in ("split", "field", "id_field", "subset"):
        if doc.get(key) == "":
            raise ConfigError(f"{spec_file}: key {key!r} must not be empty")

    return SourceSpec(
        name=doc["name"],
        kind=doc["kind"],
        path=doc["path"],
        format=doc["format"],
        split=doc.get("split") or "train",
        subset=doc.get("subset"),
        field=doc.get("field"),
        id_field=doc.get("id_field"),
        limit=doc.get("limit"),
        spec_file=spec_file,
    )


# --- readers -----------------------------------------------------------------------------------
def read_records(spec: SourceSpec) -> Iterator[RawRecord | Reject]:
    """Stream the records of a source, in file order. Unparseable records come out as `Reject`s."""
    if spec.kind == "jsonl":
        for file in _resolve_files(spec):
            yield from _read_jsonl(spec, file)
    elif spec.kind == "parquet":
        for file in _resolve_files(spec):
            yield from _read_parquet(spec, file)
    elif spec.kind == "hf":
        yield from _read_hf(spec)
    else:
        raise ConfigError(f"source {spec.name!r}: unknown kind {spec.kind!r}")


def _resolve_files(spec: SourceSpec) -> list[Path]:
    pattern = Path(spec.path)
    if not pattern.is_absolute():
        pattern = spec.base_dir / pattern
    if globlib.has_magic(str(pattern)):
        files = sorted(Path(p) for p in globlib.glob(str(pattern), recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"source {spec.name!r}: path {spec.path!r} matches no file (looked for {pattern})")
        return files
    if not pattern.is_file():
        raise ConfigError(f"source {spec.name!r}: path {spec.path!r} is not a file (looked for {pattern})")
    return [pattern]


def _display(spec: SourceSpec, file: Path) -> str:
    try:
        return file.relative_to(spec.base_dir).as_posix()
    except ValueError:
        return str(file)


def _read_jsonl(spec: SourceSpec, file: Path) -> Iterator[RawRecord | Reject]:
    shown = _display(spec, file)
    with file.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            origin = f"{shown}:{lineno}"
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                text = line.decode("utf-8", errors="replace").rstrip("\r\n")
                reason = f"the line is not valid JSON ({e})"
                yield Reject(spec.name, origin, reason, text[:RAW_MAX_CHARS], RejectCode.BAD_JSON.value)
                continue
            yield RawRecord(spec.name, origin, data)


def _read_parquet(spec: SourceSpec, file: Path) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    shown = _display(spec, file)
    row = 0
    with pq.ParquetFile(file) as pf:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for data in batch.to_pylist():
                yield RawRecord(spec.name, f"{shown}#{row}", data)
                row += 1


def _read_hf(spec: SourceSpec) -> Iterator[RawRecord]:
    import datasets

    local = Path(spec.path)
    if not local.is_absolute():
        local = spec.base_dir / local
    label = spec.path + (f"/{spec.subset}" if spec.subset else "") + f"[{spec.split}]"
    try:
        if local.is_dir() and ((local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise ConfigError(
                        f"source {spec.name!r}: {spec.path!r} has no split {spec.split!r} (has {', '.join(ds)})"
                    )
                ds = ds[spec.split]
        else:
            # A local directory of data files, or a dataset on the hub.
            target = str(local) if local.exists() else spec.path
            ds = datasets.load_dataset(target, name=spec.subset, split=spec.split)
    except (FileNotFoundError, ValueError) as e:
        # datasets reports a missing dataset, split or subset as FileNotFoundError / ValueError subclasses
        raise ConfigError(f"source {spec.name!r}: cannot load {label}: {e}") from e
    for i, data in enumerate(ds):
        yield RawRecord(spec.name, f"{label}#{i}", data)


# --- format adapters ---------------------------------------------------------------------------
def to_messages(spec: SourceSpec, data: Any) -> list[dict[str, Any]]:
    """Turn one record into raw `{"role", "content"}` messages; roles and contents are checked by `normalise`."""
    if not isinstance(data, dict):
        raise InvalidRecord(RejectCode.NOT_OBJECT, f"the record is a JSON {_json_type(data)}, not an object")
    field = spec.conversation_field
    if spec.format in ("sharegpt", "openai"):
        return _conversation(data, field, spec.format)
    if spec.format == "alpaca":
        return _alpaca(data, field)
    if spec.format == "prompt":
        return _prompt(data, field)
    raise ConfigError(f"source {spec.name!r}: unknown format {spec.format!r}")


def source_ref(spec: SourceSpec, data: Any) -> str | None:
    """The value of the source's id field, kept for traceability only."""
    if spec.id_field is None or not isinstance(data, dict) or data.get(spec.id_field) is None:
        return None
    return str(data[spec.id_field])


def _conversation(data: dict, field: str, fmt: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise InvalidRecord(RejectCode.MISSING_FIELD, f"the record has no conversation field {field!r}")
    conv = data[field]
    if not isinstance(conv, list):
        raise InvalidRecord(RejectCode.BAD_CONVERSATION,
                            f"the conversation field {field!r} is a {_json_type(conv)}, not a list of messages")
    if not conv:
        raise InvalidRecord(RejectCode.EMPTY, "the conversation is empty")
    # ShareGPT dumps sometimes use role/content inside `conversations`, and vice versa; accept both spellings.
    primary = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    other = ("role", "content") if fmt == "sharegpt" else ("from", "value")
    out = []
    for i, item in enumerate(conv, start=1):
        if not isinstance(item, dict):
            raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} is a {_json_type(item)}, not an object")
        rk, ck = other if primary[0] not in item and other[0] in item else primary
        if rk not in item:
            raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} has no role ({rk!r} is missing)")
        if ck not in item:
            raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} has no content ({ck!r} is missing)")
        out.append({"role": item[rk], "content": item[ck]})
    return out


def _alpaca(data: dict, field: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise InvalidRecord(RejectCode.MISSING_FIELD, f"the record has no instruction field {field!r}")
    instruction, extra, output = data[field], data.get("input"), data.get("output")
    for name, value in ((field, instruction), ("input", extra), ("output", output)):
        if value is not None and not isinstance(value, str):
            raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                f"the field {name!r} is a {_json_type(value)}, not a string")
    text = instruction
    if extra and extra.strip():
        text = f"{instruction.strip()}\n\n{extra.strip()}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": text}]
    if output and output.strip():
        msgs.append({"role": "assistant", "content": output})
    return msgs


def _prompt(data: dict, field: str) -> list[dict[str, Any]]:
    if field not in data or data[field] is None:
        raise InvalidRecord(RejectCode.MISSING_FIELD, f"the record has no prompt field {field!r}")
    msgs: list[dict[str, Any]] = []
    if data.get("system") is not None:
        msgs.append({"role": "system", "content": data["system"]})
    msgs.append({"role": "user", "content": data[field]})
    return msgs


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__
