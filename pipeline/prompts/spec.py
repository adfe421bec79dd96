"""A source spec: one small YAML file per source (prompts_sources/*.yaml), validated strictly.

`SourceSpecFile` is the file's schema (every key with its type, default and meaning: the docs' reference is
generated from it); `load_source_spec` validates a file into the `SourceSpec` the readers use. Every error names
the file and the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from ..core.errors import ConfigError

KINDS = ("jsonl", "json", "parquet", "hf")
FORMATS = ("sharegpt", "openai", "alpaca", "prompt", "input_output", "question_answer")
DEFAULT_FIELD = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction", "prompt": "prompt",
                 "input_output": "input", "question_answer": "question"}


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
    image_root: str | None = None  # the folder local images resolve against and must lie in (None: image_folder)
    image_field: str | None = None  # the record's images field (None: `image`, then `images`)
    tools_field: str | None = None  # the record's tools column (a list, or a JSON string of one), beside `tools`
    ignore_fields: tuple[str, ...] = ()  # top-level keys known not to shape the prompt: not counted, not checked
    schema_dialect: str | None = None  # the tools' schema dialect to map from (schema_dialect.py: "bfcl")

    @property
    def base_dir(self) -> Path:
        return self.spec_file.parent if self.spec_file is not None else Path.cwd()

    @property
    def conversation_field(self) -> str:
        return self.field or DEFAULT_FIELD[self.format]

    def local_path(self) -> Path:
        path = Path(self.path).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def image_folder(self, data_file: Path | None) -> Path | None:
        """The folder a record's relative image paths resolve against, and that every local image must lie in:
        `image_root` (relative to the spec's folder); else the folder of a kind-hf local dataset, or the folder of
        the data file read (`data_file`). None: a hub dataset, which has no folder of its own."""
        if self.image_root is not None:
            root = Path(self.image_root).expanduser()
            return root if root.is_absolute() else self.base_dir / root
        if self.kind == "hf":
            local = self.local_path()
            if local.is_dir():
                return local
            return local.parent if local.is_file() else None
        return data_file.parent if data_file is not None else None

    def shown(self, file: Path) -> str:
        """A file as messages and origins name it: relative to the spec's folder where it can be."""
        try:
            return file.relative_to(self.base_dir).as_posix()
        except ValueError:
            return str(file)


# The types a key accepts as YAML gives them (bool is never an int here: `limit: true` is a typo).
_TYPES: dict[str, tuple[type, ...]] = {"limit": (int,), "salvage": (bool,), "data_files": (str, list),
                                       "ignore_fields": (str, list)}


class SourceSpecFile(BaseModel):
    """The keys of a source spec file. Unknown keys, wrong types and keys of another kind are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The source's name: each record's `source`, the reports' rows, and "
                                  "`regen export --source NAME`.")
    kind: Literal["jsonl", "json", "parquet", "hf"] = Field(
        description="How to read `path`: `jsonl` (one JSON object a line; a glob reads several files), `json` (one "
                    "JSON array, or an object holding one under `records_field`, streamed), `parquet` (read in "
                    "batches) or `hf` (a hub dataset, a `save_to_disk` folder, a local data file or folder).")
    path: str = Field(description="The file, glob, folder or hub dataset name. A relative path is read from the "
                                  "spec file's folder.")
    format: Literal["sharegpt", "openai", "alpaca", "prompt", "input_output", "question_answer"] = Field(
        description="The record format: `sharegpt` (`from`/`value` turns), `openai` (`role`/`content` messages), "
                    "`alpaca` (`instruction`, optional `input` and `output`), `prompt` (one user message, optional "
                    "`system`), `input_output` (a list of `role`/`content` messages under `input`, the reply in "
                    "`output`: Nemotron post-training) or `question_answer` (`question` and its `answer`: GSM8K).")
    split: str = Field("train", description="kind hf: the split to read.")
    subset: str | None = Field(None, description="kind hf: the dataset's configuration (subset) name.")
    field: str | None = Field(None, description="The record's conversation field (default by format: "
                                                "`conversations`, `messages`, `instruction`, `prompt`, `input`, "
                                                "`question`). A dotted path reads into objects and lists: "
                                                "`question.0` is the first item of the list `question` (BFCL's "
                                                "first turn: docs/sources-tool-calls.md).")
    id_field: str | None = Field(None, description="A field holding the record's own id, kept on each record as its "
                                                   "`source_ref` (for tracing only: it is not the prompt id).")
    limit: int | None = Field(None, ge=1, description="Keep at most this many prompts of the source: of those earlier "
                                                "sources do not hold, the ones of lowest sha256(seed:prompt_id). The "
                                                "run config's `sources[].limit` wins over it.")
    records_field: str | None = Field(None, description="kind json (or a `.json` file of kind hf): the key of the "
                                                        "object that holds the records, dotted for nesting "
                                                        "(`data.train`).")
    salvage: bool = Field(False, description="Keep the complete records of a file cut short (or invalid before its "
                                             "end) and report the cut, instead of refusing the source.")
    data_files: str | list[str] | None = Field(None, description="kind hf: which files of the folder (or hub "
                                                                 "repository) to read: a name, a glob or a list.")
    image_root: str | None = Field(None, description="The folder that relative image paths resolve against, and "
                                                     "that every local image must lie in once `..` and symbolic "
                                                     "links are resolved (`image_outside_root` otherwise). A "
                                                     "relative `image_root` is read from the spec file's folder. "
                                                     "Default: the data file's folder (kind hf: the dataset's "
                                                     "folder); a hub dataset has none, so its images must be "
                                                     "bytes (a `datasets` Image column), URLs, or paths under an "
                                                     "`image_root` you set (docs/sources.md, section Images).")
    image_field: str | None = Field(None, description="The record's field holding its images beside the "
                                                      "conversation: one reference or a list (a path, a URL, or a "
                                                      "`datasets` Image value), placed at the `<image>` markers of "
                                                      "the user turns, else before the first user text. Default: "
                                                      "`image`, then `images`.")

    tools_field: str | None = Field(None, description="The record's field holding its tool schemas (a list, or a "
                                                      "JSON string of one; bare `{name, parameters}` objects are "
                                                      "wrapped as OpenAI tools): BFCL's `function`, xlam's `tools`. "
                                                      "sharegpt, openai, input_output read it beside `tools` and "
                                                      "`functions`; prompt, alpaca, question_answer read tools "
                                                      "only from it.")
    ignore_fields: str | list[str] | None = Field(None, description="Top-level fields of a record known not to "
                                                                    "shape the prompt: not counted as `fields not "
                                                                    "carried`, and not refused when they look like "
                                                                    "tool schemas (say so for a column of schemas "
                                                                    "the run should not send).")
    schema_dialect: Literal["bfcl"] | None = Field(None, description="Map the tools' schemas from this dialect to "
                                                                      "JSON Schema (`bfcl`: BFCL's own mapping; each "
                                                                      "mapped schema is counted). Without it schemas "
                                                                      "are sent as given, and what is not JSON "
                                                                      "Schema is counted.")

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, doc: Any, info: ValidationInfo) -> Any:
        spec_file = (info.context or {}).get("spec_file", "source spec")
        if not isinstance(doc, dict):
            raise ConfigError(f"{spec_file}: a source file must be a mapping of keys to values")
        for key, value in doc.items():
            if key not in cls.model_fields:
                allowed = ", ".join(cls.model_fields)
                raise ConfigError(f"{spec_file}: unknown key {key!r} (allowed: {allowed})")
            types = _TYPES.get(key, (str,))
            if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                want = " or ".join(t.__name__ for t in types)
                raise ConfigError(f"{spec_file}: key {key!r} must be a {want}, got {type(value).__name__} {value!r}")
        for key, field in cls.model_fields.items():
            if field.is_required() and doc.get(key) in (None, ""):
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
        if doc.get("schema_dialect") is not None and doc["schema_dialect"] not in ("bfcl",):
            raise ConfigError(f"{spec_file}: key 'schema_dialect' must be bfcl, got {doc['schema_dialect']!r}")
        ignored = doc.get("ignore_fields") or ()
        ignored = (ignored,) if isinstance(ignored, str) else tuple(ignored)
        if not all(isinstance(f, str) and f for f in ignored):
            raise ConfigError(f"{spec_file}: key 'ignore_fields' must be a field name or a list of them")
        for key in ("split", "field", "id_field", "subset", "records_field", "image_root", "image_field",
                    "tools_field"):
            if doc.get(key) == "":
                raise ConfigError(f"{spec_file}: key {key!r} must not be empty")
        data_files = doc.get("data_files") or ()
        data_files = (data_files,) if isinstance(data_files, str) else tuple(data_files)
        if not all(isinstance(f, str) and f for f in data_files):
            raise ConfigError(f"{spec_file}: key 'data_files' must be a file name, a glob, or a list of them")
        return {key: value for key, value in doc.items() if value is not None}  # a key given as null: its default

    def spec(self, spec_file: Path | None = None) -> SourceSpec:
        data_files = self.data_files or ()
        return SourceSpec(
            name=self.name, kind=self.kind, path=self.path, format=self.format, split=self.split or "train",
            subset=self.subset, field=self.field, id_field=self.id_field, limit=self.limit,
            records_field=self.records_field, salvage=self.salvage,
            data_files=(data_files,) if isinstance(data_files, str) else tuple(data_files), spec_file=spec_file,
            image_root=self.image_root, image_field=self.image_field, tools_field=self.tools_field,
            ignore_fields=(self.ignore_fields,) if isinstance(self.ignore_fields, str) else tuple(
                self.ignore_fields or ()), schema_dialect=self.schema_dialect)


def load_source_spec(path: str | Path) -> SourceSpec:
    """Read and strictly validate one source YAML file. Every error names the file and the key."""
    spec_file = Path(path).resolve()
    try:
        doc = yaml.safe_load(spec_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{spec_file}: cannot read source file: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{spec_file}: not valid YAML: {e}") from e
    try:
        return SourceSpecFile.model_validate(doc, context={"spec_file": spec_file}).spec(spec_file)
    except ValidationError as exc:  # the checks above come first; this names anything they let through
        problems = "; ".join(f"key {'.'.join(map(str, e['loc'])) or '(top level)'!r}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{spec_file}: {problems}") from None
