"""Tool counts of a run, from its committed records (shown by `regen status` and the dataset card): the prompts
sent with tools, the calls the target made, and the all_turns conversations cut short, by reason. Records of a
schema without the tool columns count nothing."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..core.work import record_unit
from .rundir import RunDir

TOOL_COLUMNS = ("prompt_id", "sample_index", "turn_index", "tools", "tool_calls", "conversation_end")


@dataclass
class ToolCounts:
    prompts_with_tools: set[str] = field(default_factory=set)
    records_with_calls: int = 0  # the target's generations that called at least one tool
    calls: int = 0  # the target's calls, parallel calls counted one by one
    cut_short: Counter = field(default_factory=Counter)  # conversation_end reason -> conversations
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

    def as_dict(self) -> dict[str, Any]:
        return {"prompts_with_tools": len(self.prompts_with_tools), "records_with_calls": self.records_with_calls,
                "calls": self.calls, "cut_short": dict(self.cut_short.most_common())}

    def summary(self) -> str:
        cut = ", ".join(f"{reason} {n}" for reason, n in self.cut_short.most_common()) or "none"
        return (f"tools: {len(self.prompts_with_tools)} prompts sent with tools; the target made {self.calls} calls "
                f"in {self.records_with_calls} records; conversations cut short: {cut}")


def tool_counts(run_dir: RunDir) -> ToolCounts | None:
    """None when no committed part has the tool columns (a run of records schema < 5)."""
    counts, found = ToolCounts(), False
    for part in run_dir.parts(run_dir.data):
        present = set(part.parquet_schema().names)
        if "tools" not in present:
            continue
        found = True
        for row in part.read_parquet(columns=[c for c in TOOL_COLUMNS if c in present]).to_pylist():
            counts.add(row)
    return counts if found else None
