"""`regen export RUN_DIR --format F --out PATH`: training files from a run's committed parts.

Safety: only committed parts are read (`part-*.parquet`; a part being written has a `.tmp-` name), no
output id is ever emitted twice, and the output appears atomically (streamed to a temporary name in
the same directory, fsynced, renamed). `<out>.manifest.json` is written next to it.

Formats (row builders in formats.py):
    specforge         conversations JSONL (with `tools` and the steps' `tool_calls` where the run has them).
                      all_turns: one whole conversation per prompt, or with --per-turn one row per
                      assistant step; last_turn: per-turn rows only, because the history's assistant
                      turns were written by the source dataset.
    specforge-tokens  {"id", "input_ids", "loss_mask"}; needs token ids.
    speculators       speculators' regeneration rows; needs token ids.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from ..core.errors import ConfigError, StorageError
from ..store.goodput import FOLLOWS_DROPPED
from ..store.rundir import TMP_PREFIX, RunDir, atomic_write, now_utc
from ..store.storage import Location
from ..store.quality import lacks_content, whole_conversation_cut
from . import formats
from .formats import FLAGGED, SOURCE_NOT_SELECTED, TRUNCATED, Filters  # noqa: F401 (the record filter)
from .templates import CHAT_TEMPLATE_NOTE, template_advice

FORMATS = ("specforge", "specforge-tokens", "speculators")
TOKEN_FORMATS = ("specforge-tokens", "speculators")

# Why a record was not exported. Every record read lands in exactly one reason or is exported.
DUPLICATE = "duplicate"
EMPTY_CONTENT = "empty_content"
NO_TOKEN_IDS = "token_ids_unavailable"
FOLLOWS_DROPPED_TURN = FOLLOWS_DROPPED  # store/goodput.py counts these turns' tokens by the same name
HISTORY_NOT_TARGET = "history_not_target_written"
INVALID_CONVERSATION = "invalid_conversation"

TRAIN_ONLY_LAST_TURN_NOTE = ("train SpecForge with `data.train_only_last_turn: true` (under `data:` in the training "
                             "YAML, or the override data.train_only_last_turn=true; a top-level key is rejected): "
                             "each row's earlier assistant turns are history{why}, only its last assistant turn is a "
                             "training target")
TRUNCATED_MASK_NOTE = ("records cut at max_tokens keep their ids as generated, and their last position has loss_mask "
                       "0: no library trains an end-of-turn there that the model never generated")


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

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count

    def counts(self) -> dict[str, Any]:
        return {"records_read": self.records_read, "records_exported": self.records_exported,
                "rows_written": self.rows_written, "masked_truncated": self.masked_truncated, "dropped": dict(sorted(self.dropped.items()))}

    def table(self) -> str:
        lines = [f"export {self.format} ({self.mode} run) -> {self.out}",
                 f"  {'records read':<36}{self.records_read:>10}",
                 f"  {'records exported':<36}{self.records_exported:>10}",
                 f"  {'rows written':<36}{self.rows_written:>10}"]
        lines += [f"  {'dropped: ' + reason:<36}{count:>10}" for reason, count in sorted(self.dropped.items())]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# --- reading ---------------------------------------------------------------------------------------
def read_run_manifest(run_dir: RunDir) -> dict[str, Any]:
    if not run_dir.exists():
        raise NotARunDirectory(f"{run_dir.path} is not a run directory (no run.json)")
    return run_dir.read_manifest()


def committed_part_records(run_dir: RunDir) -> Iterator[list[dict[str, Any]]]:
    """The records of each committed part, one part at a time (an all_turns conversation is never
    split across parts). Columns a part written by older code lacks read as None."""
    for part in RunDir.parts(run_dir.data):
        yield part.read_parquet().to_pylist()


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

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.with_name(f"{TMP_PREFIX}{out.name}.{uuid.uuid4().hex[:8]}")
        self.ids: set[str] = set()
        self._handle = None

    def __enter__(self) -> "AtomicJsonlWriter":
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.tmp, "wb")
        except OSError as exc:
            raise StorageError(f"cannot write {self.out}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        return self

    def write(self, row: dict[str, Any]) -> bool:
        """Write one row unless its id was already written."""
        if row["id"] in self.ids:
            return False
        self.ids.add(row["id"])
        try:
            self._handle.write(orjson.dumps(row) + b"\n")
        except OSError as exc:
            raise StorageError(f"cannot write {self.out}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        return True

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
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


# --- the export ------------------------------------------------------------------------------------
class _Exporter:
    def __init__(self, fmt: str, mode: str, sampling: dict[str, Any], filters: Filters, per_turn: bool,
                 writer: AtomicJsonlWriter, summary: ExportSummary, reasoning_history: str = "current_turn"):
        self.fmt, self.mode, self.sampling, self.filters = fmt, mode, sampling, filters
        # all_turns: the reasoning that went back with the target's tool-calling steps (the run's setting)
        self.reasoning_history = reasoning_history if mode == "all_turns" else "none"
        self.per_turn = per_turn or mode != "all_turns"  # last_turn: per-turn rows only
        self.writer, self.summary = writer, summary
        self.seen: set[tuple[str, int]] = set()

    def _is_duplicate(self, record: dict[str, Any]) -> bool:
        key = (formats.conversation_id(record), record["turn_index"])
        if key in self.seen:
            self.summary.drop(DUPLICATE)
            return True
        self.seen.add(key)
        return False

    def _reason_to_drop(self, record: dict[str, Any]) -> str | None:
        """The user's filters, then the format's own needs."""
        reason = self.filters.reason_to_drop(record)
        if reason is None and self.fmt == "specforge" and lacks_content(record):
            reason = EMPTY_CONTENT  # SpecForge needs non-empty content (or, for a tool-calling step, its calls)
        if reason is None and self.fmt in TOKEN_FORMATS and not formats.has_token_ids(record):
            reason = NO_TOKEN_IDS
        return reason

    def _keep(self, record: dict[str, Any]) -> bool:
        if self._is_duplicate(record):
            return False
        reason = self._reason_to_drop(record)
        if reason is not None:
            self.summary.drop(reason)
        return reason is None

    def _emit(self, row: dict[str, Any], n_records: int) -> None:
        if self.fmt == "specforge" and formats.validate_specforge_row(row):
            self.summary.drop(INVALID_CONVERSATION, n_records)
        elif self.writer.write(row):
            self.summary.rows_written += 1
            self.summary.records_exported += n_records
        else:
            self.summary.drop(DUPLICATE, n_records)

    def add_part(self, records: list[dict[str, Any]]) -> None:
        self.summary.records_read += len(records)
        if self.fmt == "specforge" and not self.per_turn:
            for turns in conversations_in(records):
                self._whole_conversation(turns)
            return
        reasoning = {(formats.conversation_id(r), r["turn_index"]): r.get("reasoning_content") for r in records} \
            if self.reasoning_history != "none" else {}
        for record in records:
            if not self._keep(record):
                continue
            if self.fmt == "specforge":
                if self.reasoning_history == "none":
                    self._emit(formats.specforge_per_turn_row(record), 1)
                else:
                    pid = formats.conversation_id(record)
                    self._emit(formats.specforge_per_turn_row(record, lambda j: reasoning.get((pid, j)),
                                                              self.reasoning_history), 1)
            elif self.fmt == "specforge-tokens":
                self._emit(formats.specforge_tokens_row(record), 1)
            else:
                self._emit(formats.speculators_row(record, self.sampling), 1)
            if self.fmt in TOKEN_FORMATS and formats.is_truncated(record):
                self.summary.masked_truncated += 1

    def _whole_conversation(self, turns: list[dict[str, Any]]) -> None:
        """Cut the conversation before its first dropped or missing turn: later turns' histories hold it."""
        unique = [record for record in turns if not self._is_duplicate(record)]
        n_kept, reason = whole_conversation_cut(unique, self._reason_to_drop)
        kept, followers = unique[:n_kept], len(unique) - n_kept
        if reason is not None:
            self.summary.drop(reason)
            followers -= 1
        if followers:
            self.summary.drop(FOLLOWS_DROPPED_TURN, followers)
        if not kept:
            return
        try:
            row = formats.specforge_conversation_row(kept)
        except formats.HistoryMismatch:
            self.summary.drop(HISTORY_NOT_TARGET, len(kept))
            return
        self._emit(row, len(kept))


