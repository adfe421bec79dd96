"""The ledger index (store/ledger_index.py): a resume that reads segments reads the same ledger as one that reads
every part, and any segment that does not match the parts it names is passed over, never believed. Its failure
points (each I/O call faulted, SIGKILLed) are enumerated in tests/test_enumerated_faults.py ("index segment")."""
from __future__ import annotations

import logging
import uuid

import pytest

from pipeline.store import storage
from pipeline.store.committer import Committer
from pipeline.store.faults import Faults
from pipeline.store.ledger_index import SEGMENT_RE, PartUnits, index_folder, units_of, write_segment
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
    write_segment(run.data, [PartUnits(p.name, p.size(), units_of(p.read_parquet())) for p in parts])


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
