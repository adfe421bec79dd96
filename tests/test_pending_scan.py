"""The pending scan of a resume, done in Arrow (the ledger as arrays of unit ids, looked up in one pass over the id
column) gives exactly what the straightforward loop over every unit gives: the same units, in the same order, with
the same rows and routing keys, and the same counts, for committed, failed and multi-sample units, with and without
--retry-failures. The ledger is read from real parts written by the store's own code."""
from __future__ import annotations

import hashlib
import random
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.work import affinity_key, unit_id
from pipeline.prompts.tool_calls import message_from_row
from pipeline.store import prompt_reader, schema
from pipeline.store.prompt_reader import PendingPrompt, PendingScan, PromptSetReader
from pipeline.store.rundir import RunDir
from pipeline.store.storage import Location

PROMPTS = 500
STORED_CHARS = 64


def prompt_set(folder: Path) -> PromptSetReader:
    """PROMPTS prompts in row groups of 37, their routing keys stored for STORED_CHARS; a few with tools."""
    rows = []
    for i in range(PROMPTS):
        pid = hashlib.sha256(str(i).encode()).hexdigest()[:32]
        messages = [{"role": "system", "content": f"system {i % 4} " * 5}, {"role": "user", "content": f"ask {i}"}]
        tools = '[{"type":"function","function":{"name":"f"}}]' if i % 7 == 0 else None
        key = affinity_key([message_from_row(m) for m in messages], STORED_CHARS,
                           None if tools is None else tools.encode())
        rows.append({"prompt_id": pid, "source": "s", "origin": f"o:{i}", "messages": messages, "tools": tools,
                     "route_key": key})
    path = folder / "prompts-000001.parquet"
    table = pa.Table.from_pylist(rows, schema=prompt_reader.route_schema(schema.PROMPTS, STORED_CHARS))
    pq.write_table(table, path, row_group_size=37)
    return PromptSetReader(Location.at(path))


def reference_scan(reader: PromptSetReader, committed: set[str], failed: set[str], skip_failed: bool,
                   affinity_chars: int, samples: int) -> PendingScan:
    """Every unit of every prompt, one at a time."""
    table = pq.read_table(reader.where.path)
    scan = PendingScan([], 0, 0, 0)
    for position, row in enumerate(table.to_pylist()):
        key = 0 if affinity_chars == 0 else affinity_key(
            [message_from_row(m) for m in row["messages"]], affinity_chars,
            None if row["tools"] is None else row["tools"].encode())
        for j in range(samples):
            unit = unit_id(row["prompt_id"], j)
            scan.total += 1
            if unit in committed:
                scan.done += 1
                continue
            if unit in failed:
                scan.failed += 1
                if skip_failed:
                    continue
            scan.waiting += 1
            scan.pending.append(PendingPrompt(unit, position, key))
    return scan


def write_ledger(run: RunDir, records: list[tuple[str, int]], failures: list[str]) -> None:
    """Records (prompt id, sample index; all_turns-like: some units have two rows) and failure rows (unit ids), in
    parts of 50 rows as the committer writes them."""
    now = datetime.now(timezone.utc)
    records_schema = schema.RECORDS
    for start in range(0, len(records), 50):
        chunk = records[start:start + 50]
        cols = {"prompt_id": pa.array([p for p, _ in chunk]), "sample_index": pa.array([j for _, j in chunk],
                                                                                        pa.int32()),
                "created_at": pa.array([now] * len(chunk), pa.timestamp("ms", tz="UTC"))}
        run.write_part(run.data, pa.Table.from_arrays(
            [cols[f.name] if f.name in cols else pa.nulls(len(chunk), f.type) for f in records_schema],
            schema=records_schema))
    if failures:
        run.write_part(run.failures, pa.Table.from_pylist(
            [{"prompt_id": unit, "error_class": "terminal", "created_at": now} for unit in failures],
            schema=schema.FAILURES))


