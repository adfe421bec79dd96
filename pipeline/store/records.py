"""Records: what is committed for a finished prompt. Pure: no Ray, no HTTP."""
from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ..core.config import RunConfig
from ..core.identity import StoredRecords
from ..core.work import Outcome, WorkItem, affinity_key
from ..prompts.conversation import calls_json, histories, seed_for
from ..prompts.tool_calls import canonical_json, message_from_row, message_row
from .quality import quality_flags
from .rundir import RunDir, now_utc


class RecordBuilder:
    """Turns an outcome into data rows (one per regenerated turn) or a failure row. The prompt set stays
    an Arrow table: a prompt's messages become Python objects only when it is sent or recorded."""

    def __init__(self, prompts: pa.Table, cfg: RunConfig, fingerprint: str | None = None):
        """`fingerprint`: the run's, from its run.json (a run keeps the one it was created with)."""
        self.index = {pid: i for i, pid in enumerate(prompts.column("prompt_id").to_pylist())}
        self.sources = prompts.column("source").to_pylist()
        self.references = prompts.column("reference").to_pylist()
        self.messages = prompts.column("messages").combine_chunks()
        # a prompt set written before tool calls has no tools column: none of its prompts has tools
        self.tools = (prompts.column("tools").to_pylist() if "tools" in prompts.column_names
                      else [None] * prompts.num_rows)
        self.fingerprint = fingerprint or cfg.fingerprint()
        self.temperature, self.mode = cfg.sampling.temperature, cfg.mode
        self.max_tokens = cfg.sampling.max_tokens
        self.affinity_chars = cfg.prefix_affinity_chars
        self.tool_reasoning_history = cfg.tool_reasoning_history

    def messages_of(self, i: int) -> list[dict[str, Any]]:
        """The prompt's messages as normalised (a tool-free message is exactly {"role", "content"})."""
        return [message_from_row(m) for m in self.messages[i].as_py()]

    def work_item(self, prompt_id: str) -> WorkItem:
        i = self.index[prompt_id]
        messages = self.messages_of(i)
        tools = self.tools[i]
        tools_json = None if tools is None else tools.encode()
        return WorkItem(prompt_id, orjson.dumps(messages), seed_for(prompt_id, self.temperature),
                        affinity_key(messages, self.affinity_chars, tools_json), tools_json)

    def tools_of(self, i: int) -> str | None:
        """The prompt's tools as the records' `tools` column holds them: canonical JSON text, None when none."""
        tools = self.tools[i]
        return tools if tools is None or isinstance(tools, str) else canonical_json(tools)

    def records(self, outcome: Outcome, attempts: int) -> list[dict[str, Any]]:
        """One row per generation. all_turns: the conversation is replayed from the answers (each tool-calling step
        is a generation, turn_index counts them); its last row says why it ended early, if it did."""
        i = self.index[outcome.prompt_id]
        sent, _ = histories(self.mode, self.messages_of(i), outcome.completions, self.tool_reasoning_history)
        seed = seed_for(outcome.prompt_id, self.temperature)
        tools, last = self.tools_of(i), len(outcome.completions) - 1
        rows = []
        for k, (messages, c) in enumerate(zip(sent, outcome.completions)):
            extra = {}  # the tool columns (records schema 5) only where a value is set: older schemas lack them
            if tools is not None:
                extra["tools"] = tools
            if c.tool_calls:
                extra["tool_calls"] = calls_json(c.tool_calls)
            if k == last and outcome.conversation_end is not None:
                extra["conversation_end"] = outcome.conversation_end
            rows.append({
                "prompt_id": outcome.prompt_id, "source": self.sources[i],
                "messages": [message_row(m) for m in messages],
                "turn_index": k if self.mode == "all_turns" else sum(m["role"] == "assistant" for m in messages),
                "n_turns": len(outcome.completions), "reference": self.references[i] if self.mode != "all_turns" else None,
                "content": c.content, "reasoning_content": c.reasoning_content, "finish_reason": c.finish_reason,
                "flags": quality_flags(c.content, c.reasoning_content, c.finish_reason, c.completion_tokens,
                                       self.max_tokens, c.tool_calls),
                "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "cached_tokens": c.cached_tokens, "reasoning_tokens": c.reasoning_tokens,
                "endpoint": outcome.endpoint, "model": c.model, "weight_version": c.weight_version,
                "config_fingerprint": self.fingerprint, "latency_s": c.latency_s, "attempts": attempts,
                "seed": None if seed is None else seed + (k if self.mode == "all_turns" else 0),
                "deterministic": c.deterministic, "engine": c.engine, "engine_version": c.engine_version,
                "request_id": c.request_id, "prompt_token_ids": c.prompt_token_ids,
                "output_token_ids": c.output_token_ids, "created_at": now_utc(), **extra,
            })
        return rows

    def failure(self, outcome: Outcome, attempts: int) -> dict[str, Any]:
        return {
            "prompt_id": outcome.prompt_id, "source": self.sources[self.index[outcome.prompt_id]],
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
