"""Normalisation, validation, content-addressed identity, per-source limit and cross-source dedup.

`prompt_id` hashes only the normalised messages that are sent plus the regeneration mode (docs/architecture.md), so it
does not depend on the source name, file position, the reference answer or a source's own id field.

The set is built in one streaming pass per source into a sink (a list for small uses, Parquet files for a run):
rejects go to the sink as they come, a source without a limit passes its prompts on in file order, and a limit
keeps a bounded heap (selection.py). Memory holds the ids seen, never the source.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import orjson

from ..core.config_sections import Images
from ..core.errors import ConfigError
from .adapters import to_conversation
from .errors import NoValidPrompts, SourceError
from .images import Fetch, ImageReader, check_folder
from .normalise import MODES, ROLE_MAP, check_mode, normalise, normalise_record, prompt_id
from .records import RAW_MAX_CHARS, InvalidRecord, Reject, RejectCode, Tally
from .report import SourceReport
from .selection import BoundedSelection, rank
from .sources import ReadStats, SourceSpec, read_records, source_ref

__all__ = [
    "MODES", "Prompt", "PromptSet", "Reject", "RejectCode", "SourceReport", "InvalidRecord", "BuildResult",
    "prompt_id", "normalise", "normalise_record", "build_prompt_set", "build_into", "ROLE_MAP",
]

@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # 32 hex chars
    source: str
    messages: tuple[dict[str, Any], ...]  # what is sent; in last_turn mode it ends with a user turn or tool results
    reference: str | None  # the text of the source's original final assistant step, if it had one
    origin: str  # where the first occurrence came from
    source_ref: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # the OpenAI `tools` list the prompt is sent with; None: none
    reference_tool_calls: str | None = None  # the calls of that final step (canonical JSON), when it made any
    # what its record did not carry (Tally.uncarried, .tool_like as ("tools:KEY", n)) and its fields that are whole
    # transcripts (.transcripts as ("transcript:KEY", n)): counted once it is selected
    uncarried: tuple[tuple[str, int], ...] = field(default=(), compare=False)


class PromptSink(Protocol):
    def add_prompt(self, prompt: Prompt) -> None: ...

    def add_reject(self, reject: Reject) -> None: ...

    def add_image(self, sha256: str, source: str | bytes) -> None:
        """An image whose bytes go into the run (`images.store: copy`, and always for data:, http(s) and `datasets`
        bytes): `source` is the absolute realpath of a local file whose bytes hashed to `sha256` (copy it and check
        its hash again), or the bytes themselves. Called once per sha256 per build, when the image is read: before
        its prompt is known to be kept (a later reject of the record, a duplicate, a limit may drop it), so keep
        only the images the committed prompts' parts name. Never called under `images.store: reference` for a
        local file (its part carries `path`)."""
        ...


@dataclass
class PromptSet:
    """A prompt set held in memory (tests, `regen simulate`); a run streams into Parquet instead."""

    prompts: list[Prompt] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    reports: list[SourceReport] = field(default_factory=list)
    duplicates: int = 0
    images: dict[str, str | int] = field(default_factory=dict)  # sha256 -> a local file's path, or a byte count

    def add_prompt(self, prompt: Prompt) -> None:
        self.prompts.append(prompt)

    def add_reject(self, reject: Reject) -> None:
        self.rejects.append(reject)

    def add_image(self, sha256: str, source: str | bytes) -> None:
        self.images[sha256] = source if isinstance(source, str) else len(source)  # bytes are not held


@dataclass
class BuildResult:
    reports: list[SourceReport]
    duplicates: int
    prompts: int


def _not_json(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):  # an image's bytes: their count, not their text
        return f"<{len(value):,} bytes>"
    return str(value)


def _raw_text(data: Any) -> str:
    try:
        text = orjson.dumps(data, default=_not_json).decode()
    except TypeError:  # e.g. non-string dict keys from a parquet map column
        text = repr(data)
    return text[:RAW_MAX_CHARS]


def _encode(p: Prompt) -> bytes:
    return orjson.dumps([p.prompt_id, p.source, p.messages, p.reference, p.origin, p.source_ref, p.tools,
                         p.reference_tool_calls, p.uncarried])


def _decode(blob: bytes) -> Prompt:
    pid, source, messages, reference, origin, ref, tools, calls, uncarried = orjson.loads(blob)
    return Prompt(pid, source, tuple(messages), reference, origin, ref, None if tools is None else tuple(tools),
                  calls, tuple((name, n) for name, n in uncarried))


TOOL_LIKE = "tools:"  # Prompt.uncarried: a field not carried that looks like tool schemas
TRANSCRIPT = "transcript:"  # Prompt.uncarried: a one-prompt field whose text is a whole conversation


def _uncarried(tally: Tally) -> tuple[tuple[str, int], ...]:
    """What the record did not carry, taken out of its tally: counted when the prompt is selected (`_selected`)."""
    out = (tuple(tally.uncarried.items()) + tuple((TOOL_LIKE + key, n) for key, n in tally.tool_like.items())
           + tuple((TRANSCRIPT + key, n) for key, n in tally.transcripts.items()))
    tally.uncarried, tally.tool_like, tally.transcripts = {}, {}, {}
    return out


def _selected(report: SourceReport, prompt: Prompt) -> None:
    for name, n in prompt.uncarried:
        target, key = ((report.uncarried_tools, name[len(TOOL_LIKE):]) if name.startswith(TOOL_LIKE)
                       else (report.transcript_in_one_message, name[len(TRANSCRIPT):]) if name.startswith(TRANSCRIPT)
                       else (report.uncarried, name))
        target[key] = target.get(key, 0) + n


# (messages, tools) -> None; raises InvalidRecord(TOO_LONG)
LengthCheck = Callable[[tuple[dict[str, Any], ...], list[dict[str, Any]] | None], None]


def build_into(sink: PromptSink, sources: list[tuple[SourceSpec, int | None]], mode: str = "last_turn",
               seed: int = 0, length_check: LengthCheck | None = None, images: Images | None = None,
               fetch: Fetch | None = None) -> BuildResult:
    """Read every source, keep its valid prompts, dedup across sources in list order, then apply its limit.

    A limit (the run's override, else the spec's own) keeps the N prompts of lowest sha256(f"{seed}:{prompt_id}"),
    so the choice depends on content alone, not on the order of the file; they are passed on in that order. A
    source without a limit passes its prompts on in file order. The first source in the list keeps a prompt
    that several sources share, and a later source's limit counts only prompts the earlier ones lack. A source with no valid prompt raises NoValidPrompts."""
    check_mode(mode)
    names = [spec.name for spec, _ in sources]
    dup_names = sorted({n for n in names if names.count(n) > 1})
    if dup_names:
        raise ConfigError(f"source names must be unique; repeated: {', '.join(dup_names)}")
    limits = []
    for spec, override in sources:
        limit = override if override is not None else spec.limit
        if limit is not None and limit < 1:
            raise ConfigError(f"source {spec.name!r}: limit must be at least 1, got {limit}")
        limits.append(limit)

    held: set[str] = set()  # prompt_ids in the set so far, across sources
    reader = ImageReader(images, fetch, getattr(sink, "add_image", None) or _cannot_store_images)
    result = BuildResult([], 0, 0)
    for (spec, _), limit in zip(sources, limits):
        report = SourceReport(spec.name)

        def emit(prompt: Prompt) -> None:
            if prompt.prompt_id in held:
                report.duplicates += 1
                return
            held.add(prompt.prompt_id)
            sink.add_prompt(prompt)
            report.selected += 1
            _selected(report, prompt)

        def offer(prompt: Prompt) -> None:
            if prompt.prompt_id in held:  # an earlier source's: the limit counts only what this one adds
                report.duplicates += 1
                return
            selection.offer(rank(seed, prompt.prompt_id), prompt)

        selection = BoundedSelection(limit, _encode, _decode) if limit is not None else None
        try:
            _read_source(spec, mode, report, sink, length_check, emit if selection is None else offer, reader)
            if report.valid == 0:
                raise NoValidPrompts(spec.name, report.read, report.top_reasons())
            for prompt in selection.selected() if selection is not None else ():
                emit(prompt)
        finally:
            if selection is not None:
                selection.close()
        result.duplicates += report.duplicates
        result.prompts += report.selected
        result.reports.append(report)
    return result


