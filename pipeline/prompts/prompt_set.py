"""Normalisation, validation, content-addressed identity, per-source limit and cross-source dedup.

`prompt_id` hashes only the normalised messages that are sent plus the regeneration mode (docs/architecture.md), so it
does not depend on the source name, file position, the reference answer or a source's own id field.

The set is built in one streaming pass per source into a sink (a list for small uses, Parquet files for a run):
rejects go to the sink as they come, a source without a limit passes its prompts on in file order, and a limit
keeps a bounded heap (selection.py). Memory holds the ids seen, never the source.
"""
from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import orjson

from ..core.errors import ConfigError
from .errors import NoValidPrompts
from .records import RAW_MAX_CHARS, InvalidRecord, Reject, RejectCode
from .report import SourceReport
from .selection import BoundedSelection, rank
from .sources import ReadStats, SourceSpec, read_records, source_ref, to_messages

__all__ = [
    "MODES", "Prompt", "PromptSet", "Reject", "RejectCode", "SourceReport", "InvalidRecord", "BuildResult",
    "prompt_id", "normalise", "build_prompt_set", "build_into",
]

MODES = ("last_turn", "all_turns")
# ShareGPT as it is in the wild: the role names of the dumps people download (SpecForge's prepare_data maps
# the same ones).
ROLE_MAP = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "bot": "assistant",
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
    tools: tuple[dict[str, Any], ...] | None = None  # the OpenAI `tools` list the prompt is sent with; None: none


class PromptSink(Protocol):
    def add_prompt(self, prompt: Prompt) -> None: ...

    def add_reject(self, reject: Reject) -> None: ...


@dataclass
class PromptSet:
    """A prompt set held in memory (tests, `regen simulate`); a run streams into Parquet instead."""

    prompts: list[Prompt] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    reports: list[SourceReport] = field(default_factory=list)
    duplicates: int = 0

    def add_prompt(self, prompt: Prompt) -> None:
        self.prompts.append(prompt)

    def add_reject(self, reject: Reject) -> None:
        self.rejects.append(reject)


@dataclass
class BuildResult:
    reports: list[SourceReport]
    duplicates: int
    prompts: int


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


def normalise(raw_messages: Any, mode: str = "last_turn",
              dropped: dict[str, int] | None = None) -> tuple[tuple[dict[str, str], ...], str | None]:
    """Validate and normalise a conversation. Returns (messages to send, reference) or raises InvalidRecord.

    Blank system messages are dropped, as are assistant turns before the first user turn (SpecForge's
    preprocessing drops a first message that is not the user's); NUL characters are removed; under last_turn a
    blank last assistant turn (the reference a new answer replaces) is dropped. Each is counted in `dropped`
    (blank_system, leading_assistant, nul, blank_reference); any other blank message rejects the record."""
    _check_mode(mode)
    if not isinstance(raw_messages, (list, tuple)):
        raise InvalidRecord(RejectCode.BAD_CONVERSATION, "the conversation is not a list of messages")
    if not raw_messages:
        raise InvalidRecord(RejectCode.EMPTY, "the conversation is empty")
    dropped = dropped if dropped is not None else {}

    conv: list[tuple[int, str, str]] = []  # (message number in the record, role, content)
    for i, m in enumerate(raw_messages, start=1):
        if not (type(m) is dict or isinstance(m, Mapping)) or "role" not in m or "content" not in m:
            raise InvalidRecord(RejectCode.BAD_MESSAGE, f"message {i} is not an object with a role and a content")
        raw_role, content = m["role"], m["content"]
        role = None
        if isinstance(raw_role, str):
            role = ROLE_MAP.get(raw_role) or ROLE_MAP.get(raw_role.strip().lower())
        if role is None:
            raise InvalidRecord(RejectCode.UNKNOWN_ROLE, f"message {i} has an unknown role {raw_role!r}")
        if type(content) is not str and not isinstance(content, str):
            raise InvalidRecord(RejectCode.NON_STRING_CONTENT,
                                f"message {i} ({role}) has non-string content ({type(content).__name__})")
        if "\x00" in content:
            dropped["nul"] = dropped.get("nul", 0) + content.count("\x00")
            content = content.replace("\x00", "")
        content = unicodedata.normalize("NFC", content.strip())
        if not content and role == "system":
            dropped["blank_system"] = dropped.get("blank_system", 0) + 1
            continue
        conv.append((i, role, content))  # a blank one is refused below unless it is the reference

    for k, (i, role, _) in enumerate(conv):
        if role == "system" and k != 0:
            raise InvalidRecord(RejectCode.SYSTEM_NOT_FIRST,
                                f"message {i} is a system message, but a system message may only come first")
    system = conv[:1] if conv and conv[0][1] == "system" else []
    body = conv[len(system):]
    leading = 0
    while leading < len(body) and body[leading][1] == "assistant":
        leading += 1
    if leading:
        dropped["leading_assistant"] = dropped.get("leading_assistant", 0) + leading
        body = body[leading:]
    if not body:
        if leading:
            raise InvalidRecord(RejectCode.NO_USER_TURN, "the conversation has no user turn")
        raise InvalidRecord(RejectCode.NOTHING_TO_SEND,
                            "the conversation has nothing to send (it has only a system message)")
    for k, (i, role, _) in enumerate(body):
        expected = "user" if k % 2 == 0 else "assistant"
        if role != expected:
            raise InvalidRecord(RejectCode.NOT_ALTERNATING,
                                f"roles do not alternate: message {i} is {role} where {expected} was expected")

    if mode == "last_turn" and body[-1][1] == "assistant" and not body[-1][2]:
        # the reference only: a new answer takes its place, so its being blank loses nothing
        dropped["blank_reference"] = dropped.get("blank_reference", 0) + 1
        body = body[:-1]
    for i, role, content in body:
        if not content:
            raise InvalidRecord(RejectCode.BLANK_CONTENT, f"message {i} ({role}) is blank")
    messages = [{"role": role, "content": content} for _, role, content in system + body]
    if mode == "all_turns":
        return tuple(messages), None
    reference = None
    if messages[-1]["role"] == "assistant":
        reference = messages.pop()["content"]
    return tuple(messages), reference


