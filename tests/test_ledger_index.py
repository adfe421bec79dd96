"""The ledger index (store/ledger_index.py): a resume that reads segments reads the same ledger as one that reads
every part, and any segment that does not match the parts it names is passed over, never believed. Its failure
points (each I/O call faulted, SIGKILLed) are enumerated in tests/test_enumerated_faults.py ("index segment")."""
from __future__ import annotations

import io
import logging
import shutil
import uuid
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

import pytest

from pipeline.core.errors import StorageError
from pipeline.store import schema, storage
from pipeline.store.committer import Committer
from pipeline.store.faults import Faults
from pipeline.store.ledger_index import PARTS_KEY, SEGMENT_RE, PartUnits, index_folder, units_of, write_segment
from pipeline.store.rundir import RunDir
from tests.storage_scenarios import failure, record


def sampled(pid: str, sample: int, turns: int = 1) -> list[dict]:
    """One unit: sample `sample` of a prompt, with `turns` rows (all_turns keeps a row per regenerated turn)."""
    return [{**record(pid), "sample_index": sample, "turn_index": t, "n_turns": turns} for t in range(turns)]


def truth(run: RunDir) -> list[str]:
    """The ledger as the parts hold it: each row's unit id, read from every part whole."""
    rows = [row for part in run.parts(run.data) for row in part.read_parquet().to_pylist()]
    return sorted(r["prompt_id"] + (f"#s{r['sample_index']}" if r.get("sample_index") else "") for r in rows)


def commit_parts(run: RunDir, n: int, every: int, start: int = 0, unindexed=None) -> Committer:
    """`n` parts of one to three units each (samples, several turns), a segment every `every` parts."""
    committer = Committer(run, set(), 1000, 3600, unindexed=unindexed)
    committer.index["records"].every = every
    for k in range(start, start + n):
        committer.add_records(sampled(f"p{k}", 0, turns=1 + k % 3))
        if k % 2:
            committer.add_records(sampled(f"p{k}", 1))
        committer.flush()
    return committer


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    return run


def test_a_ledger_read_from_segments_equals_the_parts(run):
    commit_parts(run, 10, every=4)
    names = [p.name for p in index_folder(run.data).iterdir()]
    assert len(names) == 2 and all(SEGMENT_RE.match(name) for name in names), names
    read = run.ledger(run.data)
    assert (read.segments, read.covered, len(read.unindexed)) == (2, 8, 2)
    assert sorted(read.ids.to_pylist()) == truth(run)  # every row, as often as the parts have it
    assert any("#s1" in unit for unit in read.ids.to_pylist())


def test_the_parts_a_resume_read_one_by_one_go_into_its_first_segment(run):
    commit_parts(run, 3, every=100)  # no segment: a run killed before its 100th part
    first = run.ledger(run.data)
    assert (first.segments, len(first.unindexed)) == (0, 3)
    commit_parts(run, 2, every=5, start=3, unindexed={run.data.name: first.unindexed})
    second = run.ledger(run.data)
    assert (second.segments, second.covered, len(second.unindexed)) == (1, 5, 0)
    assert sorted(second.ids.to_pylist()) == truth(run)


def _spoil_missing_part(run, segment):
    run.parts(run.data)[1].unlink()


def _spoil_part_size(run, segment):
    part = run.parts(run.data)[0]
    table = part.read_parquet()
    part.unlink()
    part.write_parquet_atomic(table.slice(0, 1))  # the same name, fewer rows: a part rewritten by hand


def _spoil_torn_segment(run, segment):
    segment.write_atomic(segment.read_bytes()[:100])


def _spoil_no_parts_listed(run, segment):
    segment.write_parquet_atomic(segment.read_parquet().replace_schema_metadata({}))


def _spoil_overlap(run, segment):
    """A second segment over two of the same parts, read first (its name sorts first): the first segment overlaps
    it and is passed over, its other parts read one by one."""
    parts = run.parts(run.data)[:2]
    write_segment(run.data, [PartUnits(p.name, units_of(p.read_parquet())) for p in parts])


@pytest.mark.parametrize("spoil", [_spoil_missing_part, _spoil_part_size, _spoil_torn_segment,
                                   _spoil_no_parts_listed, _spoil_overlap])
def test_a_segment_that_does_not_match_its_parts_is_passed_over(run, spoil, caplog):
    commit_parts(run, 4, every=4)
    [segment] = index_folder(run.data).iterdir()
    spoil(run, segment)
    with caplog.at_level(logging.INFO, logger="regen"):
        read = run.ledger(run.data)
    assert sorted(read.ids.to_pylist()) == truth(run)
    assert read.passed_over, "a spoiled segment was used"
    assert any("passed over" in r.getMessage() for r in caplog.records)