def _read_source(spec: SourceSpec, mode: str, report: SourceReport, sink: PromptSink,
                 length_check: LengthCheck | None, keep: Callable[[Prompt], None], reader: ImageReader) -> None:
    """Each valid prompt of one source, first occurrence only, to `keep`; rejects to the sink."""
    seen: set[str] = set()
    stats = ReadStats()
    folders: dict[Path | None, Path | None] = {}  # data file -> its image folder
    for rec in read_records(spec, stats):
        report.read += 1
        if isinstance(rec, Reject):
            report.reject(rec.code, rec.reason)
            sink.add_reject(rec)
            continue
        tally = Tally()
        try:
            raw, tools = to_conversation(spec, rec.data, tally)
            norm = normalise_record(raw, tools, mode, tally)
            if tally.images:  # content parts: maybe images to read
                if stats.file not in folders:
                    folders[stats.file] = image_folder(spec, stats.file)
                norm = replace(norm, messages=reader.resolve(norm.messages, folders[stats.file], tally))
            if length_check is not None:
                length_check(norm.messages, list(norm.tools) if norm.tools else None)
        except InvalidRecord as e:
            reason = e.reason_of(rec.origin)
            report.reject(e.code.value, reason)
            sink.add_reject(Reject(spec.name, rec.origin, reason, _raw_text(rec.data), e.code.value))
            continue
        report.valid += 1
        uncarried = _uncarried(tally) if tally.uncarried or tally.tool_like or tally.transcripts else ()
        report.count(tally)
        pid = prompt_id(norm.messages, mode, norm.tools)
        if pid in seen:
            report.duplicates += 1
            continue
        seen.add(pid)
        keep(Prompt(pid, spec.name, norm.messages, norm.reference, rec.origin, source_ref(spec, rec.data),
                    norm.tools, norm.reference_tool_calls, uncarried))
    report.rejected = report.read - report.valid
    report.nul_removed += stats.nul_bytes_removed
    report.containers = dict(stats.containers)
    report.cuts = [cut.as_dict() for cut in stats.cuts]


def _cannot_store_images(sha256: str, source: str | bytes) -> None:
    raise ConfigError(f"the sources hold images (the first: sha256 {sha256}), and this prompt set cannot store "
                      "them (its sink has no add_image)")


def image_folder(spec: SourceSpec, data_file: Path | None) -> Path | None:
    """The source's image folder for records of `data_file`; SourceError when its `image_root` is no folder."""
    folder = spec.image_folder(data_file)
    problem = check_folder(folder)
    if problem is not None:
        raise SourceError(spec.name, problem, "set the spec's `image_root` to the folder its images are in")
    return folder


def build_prompt_set(sources: list[tuple[SourceSpec, int | None]], mode: str = "last_turn", seed: int = 0,
                     length_check: LengthCheck | None = None, images: Images | None = None,
                     fetch: Fetch | None = None) -> PromptSet:
    """The whole set in memory: for tests and dry runs. A run streams through `build_into`."""
    out = PromptSet()
    result = build_into(out, sources, mode, seed, length_check, images, fetch)
    out.reports, out.duplicates = result.reports, result.duplicates
    return out
