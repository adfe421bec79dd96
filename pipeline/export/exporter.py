"""One JSONL export's pass over a run's committed records: which record becomes which row, and why each record that
does not is not exported. Every record read lands in exactly one reason or is exported (export/jsonl.py runs it).

Image records (a message with an image part, core/images.py):
- `specforge`, `specforge-tokens`: not exported (`image_prompt`): SpecForge 0.2.0 takes no images
  (`specforge/inference/media.py`: "The current runtime does not support VLM training or media rollout inputs"),
  and the token ids of an image prompt without its pixels train nothing the target computed.
- `speculators`: natural-language conversations in a second file (export/speculators_images.py); text records stay
  pre-tokenized rows.
- `torchspec`: rows like any other, their image parts as TorchSpec takes them (export/torchspec.py).
"""
from __future__ import annotations

from typing import Any

from ..store.goodput import FOLLOWS_DROPPED
from ..store.quality import lacks_content, whole_conversation_cut
from . import formats
from .formats import Filters
from .messages import ImagePaths, record_has_images
from .speculators_images import history_has_assistant, speculators_image_row
from .torchspec import torchspec_row
from .writer import AtomicJsonlWriter, ExportSummary, conversations_in

# Why a record was not exported (the record filter's reasons are formats.py's).
DUPLICATE = "duplicate"
EMPTY_CONTENT = "empty_content"
NO_TOKEN_IDS = "token_ids_unavailable"
FOLLOWS_DROPPED_TURN = FOLLOWS_DROPPED  # store/goodput.py counts these turns' tokens by the same name
HISTORY_NOT_TARGET = "history_not_target_written"
INVALID_CONVERSATION = "invalid_conversation"
IMAGE_PROMPT = "image_prompt"  # specforge, specforge-tokens: SpecForge takes no images

TOKEN_FORMATS = ("specforge-tokens", "speculators")
CONVERSATION_FORMATS = ("specforge", "torchspec")  # rendered by the trainer: a reply needs content or calls
NO_IMAGES = ("specforge", "specforge-tokens")


