"""Tool counts of a run, from its committed records (shown by `regen status` and the dataset card): the prompts
sent with tools, the calls the target made, the all_turns conversations cut short, by reason, and the records
whose tool flags say what the target saw or wrote is off (store/quality.py): histories holding a cached result
for other arguments, calls whose arguments are not an object, calls cut and dropped by the server's parser.
Records of a schema without the tool columns count nothing. `SessionToolNotes`: the same figures of one session,
counted as the records are built, for the run's log (with the splices themselves, call by call)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..core.work import record_unit
from .rundir import RunDir

TOOL_COLUMNS = ("prompt_id", "sample_index", "turn_index", "tools", "tool_calls", "conversation_end", "flags")
SPLICED, NOT_OBJECT, CUT_CALL = "spliced_other_arguments", "arguments_not_object", "truncated_call"  # quality.py


@dataclass
class ToolCounts:
    prompts_with_tools: set[str] = field(default_factory=set)  # of the prompts with committed records
    in_set: int | None = None  # the prompt set's prompts that carry tools (sent, failed or pending); None: unknown
    records_with_calls: int = 0  # the target's generations that called at least one tool
    calls: int = 0  # the target's calls, parallel calls counted one by one
    cut_short: Counter = field(default_factory=Counter)  # conversation_end reason -> conversations
    flagged: Counter = field(default_factory=Counter)  # tool flag -> records
    spliced_conversations: set[str] = field(default_factory=set)  # units whose history holds a result for other args
    _seen: set[tuple[str, int]] = field(default_factory=set)

    def add(self, row: dict[str, Any]) -> None:
        key = (record_unit(row), row.get("turn_index") or 0)
        if key in self._seen:  # a duplicate of a committed record (a hedged request answered twice)
            return
        self._seen.add(key)
        if row.get("tools"):
            self.prompts_with_tools.add(row["prompt_id"])
        if row.get("tool_calls"):
            self.records_with_calls += 1
            self.calls += len(orjson.loads(row["tool_calls"]))
        if row.get("conversation_end"):
            self.cut_short[row["conversation_end"].split(":", 1)[0]] += 1
        for flag in row.get("flags") or ():
            if flag in (SPLICED, NOT_OBJECT, CUT_CALL):
                self.flagged[flag] += 1
                if flag == SPLICED:
                    self.spliced_conversations.add(key[0])

    def as_dict(self) -> dict[str, Any]:
        return {"prompts_with_tools": len(self.prompts_with_tools), "prompts_in_set_with_tools": self.in_set,
                "records_with_calls": self.records_with_calls,
                "calls": self.calls, "cut_short": dict(self.cut_short.most_common()),
                SPLICED: {"conversations": len(self.spliced_conversations), "records": self.flagged[SPLICED]},
                NOT_OBJECT: self.flagged[NOT_OBJECT], CUT_CALL: self.flagged[CUT_CALL]}

    def any(self) -> bool:
        """Something to say: a prompt with tools in the set or the records, or a call."""
        return bool(self.prompts_with_tools or self.calls or self.in_set)

    def summary(self) -> str:
        cut = ", ".join(f"{reason} {n}" for reason, n in self.cut_short.most_common()) or "none"
        return (f"tools: {self.prompts_line()}; the target made {self.calls} calls in {self.records_with_calls} "
                f"records; conversations cut short: {cut}; {self.flags_text()}")

    def prompts_line(self) -> str:
        """The prompts with tools: those with committed records are counted from the records, the set's from the
        prompt set (a prompt that failed or is pending has no record to count)."""
        recorded = f"{len(self.prompts_with_tools)} prompts with committed records sent with tools"
        return recorded if self.in_set is None else f"{recorded}, of {self.in_set} in the prompt set that carry tools"

    def flags_text(self) -> str:
        return flag_line(len(self.spliced_conversations), self.flagged[SPLICED], self.flagged[NOT_OBJECT],
                         self.flagged[CUT_CALL])


def flag_line(conversations: int, records: int, not_object: int, cut_calls: int) -> str:
    return (f"cached results spliced into calls with other arguments: in {conversations} conversations "
            f"({records} records' histories hold one); records whose calls' arguments are not a JSON object: "
            f"{not_object}; calls cut at max_tokens and dropped by the server's parser: {cut_calls}")


@dataclass
class SessionToolNotes:
    """One session's tool figures, counted by the record builder as it builds each prompt's records."""

    splices: int = 0  # the target's calls answered with a cached result for other arguments
    steps: int = 0  # the steps that had at least one
    conversations: int = 0
    flagged: Counter = field(default_factory=Counter)

    def add(self, replay: Any, rows: list[dict[str, Any]]) -> None:
        """`replay`: prompts/conversation.py Replay of the rows' conversation."""
        if replay.spliced_other_arguments:
            self.conversations += 1
            self.steps += len(replay.spliced_other_arguments)
            self.splices += sum(n for _, n in replay.spliced_other_arguments)
        for row in rows:
            self.flagged.update(flag for flag in row["flags"] if flag in (SPLICED, NOT_OBJECT, CUT_CALL))

    def log_to(self, log: Any) -> None:
        """The session's line in the run's log (nothing when there is nothing to say)."""
        line = self.line()
        if line is not None:
            log.warning("tools: %s", line)

    def line(self) -> str | None:
        """The log's line; None when there is nothing to say."""
        if not (self.splices or self.flagged):
            return None
        return (f"this session: {self.splices} of the target's calls (in {self.steps} steps) were answered with a "
                f"cached result for other arguments (tool_result_match: name); " + flag_line(
                    self.conversations, self.flagged[SPLICED], self.flagged[NOT_OBJECT], self.flagged[CUT_CALL]))


def tool_counts(run_dir: RunDir) -> ToolCounts | None:
    """None when no committed part has the tool columns (a run of records schema < 5). `in_set`: from the footer of
    the prompt set run.json pins."""
    counts, found = ToolCounts(), False
    for part in run_dir.parts(run_dir.data):
        present = set(part.parquet_schema().names)
        if "tools" not in present:
            continue
        found = True
        for row in part.read_parquet(columns=[c for c in TOOL_COLUMNS if c in present]).to_pylist():
            counts.add(row)
    if not found:
        return None
    prompts = run_dir.prompt_set_reader(run_dir.read_manifest().get("prompt_set_version"))
    counts.in_set = prompts.tool_prompts() if prompts is not None else None
    return counts