@pytest.mark.parametrize("samples", [1, 3])
def test_the_arrow_pending_scan_matches_the_unit_by_unit_loop_for_committed_failed_and_sampled_units(tmp_path,
                                                                                                   samples):
    reader = prompt_set(tmp_path)
    ids = pq.read_table(reader.where.path, columns=["prompt_id"]).column(0).to_pylist()
    rng = random.Random(samples)
    records: list[tuple[str, int]] = []
    for pid in ids:
        for j in range(samples):
            if rng.random() < 0.6:
                records += [(pid, j)] * rng.choice([1, 1, 2])  # two rows: the turns of one all_turns unit
    records.append(("f" * 32, 0))  # a prompt that vanished from the set keeps its record
    rng.shuffle(records)
    failures = [unit_id(pid, j) for pid in ids for j in range(samples) if rng.random() < 0.15]
    run = RunDir(tmp_path / "run")
    run.create()
    write_ledger(run, records, failures)
    committed = {unit_id(p, j) for p, j in records}
    assert run.committed_ids() == committed and run.failed_ids() == set(failures)
    failed_only = set(failures) - committed
    assert failed_only and set(failures) & committed, "some failures were committed later, some were not"

    for skip_failed in (True, False):  # --retry-failures: skip_failed False
        for chars in (0, STORED_CHARS, 16):  # none; the stored keys; keys computed from the messages
            expected = reference_scan(reader, committed, failed_only, skip_failed, chars, samples)
            assert expected.pending and expected.done and expected.failed
            from_ledger = reader.pending(run.committed_units(), run.failed_units(), skip_failed, chars,
                                         samples=samples)
            from_sets = reader.pending(committed, set(failures), skip_failed, chars, samples=samples)
            for scan in (from_ledger, from_sets):
                assert scan.pending == expected.pending, (skip_failed, chars)
                assert (scan.total, scan.done, scan.failed, scan.waiting) == (
                    expected.total, expected.done, expected.failed, expected.waiting), (skip_failed, chars)
            counted = reader.pending(run.committed_units(), run.failed_units(), skip_failed, chars, listed=False,
                                     samples=samples)
            assert counted.pending == [] and (counted.total, counted.done, counted.failed, counted.waiting) == (
                expected.total, expected.done, expected.failed, expected.waiting)


def test_an_empty_ledger_leaves_every_unit_pending_and_a_complete_one_none(tmp_path):
    reader = prompt_set(tmp_path)
    run = RunDir(tmp_path / "run")
    run.create()
    scan = reader.pending(run.committed_units(), run.failed_units(), True, STORED_CHARS, samples=2)
    assert scan.pending == reference_scan(reader, set(), set(), True, STORED_CHARS, 2).pending
    assert (scan.total, scan.done, scan.waiting) == (2 * PROMPTS, 0, 2 * PROMPTS)
    ids = pq.read_table(reader.where.path, columns=["prompt_id"]).column(0).to_pylist()
    write_ledger(run, [(pid, j) for pid in ids for j in range(2)], [])
    scan = reader.pending(run.committed_units(), run.failed_units(), True, STORED_CHARS, samples=2)
    assert scan.pending == [] and (scan.total, scan.done, scan.waiting) == (2 * PROMPTS, 2 * PROMPTS, 0)


@pytest.mark.parametrize("statistics", [True, False])
def test_a_set_has_tools_when_one_prompt_of_a_late_row_group_has_them_with_or_without_footer_statistics(
        tmp_path, statistics):
    def written(tools_at: int | None) -> PromptSetReader:
        rows = [{"prompt_id": f"{i:032x}", "messages": [{"role": "user", "content": f"ask {i}"}],
                 "tools": '[{"type":"function","function":{"name":"f"}}]' if i == tools_at else None}
                for i in range(100)]
        path = tmp_path / f"prompts-{tools_at}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema.PROMPTS), path, row_group_size=10,
                       write_statistics=statistics)
        return PromptSetReader(Location.at(path))

    assert written(97).has_tools() and written(0).has_tools()
    assert not written(None).has_tools()