def _settings(last_turn: bool) -> dict[str, Any]:
    """SpecForge's own keys: `train_only_last_turn` is a DataConfig field (specforge/config/schema.py)."""
    value = "true" if last_turn else "false"
    return {"data": {"train_only_last_turn": last_turn}, "overrides": [f"data.train_only_last_turn={value}"]}


def _notes_and_settings(fmt: str, mode: str, per_turn: bool, model: str = "") -> tuple[list[str], dict[str, Any]]:
    if fmt == "specforge":
        notes, settings = _specforge_notes_and_settings(mode, per_turn)
        return notes + [f"chat template: {template_advice(model)['specforge']}"], settings
    return ([f"{fmt}: loss_mask is 1 exactly on the tokens the target generated (tool calls included); the prompt "
             "(including any source-written history and every tool result) is masked out", TRUNCATED_MASK_NOTE], {})


def _specforge_notes_and_settings(mode: str, per_turn: bool) -> tuple[list[str], dict[str, Any]]:
    if mode != "all_turns":
        why = " written by the source dataset (last_turn run)"
        return [TRAIN_ONLY_LAST_TURN_NOTE.format(why=why), CHAT_TEMPLATE_NOTE], _settings(True)
    if per_turn:
        return [TRAIN_ONLY_LAST_TURN_NOTE.format(why=" (per-turn rows)"), CHAT_TEMPLATE_NOTE], _settings(True)
    return (["whole all_turns conversations: every assistant turn is target-written and trainable",
             CHAT_TEMPLATE_NOTE], _settings(False))


