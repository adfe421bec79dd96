"""The report of one source: what was read, kept, rejected (by reason), selected, collapsed and dropped.

Stored in run.json (`prompt_report`) when the prompt set is materialised; `regen status` and the card show it.
The counts add up: read = valid + rejected; valid = selected + duplicates + (not chosen by the limit).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .records import Tally


@dataclass
class SourceReport:
    name: str
    read: int = 0  # records read, including unparseable ones
    valid: int = 0
    rejected: int = 0
    selected: int = 0  # prompts this source contributes to the set
    duplicates: int = 0  # in-source duplicates plus selected prompts an earlier source already holds
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # RejectCode value -> records
    reason_examples: dict[str, str] = field(default_factory=dict)  # RejectCode value -> its first reason
    dropped_turns: dict[str, int] = field(default_factory=dict)  # leading_assistant, blank_system -> messages
    # messages (or text parts) of system, user and assistant turns whose text was changed: whitespace_stripped,
    # unicode_nfc (a tool result is never changed but for NUL characters)
    changed: dict[str, int] = field(default_factory=dict)
    nul_removed: int = 0  # NUL characters taken out of kept messages (escaped \u0000 and raw bytes)
    containers: dict[str, str] = field(default_factory=dict)  # file or dataset -> what it turned out to be
    cuts: list[dict[str, Any]] = field(default_factory=list)  # salvaged files: offset, records kept, bytes dropped
    # fields of kept records that regen does not carry, by name (record.KEY, message.KEY, tool_call.KEY) -> records
    # or messages that had them: nothing that shapes what the model sees is dropped without a count
    uncarried: dict[str, int] = field(default_factory=dict)
    tool_counts: dict[str, int] = field(default_factory=dict)  # tool_calls, made_call_ids, ... (docs/sources-tool-calls.md)
    # images of kept records (images, prompts_with_images, image_bytes, from_files, from_data_url, from_http,
    # from_dataset_bytes, images_at_markers, images_placed_before_text) and messages_with_parts (content lists,
    # text-only ones too); their rejects are in rejected_by_reason
    image_counts: dict[str, int] = field(default_factory=dict)
    # fields not carried that look like tool schemas (a list of objects with `name` and `parameters`) -> records:
    # validate warns, generate refuses (name it `tools_field`, or `ignore_fields`)
    uncarried_tools: dict[str, int] = field(default_factory=dict)
    # one-prompt fields whose text reads as a whole conversation (prompts/transcript.py) -> prompts: sent as one user
    # message as it stands, counted (`transcript_in_one_message`); validate warns, status and generate's log say it
    transcript_in_one_message: dict[str, int] = field(default_factory=dict)

    def reject(self, code: str, reason: str) -> None:
        self.rejected_by_reason[code] = self.rejected_by_reason.get(code, 0) + 1
        self.reason_examples.setdefault(code, reason)

    def count(self, tally: "Tally") -> None:
        """What normalising one kept record counted."""
        if not (tally.dropped or tally.changed or tally.uncarried or tally.tools or tally.images or tally.tool_like):
            return
        dropped = dict(tally.dropped)
        self.nul_removed += dropped.pop("nul", 0)
        for target, counts in ((self.dropped_turns, dropped), (self.changed, tally.changed),
                               (self.uncarried, tally.uncarried), (self.tool_counts, tally.tools),
                               (self.image_counts, tally.images), (self.uncarried_tools, tally.tool_like)):
            for kind, n in counts.items():
                target[kind] = target.get(kind, 0) + n

    def top_reasons(self, n: int = 3) -> list[tuple[str, int, str]]:
        counts = Counter(self.rejected_by_reason).most_common(n)
        return [(code, count, self.reason_examples.get(code, "")) for code, count in counts]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SourceReport":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def report_lines(reports: list[dict[str, Any]], indent: str = "  ") -> list[str]:
    """Human lines for `regen status`: one per source, plus one per salvaged cut."""
    lines = []
    for data in reports:
        r = SourceReport.from_dict(data)
        reasons = ", ".join(f"{code} {n:,}" for code, n, _ in r.top_reasons(len(r.rejected_by_reason)))
        dropped = ", ".join(f"{kind} {n:,}" for kind, n in sorted(r.dropped_turns.items()) if n)
        line = (f"{indent}source {r.name}: read {r.read:,}, valid {r.valid:,}, rejected {r.rejected:,}"
                + (f" ({reasons})" if reasons else "")
                + f", selected {r.selected:,}, duplicates {r.duplicates:,}"
                + (f"; dropped turns: {dropped}" if dropped else "")
                + (f"; changed messages: {_counts(r.changed)}" if r.changed else "")
                + (f"; NUL characters removed: {r.nul_removed:,}" if r.nul_removed else "")
                + (f"; tool calls: {_counts(r.tool_counts)}" if r.tool_counts else "")
                + (f"; images: {_counts(r.image_counts)}" if r.image_counts else "")
                + (f"; fields not carried: {_counts(r.uncarried)}" if r.uncarried else ""))
        lines.append(line)
        for key, n in sorted(r.uncarried_tools.items()):
            lines.append(f"{indent}  {uncarried_tools_line(r.name, key, n)}")
        for key, n in sorted(r.transcript_in_one_message.items()):
            lines.append(f"{indent}  {transcript_line(key, n)}")
        for cut in r.cuts:
            lines.append(f"{indent}  salvaged {cut['file']}: {cut['problem']}; kept {cut['records_kept']:,} "
                         f"records up to byte {cut['offset']:,}, " + (
                             "lost nothing of a record" if cut.get("unclosed") else
                             f"dropped the last {cut['bytes_dropped']:,} bytes"))
    return lines


def _counts(counts: dict[str, int], most: int = 20) -> str:
    """`name n, ...` by count, the rest summed up."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{name} {n:,}" for name, n in ranked[:most])
    return text + (f" and {len(ranked) - most} more" if len(ranked) > most else "")


