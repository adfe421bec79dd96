"""Records: what is committed for a finished prompt. Pure: no Ray, no HTTP."""
from __future__ import annotations

from typing import Any

import orjson
import pyarrow.compute as pc

from ..core.config import RunConfig
from ..core.identity import StoredRecords
from ..core.work import SAMPLE_SEP, Outcome, WorkItem, split_unit
from ..prompts.conversation import calls_json, replay, sample_seed
from ..prompts.tool_calls import message_row
from .prompt_reader import PendingPrompt, PromptRow, PromptSetReader
from .quality import SPLICED_OTHER_ARGUMENTS, quality_flags
from .tool_counts import SessionToolNotes
from .rundir import RunDir, now_utc


class RecordBuilder:
    """Turns an outcome into data rows (one per regenerated turn) or a failure row. It holds no prompt set: a
    prompt's row is read when it is handed out (`work_items`) and kept, in `in_flight`, until its record is built.
    Work items and outcomes name a unit (core/work.py unit_id: a sample of a prompt); the records name the prompt
    and, when the run draws several samples of each, the sample (`sample_index`; null in a run of one sample)."""

    def __init__(self, reader: PromptSetReader | None, cfg: RunConfig, fingerprint: str | None = None):
        """`reader`: the run's pinned prompt set; `fingerprint`: the run's, from its run.json (a run keeps the one
        it was created with)."""
        self.reader = reader
        self.in_flight: dict[str, PromptRow] = {}  # unit id -> its prompt's row: handed out, no final outcome yet
        self.fingerprint = fingerprint or cfg.fingerprint()
        self.temperature, self.mode = cfg.sampling.temperature, cfg.mode
        self.max_tokens = cfg.sampling.max_tokens
        self.tool_reasoning_history, self.tool_result_match = cfg.tool_reasoning_history, cfg.tool_result_match
        self.samples = cfg.samples_per_prompt
        self.tool_notes = SessionToolNotes()  # this session's tool figures, for the run's log

    def work_items(self, batch: list[PendingPrompt | WorkItem]) -> list[WorkItem]:
        """The dispatcher's `load`: pending prompts become work items, their rows read from the prompt set in one
        pass over their row groups; a work item (a retry, already read) passes through."""
        pending = [item for item in batch if isinstance(item, PendingPrompt)]
        rows = iter(zip(pending, self.reader.rows(pending))) if pending else iter(())
        return [self.work_item(*next(rows)) if isinstance(item, PendingPrompt) else item for item in batch]

    def work_item(self, pending: PendingPrompt | PromptRow, row: PromptRow | None = None) -> WorkItem:
        """The row's messages (normalised: a tool-free message is exactly {"role", "content"}) and tools travel
        with the in-flight item; its routing key is the prompt set's `route_key` (tools included). `pending`: the
        unit (a sample of the row's prompt); a row alone is its prompt's sample 0."""
        row = row or pending
        unit = pending.prompt_id
        self.in_flight[unit] = row
        tools_json = None if row.tools is None else row.tools.encode()
        return WorkItem(unit, orjson.dumps(row.messages), sample_seed(row.prompt_id, split_unit(unit)[1],
                                                                      self.temperature), row.affinity, tools_json)

    def records(self, outcome: Outcome, attempts: int) -> list[dict[str, Any]]:
        """One row per generation. all_turns: the conversation is replayed from the answers (each tool-calling step
        is a generation, turn_index counts them); its last row says why it ended early, if it did."""
        row = self.in_flight.pop(outcome.prompt_id)
        prompt_id, j = split_unit(outcome.prompt_id)
        done = replay(self.mode, row.messages, outcome.completions, self.tool_reasoning_history,
                      self.tool_result_match)
        sent = done.sent
        seed = sample_seed(prompt_id, j, self.temperature)
        tools, last = row.tools, len(outcome.completions) - 1  # canonical JSON text, as stored
        rows = []
        for k, (messages, c) in enumerate(zip(sent, outcome.completions)):
            extra = {}  # the tool columns (records schema 5) only where a value is set: older schemas lack them
            if tools is not None:
                extra["tools"] = tools
            if c.tool_calls:
                extra["tool_calls"] = calls_json(c.tool_calls)
            if k == last and outcome.conversation_end is not None:
                extra["conversation_end"] = outcome.conversation_end
            if self.samples > 1 or j:  # a run of one sample leaves it null (records schema 5)
                extra["sample_index"] = j
            if row.source_ref is not None:  # records schema 6
                extra["source_ref"] = row.source_ref
            flags = quality_flags(c.content, c.reasoning_content, c.finish_reason, c.completion_tokens,
                                  self.max_tokens, c.tool_calls, tools is not None, c.reasoning_tokens)
            if done.holds_other_arguments(k):
                flags.append(SPLICED_OTHER_ARGUMENTS)
            rows.append({
                "prompt_id": prompt_id, "source": row.source,
                "messages": [message_row(m) for m in messages],
                "turn_index": k if self.mode == "all_turns" else sum(m["role"] == "assistant" for m in messages),
                "n_turns": len(outcome.completions), "reference": row.reference if self.mode != "all_turns" else None,
                "content": c.content, "reasoning_content": c.reasoning_content, "finish_reason": c.finish_reason,
                "flags": flags,
                "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "cached_tokens": c.cached_tokens, "reasoning_tokens": c.reasoning_tokens,
                "endpoint": outcome.endpoint, "model": c.model, "weight_version": c.weight_version,
                "config_fingerprint": self.fingerprint, "latency_s": c.latency_s, "attempts": attempts,
                "seed": None if seed is None else seed + (k if self.mode == "all_turns" else 0),
                "deterministic": c.deterministic, "engine": c.engine, "engine_version": c.engine_version,
                "request_id": c.request_id, "prompt_token_ids": c.prompt_token_ids,
                "output_token_ids": c.output_token_ids, "created_at": now_utc(), **extra,
            })
        self.tool_notes.add(done, rows)
        return rows

    def failure(self, outcome: Outcome, attempts: int) -> dict[str, Any]:
        """A failure row names the unit that failed: its `prompt_id` is the unit's id (`<id>#s<j>` for a sample
        j > 0; the failures' schema has no sample column)."""
        row = self.in_flight.pop(outcome.prompt_id)
        return {
            "prompt_id": outcome.prompt_id, "source": row.source,
            "error_class": outcome.kind, "status": outcome.status, "message": outcome.message,
            "endpoint": outcome.endpoint, "attempts": attempts, "config_fingerprint": self.fingerprint,
            "created_at": now_utc(),
        }


