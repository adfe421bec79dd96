"""Goodput: every token the fleet generated, by what became of it. Pure: no Ray, no HTTP.

Purposes, each a count of completion tokens (and of the records or copies that carried them):
    training            committed, kept by the default export (store/quality.py default_export_drop), no flag
    flagged             committed and kept by the default export, but with a quality flag (repetition,
                        leaked_think): `--drop-flagged` drops them
    truncated_thinking  committed, dropped by the default export: cut at max_tokens inside the thinking
    truncated           committed, dropped by the default export: cut at max_tokens in the answer
    empty               committed, dropped by the default export: no answer text
    follows_dropped_or_missing_turn
                        all_turns: committed, but after a dropped (or missing) turn of its conversation: the
                        default export writes whole conversations and cuts each before its first dropped turn
                        (the later turns' history holds it), as `regen export` names them
    duplicate           a hedged or re-sent copy whose answer came after the prompt was finished (measured)
    hedge_cancelled     a hedged copy still running when the run ended: its actor was ended, it reported no
                        tokens, so its tokens are ESTIMATED (the mean tokens of a prompt, times the share of a
                        prompt's mean latency it ran)
    retry               turns generated before a later turn of the same prompt failed (all_turns), thrown away
                        because the prompt is run again whole (measured)
    failed              turns generated for a prompt that then failed for good (measured)

A failed HTTP attempt reports no usage (the server's error carries none): its tokens, if any, are not counted.
"Became training data" is training + flagged: what the default export writes.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import orjson

from ..core.work import record_unit
from .quality import QUALITY_FLAGS, TRUNCATED, default_export_drop, whole_conversation_cut

TRAINING, FLAGGED = "training", "flagged"
FOLLOWS_DROPPED = "follows_dropped_or_missing_turn"
DUPLICATE, HEDGE_CANCELLED, RETRY, FAILED = "duplicate", "hedge_cancelled", "retry", "failed"
COMMITTED = (TRAINING, FLAGGED, "truncated_thinking", TRUNCATED, "empty", FOLLOWS_DROPPED)
THROWN_AWAY = (DUPLICATE, HEDGE_CANCELLED, RETRY, FAILED)
PURPOSES = COMMITTED + THROWN_AWAY
ESTIMATED = (HEDGE_CANCELLED,)
KEPT = (TRAINING, FLAGGED)  # what the default export writes


def purpose_of(record: dict[str, Any]) -> str:
    """The purpose a committed record's tokens served (see the module doc)."""
    dropped = default_export_drop(record)
    if dropped is not None:
        return dropped
    return FLAGGED if any(flag in QUALITY_FLAGS for flag in record.get("flags") or []) else TRAINING


def purposes(rows: Iterable[dict[str, Any]], whole_conversations: bool) -> Iterable[tuple[dict[str, Any], str]]:
    """Each committed record with its purpose. `whole_conversations` (all_turns runs: the default export writes
    whole conversations): `rows` hold every turn of their prompts (a part does), and the turns after a
    conversation's first dropped or missing one are `follows_dropped_or_missing_turn`."""
    if not whole_conversations:
        for row in rows:
            yield row, purpose_of(row)
        return
    conversations: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        conversations[record_unit(row)].append(row)  # each sample of a prompt is a conversation
    for turns in conversations.values():
        turns.sort(key=lambda r: r["turn_index"] or 0)
        kept, reason = whole_conversation_cut(turns, default_export_drop)
        for position, row in enumerate(turns):
            yield row, (purpose_of(row) if position < kept or (position == kept and reason is not None)
                        else FOLLOWS_DROPPED)