def test_a_failed_segment_write_leaves_the_commit_and_the_ledger_as_they_are(run, caplog):
    committer = commit_parts(run, 1, every=2)
    committer.add_records(sampled("last", 0))
    storage.arm(Faults(1, "ENOSPC", persistent=True, where="/index/"))
    try:
        with caplog.at_level(logging.WARNING, logger="regen"):
            committer.flush()
    finally:
        storage.arm(None)
    assert "last" in truth(run), "the part was not committed"
    assert any("could not write a segment" in r.getMessage() for r in caplog.records)
    read = run.ledger(run.data)
    assert (read.segments, sorted(read.ids.to_pylist())) == (0, truth(run))


def test_failures_are_indexed_as_records_are(run):
    committer = Committer(run, set(), 1000, 3600)
    committer.index["failures"].every = 2
    for pid in ("f0", "f1", "f2"):
        committer.add_failure(failure(pid))
        committer.flush()
    read = run.ledger(run.failures)
    assert (read.segments, read.covered, sorted(read.ids.to_pylist())) == (1, 2, ["f0", "f1", "f2"])


def test_on_an_object_store_each_part_read_one_by_one_keeps_its_own_units(object_store):
    """On S3 the parts are read in one dataset scan: each part's unit ids must still be its own (the segment the
    committer writes from them names each part with its units)."""
    run = RunDir(object_store(f"ledger-index-{uuid.uuid4().hex[:8]}"))
    commit_parts(run, 5, every=2)
    read = run.ledger(run.data)
    assert (read.segments, read.covered, len(read.unindexed)) == (2, 4, 1)
    assert sorted(read.ids.to_pylist()) == truth(run)
    for segment in index_folder(run.data).iterdir():
        segment.unlink()
    for part in run.ledger(run.data).unindexed:
        own = sorted(units_of((run.data / part.name).read_parquet()).to_pylist())
        assert sorted(part.ids.to_pylist()) == own, part.name


# --- found by a review that set out to break the index --------------------------------------------------------

def commit(run: RunDir, pids: list[str], every: int) -> Committer:
    """One part per prompt id; a segment every `every` parts."""
    committer = Committer(run, set(), 1000, 3600)
    committer.index["records"].every = every
    for pid in pids:
        committer.add_records([record(pid)])
        committer.flush()
    return committer


def part_bytes(pid: str) -> bytes:
    """A part of one record, as the committer writes it."""
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([record(pid)], schema=schema.RECORDS), sink, compression="zstd")
    return sink.getvalue()


# --- 1. a part rewritten at the same size: its segment is believed (lost + doubled) ---------------------------

def test_a_part_rewritten_at_the_same_size_is_read_from_the_part_not_from_its_segment(run):
    """The segment's only check is (name, size). A part rewritten by hand (or restored from another copy) under
    its own name at the same byte size keeps its segment valid: the resume takes the old unit ids, so the prompt
    the part no longer holds is skipped (lost) and the one it now holds is run again (doubled)."""
    commit(run, ["aaaa0", "aaaa1"], every=2)  # one segment over both parts
    part = run.parts(run.data)[1]
    size = part.size()
    data = next((b for pid in ("bbbb1", "aaab1", "zzzz1", "aaaa9", "baaa1", "abaa1")
                 if len(b := part_bytes(pid)) == size and pid != "aaaa1"), None)
    assert data is not None, "could not rewrite the part at its own size"
    part.unlink()
    part.write_atomic(data)
    assert part.size() == size and "aaaa1" not in truth(run)
    read = run.ledger(run.data)
    assert sorted(read.ids.to_pylist()) == truth(run), (
        f"index used ({read.segments} segment): aaaa1 is taken as committed (lost), the part's own prompt "
        "would run again (doubled)")


# --- 2. an index folder that cannot be listed stops the resume ----------------------------------------------

def _index_not_a_directory(run: RunDir) -> None:
    shutil.rmtree(index_folder(run.data).path)
    with open(index_folder(run.data).path, "w") as f:
        f.write("not a folder")


def _index_list_fails(run: RunDir) -> None:
    storage.arm(Faults(1, "EIO", ops=frozenset({"list"}), where="/index/"))


