"""`regen validate`: read the first records of a source and say what they are, so that a wrong `kind`, `format`
or `field` shows before a run. A hub dataset is streamed for this, never downloaded whole."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ..core.config_sections import Images
from .adapters import to_conversation
from .census import ImageCensus
from .images import ImageReader
from .presets import Preset, recognise
from .prompt_set import image_folder, normalise_record
from .errors import NoValidPrompts, SourceError, TruncatedSource
from .records import InvalidRecord, RawRecord, Reject, Tally
from .report import SourceReport, transcript_line, uncarried_tools_line
from .schema_dialect import SCHEMA_KINDS
from .sources import BOM, ReadStats, SourceSpec, read_file, read_records, resolve_files
from .transcript import transcript_markers

PROBE_RECORDS = 20


@dataclass
class Probe:
    spec: SourceSpec
    read: int = 0
    valid: int = 0
    rejected: Counter = field(default_factory=Counter)
    keys: Counter = field(default_factory=Counter)  # top-level keys of the records
    containers: dict[str, str] = field(default_factory=dict)
    looks_like: tuple[str, str] | None = None  # (format, conversation field) the records seem to be
    presets: Counter = field(default_factory=Counter)  # the preset each of the first records looks like
    warnings: list[str] = field(default_factory=list)
    images: Counter = field(default_factory=Counter)  # the image counts of the valid first records (report.py's)
    # the first records all rejected: the rest was read, and none is valid (as `regen generate` refuses it)
    no_valid: NoValidPrompts | None = None
    # a file cut short without `salvage: true`: read to its end, as `regen generate` refuses it
    truncated: TruncatedSource | None = None
    census: ImageCensus = field(default_factory=ImageCensus)  # distinct images, formats, image rejects
    tool_like: Counter = field(default_factory=Counter)  # fields not carried that look like tool schemas -> records
    schemas: Counter = field(default_factory=Counter)  # tool schemas not JSON Schema (schema_dialect.py), by kind
    uncarried: Counter = field(default_factory=Counter)  # fields of the valid records not carried, by name
    transcripts: Counter = field(default_factory=Counter)  # one-prompt fields holding a whole conversation -> records
    markers: dict[str, tuple[str, str]] = field(default_factory=dict)  # such a field -> the markers first seen

    def lines(self) -> list[str]:
        seen = "; ".join(f"{name}: {what}" for name, what in self.containers.items()) or "nothing"
        out = [f"  reads as {seen}"]
        summary = f"  first {self.read} records: {self.valid} valid"
        if self.rejected:
            summary += ", rejected " + ", ".join(f"{code} {n}" for code, n in self.rejected.most_common())
        if self.keys:
            summary += f"; keys {', '.join(k for k, _ in self.keys.most_common(8))}"
        if self.looks_like:
            summary += f"; they look like {self.looks_like[0]} (field {self.looks_like[1]!r})"
        out.append(summary)
        if self.uncarried:  # as generate's report counts them ("fields not carried")
            out.append("  fields not carried: " + ", ".join(f"{k} {n}" for k, n in sorted(self.uncarried.items()))
                       + " (`ignore_fields` for a top-level one that does not shape the prompt)")
        if self.images:
            out.append(f"  images: {self.images['images']:,} read in {self.images['prompts_with_images']:,} prompts, "
                       f"{self.images['image_bytes']:,} bytes" + (
                           f"; {self.images['from_http']:,} http(s) images not fetched (validate contacts nothing)"
                           if self.images["from_http"] else ""))
        out += self.census.lines()
        out += [f"  warning: {w}" for w in self.warnings]
        return out


def probe_source(spec: SourceSpec, records: int = PROBE_RECORDS, images: Images | None = None) -> Probe:
    """Raises SourceError when the source cannot be read at all. Images are read and checked under `images` (the
    run's settings), as generate reads them, but http(s) ones are not fetched and nothing is copied."""
    probe = Probe(spec)
    stats = ReadStats()
    report = SourceReport(spec.name)  # every record read, for a source with no valid one
    reader = read_records(spec, stats, stream_hub=True)
    valid = _Checker(spec, stats, ImageReader(images, unfetched_stand_in=True))
    try:
        for rec in itertools.islice(reader, records):
            probe.read += 1
            probe.valid += valid(rec, report, probe)
        if probe.read and not probe.valid:  # would the whole source give no prompt? Read on until one is valid
            try:
                found = any(valid(rec, report) for rec in reader)
            except SourceError:  # further on it cannot be read: the probe's lines and warnings say enough
                found = True
            if not found:
                probe.no_valid = NoValidPrompts(spec.name, report.read, report.top_reasons())
    finally:
        reader.close()
    probe.containers = dict(stats.containers)
    _check(probe)
    return probe


@dataclass
class _Checker:
    spec: SourceSpec
    stats: ReadStats
    images: ImageReader

    def __call__(self, rec: Reject | RawRecord, report: SourceReport, probe: Probe | None = None) -> bool:
        """Is the record a prompt? Its reject is counted in `report` (and in the probe of the first records)."""
        report.read += 1
        if isinstance(rec, Reject):
            code, reason = rec.code, rec.reason
        else:
            if probe is not None and isinstance(rec.data, dict):
                probe.keys.update(rec.data.keys())
                probe.looks_like = probe.looks_like or guess_format(rec.data)
                preset = recognise(rec.data)
                if preset is not None:
                    probe.presets[preset] += 1
            tally = Tally()
            try:
                raw, tools = to_conversation(self.spec, rec.data, tally)
                norm = normalise_record(raw, tools, "last_turn", tally)
                if tally.images:  # content parts: maybe images to read
                    resolved = self.images.resolve(norm.messages, image_folder(self.spec, self.stats.file), tally)
                    if probe is not None:
                        probe.census.add(resolved)
                if probe is not None:
                    probe.images.update(tally.images)
                    probe.tool_like.update(tally.tool_like)
                    probe.uncarried.update(tally.uncarried)
                    probe.transcripts.update(tally.transcripts)
                    for key in tally.transcripts:
                        probe.markers.setdefault(key, transcript_markers(rec.data.get(key)))
                    probe.schemas.update({k: n for k, n in tally.tools.items() if k in SCHEMA_KINDS})
                return True
            except InvalidRecord as exc:
                code, reason = exc.code.value, exc.reason_of(rec.origin)
        report.reject(code, reason)
        if probe is not None:
            probe.rejected[code] += 1
            probe.census.reject(code)
        return False


def guess_format(data: dict[str, Any]) -> tuple[str, str] | None:
    if isinstance(data.get("question"), str) and isinstance(data.get("answer"), str):
        return "question_answer", "question"
    for key, value in data.items():
        if isinstance(data.get("output"), str) and isinstance(value, list) and value and isinstance(value[0], dict) \
                and "role" in value[0] and "content" in value[0]:
            return "input_output", key
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            if "from" in value[0] and "value" in value[0]:
                return "sharegpt", key
            if "role" in value[0] and "content" in value[0]:
                return "openai", key
    for fmt in ("instruction", "prompt"):
        if isinstance(data.get(fmt), str):
            return ("alpaca" if fmt == "instruction" else "prompt"), fmt
    return None


def _check(probe: Probe) -> None:
    spec = probe.spec
    if probe.read == 0:
        probe.warnings.append("no records at all")
    said = f"the spec says format {spec.format} with field {spec.conversation_field!r}"
    preset: Preset | None = probe.presets.most_common(1)[0][0] if probe.presets else None
    if preset is not None and (preset.format, preset.field) != (spec.format, spec.conversation_field):
        probe.warnings.append(f"{said}; these records look like {preset.name} ({preset.spec_file}): format "
                              f"{preset.format}, field {preset.field!r}")
    elif probe.looks_like and probe.valid < probe.read:
        fmt, key = probe.looks_like
        if (fmt, key) != (spec.format, spec.conversation_field):
            probe.warnings.append(f"{said}; the records look like {fmt} under {key!r}")
    if probe.keys and spec.conversation_field.split(".")[0] not in probe.keys:
        probe.warnings.append(f"no record has the field {spec.conversation_field!r} (set `field`)")
    for key, n in sorted(probe.tool_like.items()):
        probe.warnings.append(uncarried_tools_line(spec.name, key, n) + "; regen generate refuses the source until "
                              "one is said")
    for key, n in sorted(probe.transcripts.items()):
        probe.warnings.append(transcript_line(key, n, probe.markers.get(key), "of the first records"))
    if probe.schemas:
        counted = ", ".join(f"{kind} {n}" for kind, n in sorted(probe.schemas.items()))
        mapped = probe.schemas.get("schemas_mapped_from_bfcl")
        probe.warnings.append(f"tool schemas that are not JSON Schema: {counted} (tools of the first records). " + (
            "`schema_dialect: bfcl` maps them as BFCL does" if mapped else
            "They are sent as given: SGLang rewrites known type aliases (`dict`, `float`) and refuses a schema "
            "still invalid (a 400 for each prompt); `schema_dialect: bfcl` maps BFCL's dialect "
            "(docs/sources-tool-calls.md)") + (
            "; schemas_with_bare_properties (xlam's dialect: the arguments named in `parameters` without an object "
            "schema's `properties`) has no mapping: the target reads them as written, and SGLang refuses with a 400 "
            "each one with an argument named like a JSON Schema keyword (`type`, `format`, `required`)"
            if probe.schemas.get("schemas_with_bare_properties") else ""))
    for file, kind in _json_files(spec):
        if _ends_whole(file, kind, spec):
            continue
        if spec.salvage:
            probe.warnings.append(f"{spec.shown(file)} looks cut short: `salvage: true` keeps its complete records "
                                  "(the run names the cut)")
            continue
        try:  # the same reader generate uses, to the end of the file: it names the cut exactly
            for _ in read_file(spec, file, kind, ReadStats()):
                pass
        except TruncatedSource as exc:
            probe.truncated = probe.truncated or exc
        except SourceError:
            pass  # another problem further on: generate reports it; the probe says what it saw
        else:
            probe.warnings.append(f"{spec.shown(file)} does not end as a JSON document does, but reads to its end")


def _json_files(spec: SourceSpec) -> list[tuple[Path, str]]:
    """The local JSON and JSON Lines files of a source, with the reader each gets."""
    if spec.kind in ("json", "jsonl"):
        try:
            return [(file, spec.kind) for file in resolve_files(spec)]
        except SourceError:
            return []
    if spec.kind == "hf":
        from .hf import DATA_EXTENSIONS, own_reader_files
        from .jsonarray import json_lines

        out = []
        for file in own_reader_files(spec):
            kind = DATA_EXTENSIONS.get(file.suffix.lower())
            if kind == "json" and not spec.records_field and json_lines(file, spec.conversation_field):
                kind = "jsonl"
            if kind in ("json", "jsonl"):
                out.append((file, kind))
        return out
    return []


def _ends_whole(file: Path, kind: str, spec: SourceSpec) -> bool:
    """Does the file end as a whole document does? JSON: its closing bracket; JSON Lines: a newline, or a last
    line that parses. A cheap look at the tail; only a file that fails it is read to its end."""
    with file.open("rb") as fh:
        fh.seek(max(0, file.stat().st_size - 4096))
        tail = fh.read().removeprefix(BOM)
    if kind == "jsonl":
        if not tail.strip() or tail.endswith(b"\n"):
            return True
        try:
            orjson.loads(tail.rsplit(b"\n", 1)[-1])
        except orjson.JSONDecodeError:
            return False
        return True
    return tail.rstrip().endswith(b"}" if spec.records_field else b"]")


__all__ = ["Probe", "probe_source", "guess_format"]