def stored_records(run_dir: RunDir) -> StoredRecords:
    """What the committed data records show of how they were made, for a run.json that did not record it
    (core/identity.py). Reads the token id column part by part, and stops at the first part that has them."""
    count = with_token_ids = 0
    for part in run_dir.parts(run_dir.data):
        has_ids = "output_token_ids" in part.parquet_schema().names  # parts of early regen have no such column
        table = part.read_parquet(columns=["output_token_ids" if has_ids else "prompt_id"])
        count += table.num_rows
        if has_ids:
            lengths = pc.list_value_length(table.column(0)).fill_null(0)
            with_token_ids += pc.sum(pc.greater(lengths, 0)).as_py() or 0
        if with_token_ids:
            break
    return StoredRecords(count, with_token_ids)


def stored_samples(run_dir: RunDir) -> int:
    """How many samples of a prompt the ledger holds: 1 + the highest sample index of a committed record or a
    terminal failure (a failure names its sample in its unit id, `<prompt_id>#s<j>`); 0 for an empty ledger.
    Reads the id columns only."""
    highest = -1
    for folder in (run_dir.data, run_dir.failures):
        units = run_dir.unit_ids(folder)
        if len(units):
            highest = max(highest, 0)
        suffix = pc.struct_field(pc.extract_regex(units, rf"{SAMPLE_SEP}(?P<j>\d+)$"), "j")
        if suffix.null_count < len(suffix):
            highest = max(highest, pc.max(pc.cast(suffix, "int64")).as_py())
    return highest + 1