@pytest.mark.parametrize("spoil", [_index_not_a_directory, _index_list_fails])
def test_an_index_folder_that_cannot_be_listed_is_passed_over_not_fatal_to_a_resume(run, spoil):
    """Derived data 'safe to delete', whose unreadable segments are passed over: a listing of index/data that
    fails (a transient EIO or an S3 5xx on that prefix, or index/data not a folder) raises out of read_ledger
    (and cleanup_temp), so the resume fails though every part is readable."""
    commit(run, ["p0", "p1", "p2"], every=2)
    spoil(run)
    try:
        ids = sorted(run.ledger(run.data).ids.to_pylist())
        run.cleanup_temp()
    except StorageError as exc:
        pytest.fail(f"the resume fails on the index: {exc}")
    finally:
        storage.arm(None)
    assert ids == ["p0", "p1", "p2"]


# --- 3. a segment that reads as Parquet but is not what the committer writes raises out of the resume --------

@pytest.mark.parametrize("listed,column", [
    (lambda parts: [[p.name, None] for p in parts], pa.array(["p0", "p1"])),
    (lambda parts: [1, 2], pa.array(["p0", "p1"])),
    (lambda parts: [[p.name, *p.parent.entry_stamps()[p.name]] for p in parts], pa.array([["p0"], ["p1"]])),
], ids=["null size", "not pairs", "unit_id not strings"])
def test_a_segment_with_an_unexpected_footer_or_column_is_passed_over(run, listed, column):
    commit(run, ["p0", "p1"], every=100)  # no segment of the committer's
    parts = run.parts(run.data)
    where = index_folder(run.data)
    where.mkdir()
    table = pa.table({"unit_id": column}).replace_schema_metadata({PARTS_KEY: orjson.dumps(listed(parts))})
    pq.write_table(table, (where / "segment-000001-000002-0123abcd.parquet").path)
    read = run.ledger(run.data)  # raises TypeError / ArrowNotImplementedError
    assert sorted(read.ids.to_pylist()) == ["p0", "p1"] and read.passed_over


# --- 4. memory: the parts read one by one stay allocated for the whole session -------------------------------

def test_the_pending_scan_holds_no_arrow_memory_per_committed_unit(tmp_path):
    """pending_scan: 'a few bytes per pending unit'; it deletes the ledger read and releases the pool. But
    scan.unindexed keeps every part read one by one (slices of one array of the folder's unit ids), and
    dispatch_started keeps `scan` for the session: after an upgrade, the whole ledger (1M: tens of MB) is held
    for the run's whole life, even after the committer has written it into a segment."""
    from pipeline.run import pending_scan
    from tests.test_pending_scan import prompt_set

    run = RunDir(tmp_path / "run")
    run.create()
    reader = prompt_set(tmp_path)  # 500 prompts, none committed
    n, per_part = 20_000, 500
    for start in range(0, n, per_part):
        ids = [f"{k:032x}" for k in range(start, start + per_part)]
        run.write_part(run.data, pa.Table.from_pylist([record(i) for i in ids]))
    cfg = SimpleNamespace(samples_per_prompt=1, prefix_affinity_chars=0)
    opts = SimpleNamespace(retry_failures=False)
    before = pa.total_allocated_bytes()
    scan = pending_scan(cfg, opts, run, reader)
    committer = Committer(run, set(), 1000, 3600, unindexed=scan.unindexed)
    committer.index["records"].every = 2  # 40 carried parts + 1: write the segment now
    committer.add_records([record("new")])
    committer.flush()  # the carried parts are now in a segment
    assert index_folder(run.data).iterdir()  # segments of 2 parts, the last part waiting
    del committer
    held = pa.total_allocated_bytes() - before
    assert held < 100_000, f"{held} bytes of Arrow memory held by the scan for {n} committed units"


# --- 5. the first segment of a resume covers every part it read one by one, however many -------------------

def test_a_segment_covers_at_most_every_parts_even_with_a_carried_backlog(run):
    """'each with the unit ids of up to 128 parts' (scale.md: 'each holding the unit ids of 128 parts'; the scale
    bench lays the index out so). The carried parts are all put in the first segment: a run of 1,760 parts
    resumed for the first time with the index writes one segment of 1,761 parts (a million ids, compressed and
    written synchronously inside the first commit), not 13 of 128."""
    commit(run, [f"p{k}" for k in range(10)], every=1000)  # no segment yet (a run from before the index)
    carried = run.ledger(run.data).unindexed
    assert len(carried) == 10
    committer = Committer(run, set(), 1000, 3600, unindexed={run.data.name: carried})
    committer.index["records"].every = 4
    committer.add_records([record("new")])
    committer.flush()
    covered = [len(orjson.loads(s.parquet_schema().metadata[PARTS_KEY])) for s in index_folder(run.data).iterdir()]
    assert covered and max(covered) <= 4, f"segments cover {covered} parts, every = 4"
