"""Materialising the prompt set: the config's sources are streamed into local temporary Parquet files, which
are committed into the run directory only once every source has been read (with the set's images, first:
store/run_images.py).

So a source that cannot be read, is cut short, or has no valid prompt writes nothing into the run directory,
and memory holds one batch of prompts or rejects at a time, never the set. The temporary files are removed when
the set is committed or dropped (or when the process ends). Also here: the source files' identity (run.json
`source_files`) and its check on resume.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.config import RunConfig
from ..core.errors import ConfigError
from ..core.identity import spec_renames
from ..core.images import content_text, images_of
from ..core.work import affinity_key
from ..prompts.errors import SourceError
from ..prompts.fileid import FilesCheck, compare_files, file_identity
from ..prompts.prompt_set import BuildResult, Prompt, Reject, build_into
from ..prompts.report import uncarried_tools_line
from ..prompts.sources import SourceSpec, load_source_spec
from ..prompts.tool_calls import as_written_json, has_tool_fields, message_from_row, message_row
from ..prompts.tokens import load_length_check
from . import schema
from .prompt_reader import route_schema
from .run_images import StagedImages
from .rundir import RunDir

log = logging.getLogger("regen")

BATCH_ROWS = 1024
BATCH_CHARS = 1 << 20  # a batch is written once its text reaches this (memory holds a few times it meanwhile)


class _BatchedWriter:
    def __init__(self, path: Path, table_schema: pa.Schema):
        self.path, self.schema = path, table_schema
        self.rows: list[dict] = []
        self.chars = 0
        self.count = 0
        self.writer = pq.ParquetWriter(str(path), table_schema, compression="zstd")

    def add(self, row: dict, chars: int) -> None:
        self.rows.append(row)
        self.chars += chars
        if len(self.rows) >= BATCH_ROWS or self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.count += len(self.rows)
            self.rows, self.chars = [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


class StagedPromptSet:
    """A PromptSink writing the prompts and rejects to temporary files; `commit` puts them in a run directory."""

    def __init__(self, affinity_chars: int = 0, images_store: str = "copy") -> None:
        """`affinity_chars`: the prefix length each prompt's routing key (`route_key`) is computed for;
        `images_store`: images.store (`reference`: local images are not copied into the run)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="regen-prompts-")
        folder = Path(self._tmp.name)
        self.affinity_chars = affinity_chars
        self.images = StagedImages(folder, images_store)
        self.prompts = _BatchedWriter(folder / "prompts.parquet", route_schema(schema.PROMPTS, affinity_chars))
        self.rejects = _BatchedWriter(folder / "rejects.parquet", schema.REJECTS)
        self.closed = False
        self.result: BuildResult | None = None
        self.files: dict[str, dict[str, dict[str, Any]]] = {}  # the source files' identity, taken before reading
        self.with_tools = 0  # prompts with tools, calls or results (a run of records schema < 5 cannot store them)
        self.with_parts = 0  # prompts with a content of parts (a run of records schema < 6 cannot store them)
        self.with_images = 0  # of them, prompts with images

    def add_prompt(self, p: Prompt) -> None:
        tools = as_written_json(list(p.tools)) if p.tools else None  # keys in the source's order, as sent
        if tools is not None or has_tool_fields(p.messages) or p.reference_tool_calls is not None:
            self.with_tools += 1
        parts = images_of(p.messages)
        images = len(parts)
        for part in parts:
            if not part.get("path"):  # its bytes go into the run (a `path` is read in place when sent)
                self.images.name(part["sha256"])
        if any(isinstance(m.get("content"), (list, tuple)) for m in p.messages):
            self.with_parts += 1
            self.with_images += images > 0
        chars = (sum(len(content_text(m["content"])) + len(m.get("tool_calls") or ()) for m in p.messages)
                 + len(p.reference or "") + len(tools or "") + 200 * images)
        rows = [message_row(m) for m in p.messages]
        # the key of the messages as a run reads them back (message_from_row), so it is the one dispatch would compute
        route_key = affinity_key([message_from_row(m) for m in rows], self.affinity_chars,
                                 None if tools is None else tools.encode())
        self.prompts.add({"prompt_id": p.prompt_id, "source": p.source, "origin": p.origin,
                          "source_ref": p.source_ref, "messages": rows,
                          "reference": p.reference, "reference_tool_calls": p.reference_tool_calls,
                          "tools": tools, "route_key": route_key, "images": images}, chars)

    def add_image(self, sha256: str, source: str | os.PathLike[str] | bytes) -> None:
        """One distinct image the sources read: a local path (copied into the run at the commit, unless
        images.store is `reference`) or its bytes (fetched, decoded from a `data:` URL or a dataset column)."""
        self.images.add(sha256, source)

    def add_reject(self, r: Reject) -> None:
        self.rejects.add({"source": r.source, "origin": r.origin, "reason": r.reason, "raw": r.raw,
                          "code": r.code or None}, len(r.raw) + len(r.reason))

    def close(self) -> None:
        if not self.closed:
            self.prompts.close()
            self.rejects.close()
            self.images.close()
            self.closed = True

    @property
    def reject_count(self) -> int:
        return self.rejects.count + len(self.rejects.rows)

    def commit(self, run_dir: RunDir) -> None:
        """The next prompt-set version of the run (RunDir.write_prompt_set's names): the images first (only those
        the run lacks), then the rejects, then the prompts, whose presence means the set is complete. An image that
        changed since it was read (ImageChanged) or a store that fails stops it before the prompts are written."""
        self.close()
        self.images.commit(run_dir.path)
        version = len(run_dir.prompt_set_versions()) + 1
        (run_dir.rejects / f"rejects-{version:06d}.parquet").copy_atomic(str(self.rejects.path))
        (run_dir.prompts / f"prompts-{version:06d}.parquet").copy_atomic(str(self.prompts.path))
        self.discard()

    def discard(self) -> None:
        self.close()
        self._tmp.cleanup()


