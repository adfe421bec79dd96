"""Normalisation, validation, content-addressed identity, per-source limit and cross-source dedup.

`prompt_id` hashes only the normalised messages that are sent plus the regeneration mode (DESIGN invariant 1), so it
does not depend on the source name, file position, the reference answer or a source's own id field.
"""
from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import orjson

from ..core.errors import ConfigError
from .sources import (
    RAW_MAX_CHARS, InvalidRecord, Reject, RejectCode, SourceSpec, read_records, source_ref, to_messages,
)

__all__ = [
    "MODES", "Prompt", "PromptSet", "Reject", "RejectCode", "SourceReport", "InvalidRecord",
    "prompt_id", "normalise", "build_prompt_set",
]

MODES = ("last_turn", "all_turns")
ROLE_MAP = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "chatgpt": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # 32 hex chars
    source: str
    messages: tuple[dict[str, str], ...]  # what is sent; in last_turn mode the last one is a user turn
    reference: str | None  # the source's original final assistant turn, if it had one
    origin: str  # where the first occurrence came from
    source_ref: str | None = None


@dataclass
class SourceReport:
    name: str
    read: int = 0  # records read, including unparseable ones
    valid: int = 0
    rejected: int = 0
    selected: int = 0  # prompts this source contributes to the set
    duplicates: int = 0  # in-source duplicates plus prompts an earlier source already holds


@dataclass
class PromptSet:
    prompts: list[Prompt] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    reports: list[SourceReport] = field(default_factory=list)
    duplicates: int = 0


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown regeneration mode {mode!r} (expected one of {', '.join(MODES)})")


def prompt_id(messages: Iterable[Mapping[str, str]], mode: str = "last_turn") -> str:
    """Stable id of what is sent: sha256 over sorted-key JSON of the mode and the messages, first 32 hex chars.

    In `all_turns` mode the assistant turns are regenerated, so only the system and user turns name the prompt.
    """
    _check_mode(mode)
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if mode == "all_turns":
        msgs = [m for m in msgs if m["role"] != "assistant"]
    blob = orjson.dumps({"mode": mode, "messages": msgs}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()[:32]


def normalise(raw_messages: Any, mode: str = "last_turn") -> tuple[tuple[dict[str, str], ...], str | None]:
    """Validate and normalise a conversation. Returns (messages to send, reference) or raises InvalidRecord."""
    _check_mode(mode)
    if not isinstance(raw_messages, (list, tuple)):
        raise InvalidRecord(RejectCode.BAD_CONVERSATION, "the conversation is not a list of messages")
    if not raw_messages:
        raise InvalidRecord(RejectCode.EMPTY, "the conversation is empty")

    conv: list[dict[str, str]] = []
    for i, m in enumerate(raw_messages, start=1):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} is not an object with a role and a content")
        raw_role, content = m["role"], m["content"]
        role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise InvalidRecord(RejectCode.UNKNOWN_ROLE, f"message {i} has an unknown role {raw_role!r}")
        if not isinstance(content, str):
            raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                f"message {i} ({role}) has non-string content ({type(content).__name__})")
        content = unicodedata.normalize("NFC", content.strip())
        if not content:
            raise InvalidRecord(RejectCode.BLANK_CONTENT, f"message {i} ({role}) is blank")
        if role == "system" and i != 1:
            raise InvalidRecord(RejectCode.SYSTEM_NOT_FIRST,
                                f"message {i} is a system message, but a system message may only come first")
        conv.append({"role": role, "content": content})

    start = 1 if conv[0]["role"] == "system" else 0
    body = conv[start:]
    if not body:
        raise InvalidRecord(RejectCode.NOTHING_TO_SEND,
                            "the conversation has nothing to send (it has only a system message)")
    if all(m["role"] != "user" for m in body):
        raise InvalidRecord(RejectCode.NO_USER_TURN, "the conversation has no user turn")
    for k, m in enumerate(body):
        expected = "user" if k % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise InvalidRecord(
                RejectCode.NOT_ALTERNATING,
                f"roles do not alternate: message {start + k + 1} is {m['role']} where {expected} was expected"
            )

    if mode == "all_turns":
        return tuple(conv), None
    reference = None
    if conv[-1]["role"] == "assistant":
        reference = conv.pop()["content"]
    return tuple(conv), reference


def _rank(seed: int, pid: str) -> str:
    return hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()


def _raw_text(data: Any) -> str:
    try:
        text = orjson.dumps(data, default=str).decode()
    except TypeError:  # e.g. non-string dict keys from a parquet map column
        text = repr(data)
    return text[:RAW_MAX_CHARS]


def _read_source(spec: SourceSpec, mode: str, report: SourceReport,
                 rejects: list[Reject]) -> dict[str, Prompt]:
    """Valid prompts of one source by prompt_id, first occurrence kept."""
    found: dict[str, Prompt] = {}
    for rec in read_records(spec):
        report.read += 1
        if isinstance(rec, Reject):
            rejects.append(rec)
            continue
        try:
            messages, reference = normalise(to_messages(spec, rec.data), mode)
        except InvalidRecord as e:
            rejects.append(Reject(spec.name, rec.origin, e.reason, _raw_text(rec.data), e.code.value))
            continue
        report.valid += 1
        pid = prompt_id(messages, mode)
        if pid in found:
            report.duplicates += 1
            continue
        found[pid] = Prompt(pid, spec.name, messages, reference, rec.origin, source_ref(spec, rec.data))
    report.rejected = report.read - report.valid
    return found


def build_prompt_set(sources: list[tuple[SourceSpec, int | None]], mode: str = "last_turn",
                     seed: int = 0) -> PromptSet:
    """Read every source, keep its valid prompts, apply its limit, then dedup across sources in list order.

    A limit (the run's override, else the spec's own) keeps the N prompts of lowest sha256(f"{seed}:{prompt_id}"),
    so the choice depends on content alone, not on the order of the file. The first source in the list keeps a
    prompt that several sources share.
    """
    _check_mode(mode)
    names = [spec.name for spec, _ in sources]
    dup_names = sorted({n for n in names if names.count(n) > 1})
    if dup_names:
        raise ConfigError(f"source names must be unique; repeated: {', '.join(dup_names)}")

    out = PromptSet()
    seen: set[str] = set()
    for spec, override in sources:
        limit = override if override is not None else spec.limit
        if limit is not None and limit < 1:
            raise ConfigError(f"source {spec.name!r}: limit must be at least 1, got {limit}")
        report = SourceReport(spec.name)
        found = _read_source(spec, mode, report, out.rejects)
        ranked = sorted(found.values(), key=lambda p: _rank(seed, p.prompt_id))
        if limit is not None:
            ranked = ranked[:limit]
        for p in ranked:
            if p.prompt_id in seen:
                report.duplicates += 1
                continue
            seen.add(p.prompt_id)
            out.prompts.append(p)
            report.selected += 1
        out.duplicates += report.duplicates
        out.reports.append(report)
    return out