@dataclass
class Goodput:
    tokens: Counter = field(default_factory=Counter)  # purpose -> completion tokens
    items: Counter = field(default_factory=Counter)  # purpose -> records (committed) or copies (thrown away)

    def add_records(self, rows: Iterable[dict[str, Any]], whole_conversations: bool = False) -> None:
        """Committed records (`whole_conversations`: see `purposes`)."""
        for row, purpose in purposes(rows, whole_conversations):
            self.add(purpose, row.get("completion_tokens") or 0)

    def add(self, purpose: str, tokens: int, items: int = 1) -> None:
        self.tokens[purpose] += int(tokens)
        self.items[purpose] += items

    def __add__(self, other: "Goodput") -> "Goodput":
        return Goodput(self.tokens + other.tokens, self.items + other.items)

    def generated(self) -> int:
        return sum(self.tokens.values())

    def kept(self) -> int:
        return sum(self.tokens[p] for p in KEPT)

    def share(self) -> float | None:
        """The share of generated tokens that became training data (None: nothing generated yet)."""
        generated = self.generated()
        return self.kept() / generated if generated else None

    def as_dict(self) -> dict[str, Any]:
        share = self.share()
        return {"generated_tokens": self.generated(), "training_tokens": self.kept(),
                "share": None if share is None else round(share, 4),
                "tokens": {p: self.tokens[p] for p in PURPOSES}, "items": {p: self.items[p] for p in PURPOSES},
                "estimated": list(ESTIMATED)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None) -> "Goodput":
        doc = doc or {}
        return cls(Counter({p: int(v) for p, v in (doc.get("tokens") or {}).items() if v}),
                   Counter({p: int(v) for p, v in (doc.get("items") or {}).items() if v}))


def summary_line(doc: dict[str, Any] | None) -> str:
    """`goodput 63.0% of 12,345 generated tokens became training data (thrown away: truncated 3,000, ...)`."""
    if not doc or not doc.get("generated_tokens"):
        return "goodput: no tokens generated yet"
    tokens = doc.get("tokens") or {}
    lost = [f"{p} {tokens[p]:,}{' (estimated)' if p in ESTIMATED else ''}" for p in PURPOSES
            if p not in KEPT and tokens.get(p)]
    flagged = f"; {tokens[FLAGGED]:,} of them flagged" if tokens.get(FLAGGED) else ""
    return (f"goodput {100 * doc['share']:.1f}% of {doc['generated_tokens']:,} generated tokens became training "
            f"data{flagged} (not: {', '.join(lost) or 'none'})")


# --- the counts of committed records survive a kill: each records part carries its own (store/committer.py) ----
FOOTER_KEY = b"regen.goodput"  # a records part's Parquet key-value metadata: its records' tokens and counts by purpose


def part_footer(rows: list[dict[str, Any]], whole_conversations: bool = False) -> dict[bytes, bytes]:
    """The footer metadata of a records part: its rows' goodput, committed with them (never a file written after)."""
    tally = Goodput()
    tally.add_records(rows, whole_conversations)
    doc = {"tokens": {p: tally.tokens[p] for p in COMMITTED if tally.items[p]},
           "items": {p: tally.items[p] for p in COMMITTED if tally.items[p]}}
    return {FOOTER_KEY: orjson.dumps(doc)}


def footer_goodput(metadata: dict[bytes, bytes] | None) -> "Goodput | None":
    """A part's own goodput from its footer; None: a part written before parts carried it."""
    raw = (metadata or {}).get(FOOTER_KEY)
    return None if raw is None else Goodput.from_dict(orjson.loads(raw))


def resumed_goodput(parts_metadata: Iterable[dict[bytes, bytes] | None], status: dict[str, Any] | None) -> "Goodput":
    """The goodput of a run's earlier sessions, for a resume: the committed purposes summed from the records parts'
    footers (so a SIGKILL between a commit and the next status.json loses none), the thrown-away purposes from
    status.json (tokens that left no record: a kill loses those since its last status write). A run with a part
    written before parts carried their counts takes status.json's counts whole, as before."""
    before = Goodput.from_dict((status or {}).get("goodput"))
    summed = Goodput()
    for metadata in parts_metadata:
        own = footer_goodput(metadata)
        if own is None:
            return before
        summed = summed + own
    thrown = Goodput(Counter({p: v for p, v in before.tokens.items() if p in THROWN_AWAY}),
                     Counter({p: v for p, v in before.items.items() if p in THROWN_AWAY}))
    return summed + thrown