def check_schema_takes_tools(staged: StagedPromptSet, schema_version: int | None) -> None:
    """A run keeps its records schema: prompts with tools cannot go into a run created before schema 5 (the staged
    set is discarded: nothing is written)."""
    version = schema_version or 1
    if staged.with_tools and version < schema.TOOLS_VERSION:
        staged.discard()
        raise ConfigError(f"{staged.with_tools:,} prompts of the sources call tools, which this run (created at "
                          f"records schema {version}) cannot store: tool calls need records schema "
                          f"{schema.TOOLS_VERSION}. Start a new run for them (regen generate --new-run, or another "
                          "run_name); nothing was written to this run")


def check_schema_takes_parts(staged: StagedPromptSet, schema_version: int | None) -> None:
    """Prompts whose content is a list of parts (images, text parts) cannot go into a run created before records
    schema 6 (the staged set is discarded: nothing is written)."""
    version = schema_version or 1
    if staged.with_parts and version < schema.IMAGES_VERSION:
        staged.discard()
        what = (f"{staged.with_images:,} prompts of the sources have images"
                + (f" and {staged.with_parts - staged.with_images:,} more have content parts"
                   if staged.with_parts > staged.with_images else "")
                if staged.with_images else f"{staged.with_parts:,} prompts of the sources have content parts")
        raise ConfigError(f"{what}, which this run (created at records schema {version}) cannot store: content "
                          f"parts need records schema {schema.IMAGES_VERSION}. Start a new run for them (regen "
                          "generate --new-run, or another run_name where the config still matches this run); "
                          "nothing was written to this run")


def check_schema_takes_samples(samples: int, schema_version: int | None) -> None:
    """A run created before records had `sample_index` (schema < 5) cannot tell several samples of a prompt apart."""
    version = schema_version or 1
    if samples > 1 and version < schema.SAMPLES_VERSION:
        raise ConfigError(f"samples_per_prompt: {samples}: this run was created at records schema {version}, whose "
                          f"records have no sample_index (it came with schema {schema.SAMPLES_VERSION}), so its "
                          "samples could not be told apart. Start a new run for several samples (regen generate "
                          "--new-run, or another run_name); nothing was written to this run")