def report_table(reports: list[dict[str, Any]]) -> list[str]:
    """Markdown for the dataset card."""
    lines = ["| source | read | valid | rejected | selected | duplicates | dropped turns | changed messages |"
             " rejected by reason | tool calls | images | fields not carried |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|"]
    for data in reports:
        r = SourceReport.from_dict(data)
        reasons = ", ".join(f"{code} {n}" for code, n, _ in r.top_reasons(len(r.rejected_by_reason))) or "-"
        dropped = ", ".join(f"{kind} {n}" for kind, n in sorted(r.dropped_turns.items()) if n) or "-"
        lines.append(f"| {r.name} | {r.read} | {r.valid} | {r.rejected} | {r.selected} | {r.duplicates} | "
                     f"{dropped} | {_counts(r.changed) or '-'} | {reasons} | {_counts(r.tool_counts) or '-'} | "
                     f"{_counts(r.image_counts) or '-'} | {_counts(r.uncarried) or '-'} |")
        for cut in r.cuts:
            lines.append(f"| {r.name}: salvaged `{cut['file']}` | | | | | | | | {cut['problem']}: kept "
                         f"{cut['records_kept']} records up to byte {cut['offset']}, "
                         + ("nothing of a record lost | | | |" if cut.get("unclosed") else
                            f"{cut['bytes_dropped']} bytes dropped | | | |"))
    return lines


def uncarried_tools_line(source: str, key: str, records: int) -> str:
    """A field of tool schemas that the run would not send."""
    return (f"the field {key!r} of {records:,} records looks like tool schemas (a list of objects with `name` and "
            f"`parameters`) and is not carried: the run would send these prompts without those tools. Name it "
            f"`tools_field: {key}` in the source spec of {source!r} to send them, or `ignore_fields: [{key}]` to run "
            "without them")


def transcript_line(key: str, prompts: int, markers: tuple[str, str] | None = None, of: str = "prompts") -> str:
    """A one-prompt field whose text is a whole conversation (prompts/transcript.py), in `prompts` of them."""
    shown = (f"lines beginning {markers[0]!r} and {markers[1]!r}" if markers else
             "lines beginning with a user's and an assistant's role marker")
    return (f"transcript_in_one_message: the field {key!r} of {prompts:,} {of} reads as a whole conversation "
            f"({shown}); regen does not split such text into turns and sends each as one user message, as it "
            "stands. To send them as conversations, convert the records to messages (format openai or sharegpt) "
            "first (docs/sources.md, section A conversation in one prompt text)")