def _raw_text(data: Any) -> str:
    try:
        text = orjson.dumps(data, default=str).decode()
    except TypeError:  # e.g. non-string dict keys from a parquet map column
        text = repr(data)
    return text[:RAW_MAX_CHARS]


def _encode(p: Prompt) -> bytes:
    return orjson.dumps([p.prompt_id, p.source, p.messages, p.reference, p.origin, p.source_ref])


def _decode(blob: bytes) -> Prompt:
    pid, source, messages, reference, origin, ref = orjson.loads(blob)
    return Prompt(pid, source, tuple(messages), reference, origin, ref)


LengthCheck = Callable[[tuple[dict[str, str], ...]], None]  # raises InvalidRecord(TOO_LONG)


def build_into(sink: PromptSink, sources: list[tuple[SourceSpec, int | None]], mode: str = "last_turn",
               seed: int = 0, length_check: LengthCheck | None = None) -> BuildResult:
    """Read every source, keep its valid prompts, dedup across sources in list order, then apply its limit.

    A limit (the run's override, else the spec's own) keeps the N prompts of lowest sha256(f"{seed}:{prompt_id}"),
    so the choice depends on content alone, not on the order of the file; they are passed on in that order. A
    source without a limit passes its prompts on in file order. The first source in the list keeps a prompt
    that several sources share, and a later source's limit counts only prompts the earlier ones lack. A source with no valid prompt raises NoValidPrompts."""
    _check_mode(mode)
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

        def offer(prompt: Prompt) -> None:
            if prompt.prompt_id in held:  # an earlier source's: the limit counts only what this one adds
                report.duplicates += 1
                return
            selection.offer(rank(seed, prompt.prompt_id), prompt)

        selection = BoundedSelection(limit, _encode, _decode) if limit is not None else None
        try:
            _read_source(spec, mode, report, sink, length_check, emit if selection is None else offer)
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
                 length_check: LengthCheck | None, keep: Callable[[Prompt], None]) -> None:
    """Each valid prompt of one source, first occurrence only, to `keep`; rejects to the sink."""
    seen: set[str] = set()
    stats = ReadStats()
    for rec in read_records(spec, stats):
        report.read += 1
        if isinstance(rec, Reject):
            report.reject(rec.code, rec.reason)
            sink.add_reject(rec)
            continue
        dropped: dict[str, int] = {}
        try:
            messages, reference = normalise(to_messages(spec, rec.data), mode, dropped)
            if length_check is not None:
                length_check(messages)
        except InvalidRecord as e:
            report.reject(e.code.value, e.reason)
            sink.add_reject(Reject(spec.name, rec.origin, e.reason, _raw_text(rec.data), e.code.value))
            continue
        report.valid += 1
        report.nul_removed += dropped.pop("nul", 0)
        for kind, n in dropped.items():
            report.dropped_turns[kind] = report.dropped_turns.get(kind, 0) + n
        pid = prompt_id(messages, mode)
        if pid in seen:
            report.duplicates += 1
            continue
        seen.add(pid)
        keep(Prompt(pid, spec.name, messages, reference, rec.origin, source_ref(spec, rec.data)))
    report.rejected = report.read - report.valid
    report.nul_removed += stats.nul_bytes_removed
    report.containers = dict(stats.containers)
    report.cuts = [cut.as_dict() for cut in stats.cuts]


def build_prompt_set(sources: list[tuple[SourceSpec, int | None]], mode: str = "last_turn", seed: int = 0,
                     length_check: LengthCheck | None = None) -> PromptSet:
    """The whole set in memory: for tests and dry runs. A run streams through `build_into`."""
    out = PromptSet()
    result = build_into(out, sources, mode, seed, length_check)
    out.reports, out.duplicates = result.reports, result.duplicates
    return out
