"""A run keeps the record schema it was created with: a run from schema 1 resumed by newer code gets no parts with
columns it lacks, so every part of the run loads as one table (invariant 8)."""
from __future__ import annotations

from pathlib import Path

import datasets

from pipeline.store import schema
from pipeline.store.committer import Committer
from pipeline.store.rundir import RunDir, now_utc


def record(pid: str) -> dict:
    return {"prompt_id": pid, "turn_index": 0, "source": "s", "messages": [{"role": "user", "content": "q"}],
            "content": "a", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
            "deterministic": True, "created_at": now_utc()}


def test_a_schema_1_run_resumed_by_newer_code_loads_as_one_table(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    v1 = schema.records_schema(1)
    assert "deterministic" not in v1.names and "deterministic" in schema.records_schema(schema.SCHEMA_VERSION).names
    assert schema.records_schema(None) == v1, "a run.json without schema_version is a schema-1 run"
    for batch in ("ab", "cd"):  # the first part as older code wrote it, the second by this code resuming it
        committer = Committer(run, done=run.committed_ids(), flush_records=100, flush_interval_s=60,
                              records_schema=v1)
        for pid in batch:
            committer.add_records([record(pid)])
        committer.flush()
    parts = [str(p) for p in run.parts(run.data)]
    table = datasets.load_dataset("parquet", data_files=parts, split="train",
                                  cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(table["prompt_id"]) == ["a", "b", "c", "d"] and "deterministic" not in table.column_names
    assert Path(parts[0]).exists()
