"""Run directories of tool-calling records (records schema 5), written with the store's own RunDir and real
Parquet."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.store import schema
from pipeline.store.rundir import RunDir


def make_tool_run(path: Path, parts: list[list[dict[str, Any]]], *, mode: str = "all_turns",
                  model: str = "moonshotai/Kimi-K2.5", generation: dict[str, Any] | None = None) -> RunDir:
    run = RunDir(path)
    run.create()
    run.write_manifest({"schema_version": schema.SCHEMA_VERSION, "fingerprint": "fp-tools",
                        "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": model, "mode": mode,
                                       "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64},
                                       **(generation or {})}})
    for rows in parts:
        run.write_part(run.data, pa.Table.from_pylist(rows, schema=schema.RECORDS))
    return run