def source_specs(cfg: RunConfig) -> dict[str, tuple[SourceSpec, int | None]]:
    """Each source of the config by its spec path as the config names it, with its limit (the run's, else the
    spec's)."""
    specs = {}
    for ref in cfg.sources:
        spec = load_source_spec(ref.spec)
        specs[ref.spec] = (spec, ref.limit if ref.limit is not None else spec.limit)
    return specs


ImageFetch = Callable[[str], bytes]  # an http(s) URL -> its bytes; raises core ImageFetchFailed (endpoints/)


def stage_prompt_set(cfg: RunConfig, fetch: ImageFetch | None = None) -> StagedPromptSet:
    """Read every source into a staged set (raises SourceError, TruncatedSource or NoValidPrompts, having
    written nothing anywhere but its own temporary folder). `fetch`: reads an http(s) image (None: such images
    are rejected, as `images.remote: refuse` asks; run.py passes endpoints/image_fetch.py's)."""
    specs = source_specs(cfg)
    staged = StagedPromptSet(cfg.prefix_affinity_chars, cfg.images.store)
    try:
        staged.files = file_identity({key: spec for key, (spec, _) in specs.items()})
        check = load_length_check(cfg.max_prompt_tokens, cfg.tokenizer_path(), cfg.served_chat_template(),
                                  cfg.images.tokens_per_image)
        staged.result = build_into(staged, list(specs.values()), mode=cfg.mode, seed=cfg.selection_seed,
                                   length_check=check, images=cfg.images, fetch=fetch)
        _check_every_listed_file_was_read(specs, staged)
        refuse_uncarried_tools(staged.result.reports)
        staged.close()
    except BaseException:
        staged.discard()
        raise
    return staged


def refuse_uncarried_tools(reports: list) -> None:
    """A source with a field of tool schemas the run would not send (prompts/schema_dialect.py looks_like_tools) is
    refused: the run would be tool-free without a word. `tools_field` or `ignore_fields` in its spec says which."""
    for report in reports:
        for key, n in sorted(report.uncarried_tools.items()):
            raise SourceError(report.name, uncarried_tools_line(report.name, key, n), "nothing was written to the run")


def _check_every_listed_file_was_read(specs: dict[str, tuple[SourceSpec, int | None]],
                                      staged: StagedPromptSet) -> None:
    """A file (of a glob) that was listed and hashed, then gone when the sources were read, would leave its prompts
    out while run.json records it."""
    reports = {r.name: r for r in staged.result.reports}
    for key, (spec, _) in specs.items():
        if spec.kind == "hf" or spec.name not in reports:  # hub and dataset folders: no per-file container
            continue
        unread = sorted(set(staged.files.get(key, {})) - set(reports[spec.name].containers))
        if unread:
            raise SourceError(spec.name, f"{unread[0]} disappeared while the sources were read (it matched "
                                         f"{spec.path!r} when they were listed)",
                              "restore it, or change `path`, and start again; nothing was written to the run")


def check_source_files(cfg: RunConfig, manifest: dict[str, Any]) -> FilesCheck:
    """The files recorded in run.json against the files as they are now (a run.json that recorded none: the
    current ones are recorded, and compared from then on)."""
    specs = {key: spec for key, (spec, _) in source_specs(cfg).items()}
    stored = manifest.get("source_files")
    if stored is None:
        return FilesCheck(recorded=file_identity(specs),
                          notes=["run.json recorded no source files (written by older regen): recorded them now"])
    # recorded under the spec paths run.json names: compared with the config's spec in the same place
    renames = spec_renames(manifest.get("prompts") or {}, cfg.prompt_identity())
    return compare_files({renames.get(key, key): files for key, files in stored.items()}, specs)


def report_document(staged: StagedPromptSet) -> dict[str, Any]:
    """run.json's `prompt_report`: each source's counts, and the set's."""
    assert staged.result is not None
    return {"sources": [r.as_dict() for r in staged.result.reports], "prompts": staged.result.prompts,
            "duplicates": staged.result.duplicates, "rejects": staged.reject_count}