class Exporter:
    def __init__(self, fmt: str, mode: str, sampling: dict[str, Any], filters: Filters, per_turn: bool,
                 writer: AtomicJsonlWriter, summary: ExportSummary, reasoning_history: str = "current_turn",
                 paths: ImagePaths | None = None, images: AtomicJsonlWriter | None = None):
        self.fmt, self.mode, self.sampling, self.filters = fmt, mode, sampling, filters
        # all_turns: the reasoning that went back with the target's tool-calling steps (the run's setting)
        self.reasoning_history = reasoning_history if mode == "all_turns" else "none"
        self.per_turn = per_turn or mode != "all_turns"  # last_turn: per-turn rows only
        self.writer, self.summary = writer, summary
        self.paths, self.images = paths, images  # speculators: the image conversations' own file
        # speculators' image rows are rendered, every turn closed: a cut reply is never one of them
        self.image_filters = Filters(True, filters.drop_flagged, filters.sources)
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
        if reason is None and self.fmt in NO_IMAGES and record_has_images(record):
            reason = IMAGE_PROMPT
        if reason is None and self.fmt in CONVERSATION_FORMATS and lacks_content(record):
            reason = EMPTY_CONTENT  # a renderer needs non-empty content (or, for a tool-calling step, its calls)
        if reason is None and self.fmt in TOKEN_FORMATS and not formats.has_token_ids(record):
            reason = NO_TOKEN_IDS
        return reason

    def _image_reason_to_drop(self, record: dict[str, Any]) -> str | None:
        reason = self.image_filters.reason_to_drop(record)
        if reason is None and lacks_content(record):
            reason = EMPTY_CONTENT
        return reason

    def _keep(self, record: dict[str, Any]) -> bool:
        if self._is_duplicate(record):
            return False
        reason = self._reason_to_drop(record)
        if reason is not None:
            self.summary.drop(reason)
        return reason is None

    def _emit(self, row: dict[str, Any], n_records: int, writer: AtomicJsonlWriter | None = None) -> None:
        if self.fmt == "specforge" and formats.validate_specforge_row(row):
            self.summary.drop(INVALID_CONVERSATION, n_records)
        elif (writer or self.writer).write(row):
            self.summary.rows_written += 1
            self.summary.records_exported += n_records
            self.summary.image_rows += writer is not None
        else:
            self.summary.drop(DUPLICATE, n_records)

    def add_part(self, records: list[dict[str, Any]]) -> None:
        self.summary.records_read += len(records)
        if self.fmt == "speculators":
            # all_turns: a conversation is an image conversation, whole, if any of its turns has an image
            units = {formats.conversation_id(r) for r in records if record_has_images(r)}
            is_image = (lambda r: formats.conversation_id(r) in units) if self.mode == "all_turns" \
                else record_has_images
            if units:
                self._speculators_images([r for r in records if is_image(r)])
                records = [r for r in records if not is_image(r)]
        if self.fmt == "specforge" and not self.per_turn:
            for turns in conversations_in(records):
                self._whole_conversation(turns)
            return
        reasoning = {(formats.conversation_id(r), r["turn_index"]): r.get("reasoning_content") for r in records} \
            if self.reasoning_history != "none" else {}
        for record in records:
            if not self._keep(record):
                continue
            pid = formats.conversation_id(record)
            reasoning_of = (lambda j, pid=pid: reasoning.get((pid, j))) if reasoning else None
            if self.fmt == "specforge":
                self._emit(formats.specforge_per_turn_row(record, reasoning_of, self.reasoning_history)
                           if reasoning_of else formats.specforge_per_turn_row(record), 1)
            elif self.fmt == "torchspec":
                self._emit(torchspec_row(record, self.paths, record.get("source_ref"), reasoning_of,
                                         self.reasoning_history), 1)
            elif self.fmt == "specforge-tokens":
                self._emit(formats.specforge_tokens_row(record), 1)
            else:
                self._emit(formats.speculators_row(record, self.sampling), 1)
            if self.fmt in TOKEN_FORMATS and formats.is_truncated(record):
                self.summary.masked_truncated += 1

    def _cut(self, turns: list[dict[str, Any]], reason_to_drop) -> list[dict[str, Any]]:
        """The conversation's turns before its first dropped or missing one (later turns' histories hold it);
        each turn not kept is counted."""
        unique = [record for record in turns if not self._is_duplicate(record)]
        n_kept, reason = whole_conversation_cut(unique, reason_to_drop)
        followers = len(unique) - n_kept
        if reason is not None:
            self.summary.drop(reason)
            followers -= 1
        if followers:
            self.summary.drop(FOLLOWS_DROPPED_TURN, followers)
        return unique[:n_kept]

    def _whole_conversation(self, turns: list[dict[str, Any]]) -> None:
        if any(record_has_images(r) for r in turns):  # every turn of it, not only the first with an image
            unique = [record for record in turns if not self._is_duplicate(record)]
            if unique:
                self.summary.drop(IMAGE_PROMPT, len(unique))
            return
        kept = self._cut(turns, self._reason_to_drop)
        if not kept:
            return
        try:
            row = formats.specforge_conversation_row(kept)
        except formats.HistoryMismatch:
            self.summary.drop(HISTORY_NOT_TARGET, len(kept))
            return
        self._emit({**row, "source_ref": kept[-1].get("source_ref")}, len(kept))

    def _speculators_images(self, records: list[dict[str, Any]]) -> None:
        """all_turns: each conversation whole (speculators trains every assistant turn of a row once); last_turn:
        each record alone, if no source-written assistant turn is in its history."""
        for turns in conversations_in(records):
            if self.mode == "all_turns":
                kept = self._cut(turns, self._image_reason_to_drop)
            else:
                kept = []
                for record in turns:
                    if self._is_duplicate(record):
                        continue
                    reason = self._image_reason_to_drop(record) or (
                        HISTORY_NOT_TARGET if history_has_assistant(record) else None)
                    if reason:
                        self.summary.drop(reason)
                    else:
                        self._image_row([record])
                continue
            if kept:
                self._image_row(kept)

    def _image_row(self, turns: list[dict[str, Any]]) -> None:
        try:
            row = speculators_image_row(turns, self.paths, turns[-1].get("source_ref"))
        except formats.HistoryMismatch:
            self.summary.drop(HISTORY_NOT_TARGET, len(turns))
            return
        self._emit(row, len(turns), self.images)
