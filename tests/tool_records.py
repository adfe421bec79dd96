"""Run directories of tool-calling records, written with the store's own RunDir and real Parquet.

Records schema 5 (the tool columns and the MESSAGE struct's tool fields) is built in parallel on another branch;
until it is merged, `RECORDS_5` is the schema the shared interface names (store/schema.py's, once it has them)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.store import schema
from pipeline.store.rundir import RunDir

TOOL_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                          ("tool_call_id", pa.string()), ("name", pa.string())])


def _records_5() -> pa.Schema:
    if "tools" in schema.RECORDS.names:
        return schema.RECORDS
    fields = [pa.field("messages", pa.list_(TOOL_MESSAGE)) if f.name == "messages" else f for f in schema.RECORDS]
    return pa.schema(fields + [pa.field("tools", pa.string()), pa.field("tool_calls", pa.string()),
                               pa.field("sample_index", pa.int32()), pa.field("conversation_end", pa.string())])


RECORDS_5 = _records_5()


def make_tool_run(path: Path, parts: list[list[dict[str, Any]]], *, mode: str = "all_turns",
                  model: str = "moonshotai/Kimi-K2.5", generation: dict[str, Any] | None = None) -> RunDir:
    run = RunDir(path)
    run.create()
    run.write_manifest({"schema_version": 5, "fingerprint": "fp-tools", "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": model, "mode": mode,
                                       "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64},
                                       **(generation or {})}})
    for rows in parts:
        run.write_part(run.data, pa.Table.from_pylist(rows, schema=RECORDS_5))
    return run