def export_run(run_dir: str | Path | Location, fmt: str, out: Path, *, drop_truncated: bool = False, drop_flagged: bool = False,
               sources: list[str] | None = None, per_turn: bool = False, keep_truncated: bool = False) -> ExportSummary:
    """`keep_truncated`: the conversation export keeps records cut at max_tokens (dropped by default: SpecForge
    would close them with a trainable end-of-turn token the model never generated)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "specforge" and not keep_truncated:
        drop_truncated = True
    run = RunDir(run_dir)
    manifest = read_run_manifest(run)
    generation = manifest.get("generation") or {}
    mode = generation.get("mode", "last_turn")
    out = Path(out)
    filters = Filters(drop_truncated, drop_flagged, frozenset(sources) if sources else None)
    notes, settings = _notes_and_settings(fmt, mode, per_turn, generation.get("model") or "")
    summary = ExportSummary(format=fmt, mode=mode, out=out, notes=notes, specforge_settings=settings)
    with AtomicJsonlWriter(out) as writer:
        exporter = _Exporter(fmt, mode, generation.get("sampling") or {}, filters, per_turn, writer, summary,
                             generation.get("tool_reasoning_history", "current_turn"))
        for records in committed_part_records(run):
            exporter.add_part(records)
    atomic_write(manifest_path(out), orjson.dumps({
        "format": fmt,
        "out": out.name,
        "run_dir": str(run.path),
        "run_fingerprint": manifest.get("fingerprint"),
        "schema_version": manifest.get("schema_version"),
        "model": generation.get("model"),
        "mode": mode,
        "per_turn": fmt == "specforge" and exporter.per_turn,
        "filters": filters.as_dict(),
        "counts": summary.counts(),
        "notes": summary.notes,
        "specforge_settings": summary.specforge_settings,
        "chat_template": template_advice(generation.get("model") or "") if fmt == "specforge" else None,
        "created_at": now_utc().isoformat(timespec="seconds"),
    }, option=orjson.OPT_INDENT_2))
    return summary


# --- CLI (wired as `regen export`) -----------------------------------------------------------------
HIDDEN_FORMATS = ("specforge-offline", "speculators-hidden")  # export/hidden.py


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (outputs/<run>, or an s3:// or gs:// URI)")
    parser.add_argument("--format", required=True, choices=FORMATS + HIDDEN_FORMATS, dest="format",
                        help="JSONL training rows, or hidden-state files: specforge-offline (one torch file per "
                             "sample; needs torch) and speculators-hidden (hs_{idx}.safetensors)")
    parser.add_argument("--out", required=True,
                        help="output JSONL path (written atomically), or a directory for the hidden-state formats")
    parser.add_argument("--per-turn", action="store_true",
                        help="specforge, all_turns runs: one row per assistant turn instead of whole conversations")
    parser.add_argument("--drop-truncated", action="store_true", help="drop records that hit max_tokens")
    parser.add_argument("--keep-truncated", action="store_true",
                        help="specforge: keep records that hit max_tokens (dropped by default: SpecForge would train "
                             "an end-of-turn token the model never generated)")
    parser.add_argument("--speculators-data", metavar="DIR",
                        help="speculators-hidden: a folder made by `speculators prepare-data`; hs_{i} files go into "
                             "its hidden_states/ in its row order")
    parser.add_argument("--drop-flagged", action="store_true", help="drop records with any quality flag")
    parser.add_argument("--source", action="append", dest="sources", metavar="NAME",
                        help="keep only records of this source (repeatable)")


def local_out(out: str) -> Path:
    """Exports are read by a trainer from local or shared disk; the run itself may be on an object store."""
    if "://" in out:
        raise ConfigError(f"--out {out}: exports are written to a local or shared path (copy them up afterwards)")
    return Path(out)


def run_export(args: argparse.Namespace) -> int:
    if args.format in HIDDEN_FORMATS:
        from .hidden import export_hidden

        if args.keep_truncated or args.per_turn:
            raise ConfigError(f"--format {args.format}: --keep-truncated and --per-turn are for the JSONL formats "
                              "(a hidden-state export keeps truncated samples with their last position masked)")
        filters = Filters(args.drop_truncated, args.drop_flagged, frozenset(args.sources) if args.sources else None)
        result = export_hidden(args.run_dir, args.format, local_out(args.out), args.speculators_data, filters)
        for note in result.get("notes", []):
            print(f"regen: {note}", file=sys.stderr)
        for reason, count in sorted(result.get("dropped", {}).items()):
            print(f"regen: dropped ({reason}): {count}", file=sys.stderr)
        print(f"regen: {args.format}: {result['samples']} samples in {result['out']} "
              f"(manifest.json says which layers and which norm convention)", file=sys.stderr)
        return 0
    summary = export_run(args.run_dir, args.format, local_out(args.out), drop_truncated=args.drop_truncated,
                         drop_flagged=args.drop_flagged, sources=args.sources, per_turn=args.per_turn,
                         keep_truncated=args.keep_truncated)
    print(summary.table(), file=sys.stderr)
    return 0
