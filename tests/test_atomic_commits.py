"""A commit happens once or not at all: hidden parts that can never share a name, an exclusive commit that never
replaces a file (POSIX and S3), a flush whose outcome is unknown resolved by looking (never committed twice, a
committed part never deleted on a failed read), an interrupt or a signal during a commit, a hard link whose reply
was lost, a filesystem without hard links."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core import errors
from pipeline.core.errors import StorageError
from pipeline.hidden.parts import HiddenPartWriter, hidden_parts, read_sample
from pipeline.store import seam, storage
from pipeline.store.committer import Committer
from pipeline.store.faults import Faults
from pipeline.store.rundir import RunDir, now_utc
from pipeline.store.storage import Location
from tests.helpers import data_parts
from tests.storage_scenarios import NEW, DataCommit


def sample(seed: int, n_tokens: int = 6, width: int = 8):
    rng = np.random.default_rng(seed)
    return (list(range(n_tokens)), 2, rng.integers(0, 2**16, size=(n_tokens, width), dtype=np.uint16))


def record(pid: str) -> dict:
    return {"prompt_id": pid, "turn_index": 0, "source": "s", "messages": [{"role": "user", "content": "q"}],
            "content": "a", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
            "created_at": now_utc()}


def fail_folder_fsync_once(monkeypatch, error: BaseException) -> None:
    """The folder fsync comes right after the rename: a failure there leaves the part committed."""
    fault = "EIO" if isinstance(error, OSError) else "interrupt"
    monkeypatch.setattr(seam, "_armed", Faults(1, fault, ops=frozenset({"fsync_dir"})))


def committed_rows(run: RunDir) -> list[str]:
    return [pid for part in data_parts(Path(run.path)) for pid in
            pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()]


@pytest.fixture(params=["posix", "s3"])
def any_run_dir(request, tmp_path):
    where = str(tmp_path / "run") if request.param == "posix" else request.getfixturevalue("object_store")("run")
    run = RunDir(where)
    run.create()
    return run


def committed_everywhere(run: RunDir) -> list[str]:
    return [pid for part in run.parts(run.data) for pid in part.read_parquet(columns=["prompt_id"]).column(0).to_pylist()]


def test_two_samples_of_one_actor_never_share_a_part(tmp_path, monkeypatch):
    """The actor made one writer per sample. Its counter was always 1, and only 32 random bits told the parts
    apart; here those bits collide (as they do, at 88K samples, with a 59% chance on one endpoint)."""
    run = RunDir(tmp_path / "run")
    run.create()
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))
    written = {}
    for pid, seed in (("a" * 32, 1), ("b" * 32, 2)):
        writer = HiddenPartWriter(run, tag="sglang-00:30000")
        tokens, n_prompt, hidden = sample(seed)
        writer.add(pid, 0, tokens, n_prompt, hidden)
        part, rows = writer.commit()
        written[pid] = (part, rows[(pid, 0)], hidden)
    assert len({part for part, _, _ in written.values()}) == 2
    assert len(hidden_parts(run)) == 2
    for pid, (part, row, hidden) in written.items():
        stored = read_sample(run.path / "hidden" / part, row)
        assert stored.prompt_id == pid and np.array_equal(stored.hidden.view(np.uint16), hidden)


def test_a_restarted_actor_retrying_a_sample_takes_the_next_name(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    names = []
    for seed in (1, 2):  # two incarnations of one actor, each with its counter at 1, writing the same sample
        writer = HiddenPartWriter(run, tag="e0")
        writer.add("p" * 32, 3, *sample(seed))
        names.append(writer.commit()[0])
    stem = names[0].rsplit("-", 1)[0]
    assert stem.startswith("part-e0") and stem.endswith(f"-{'p' * 32}-3")
    assert names == [f"{stem}-000001.parquet", f"{stem}-000002.parquet"]
    first = read_sample(run.path / "hidden" / names[0], 0)
    assert np.array_equal(first.hidden.view(np.uint16), sample(1)[2]), "the first part is untouched"


def test_an_exclusive_commit_never_replaces_a_file_posix_and_s3(tmp_path, object_store):
    for where in (Location.at(tmp_path / "part-1.parquet"), Location.at(object_store("excl")) / "part-1.parquet"):
        where.parent.mkdir()
        where.write_atomic(b"first", exclusive=True)
        with pytest.raises(errors.PartExists):
            where.write_atomic(b"second", exclusive=True)
        assert where.read_bytes() == b"first"
    assert [p.name for p in Path(tmp_path).iterdir()] == ["part-1.parquet"], "no temporary file is left"


@pytest.mark.parametrize("error", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()],
                         ids=["EIO-after-rename", "second-signal-after-rename"])
def test_a_flush_failing_after_its_rename_commits_once(tmp_path, monkeypatch, error):
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60)
    for pid in "abcde":
        committer.add_records([record(pid)])
    fail_folder_fsync_once(monkeypatch, error)
    with pytest.raises((StorageError, KeyboardInterrupt)):
        committer.flush()
    committer.add_records([record("f")])  # more work arrives before the salvage flush
    committer.flush()  # what the run does next: salvage, or the next flush
    assert sorted(committed_rows(run)) == list("abcdef")
    assert committer.records == [] and committer.buffered == set() and committer.committed == 6
    assert not committer.add_records([record("a")]), "a settled prompt is a duplicate"


def test_a_flush_failing_before_its_rename_commits_nothing_and_retries(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60)
    committer.add_records([record("a")])
    monkeypatch.setattr(seam, "_armed", Faults(1, "ENOSPC", ops=frozenset({"write"})))
    with pytest.raises(StorageError, match="no space left"):
        committer.flush()
    assert committed_rows(run) == [] and len(committer.records) == 1
    monkeypatch.setattr(seam, "_armed", None)
    committer.flush()
    assert committed_rows(run) == ["a"] and committer.records == []


@pytest.fixture
def disarmed():
    storage.arm(None)
    yield
    storage.arm(None)


@pytest.mark.usefixtures("disarmed")
def test_a_read_error_while_looking_never_deletes_a_committed_part(tmp_path):
    """A flush whose folder fsync fails looks for its part; if reading the part back fails too, the part is
    committed all the same: it must stay (the outcome is still unknown), not be deleted as if it were torn."""

    def calls(plan: Faults) -> list[str]:
        scenario, run = DataCommit(), RunDir(tmp_path / f"probe-{plan.at}")
        scenario.prepare(run)
        storage.arm(plan)
        with contextlib.suppress(StorageError):
            scenario.committer.flush()
        storage.arm(None)
        return [op for op, _ in plan.calls]

    fsync_dir = calls(Faults(10**6, "EIO")).index("fsync_dir") + 1  # a probe: counts the calls, faults none
    looked = calls(Faults(fsync_dir, "EIO"))
    read_back = fsync_dir + looked[fsync_dir:].index("read") + 1  # the look: stat, then the footer

    scenario, run = DataCommit(), RunDir(tmp_path / "run")
    scenario.prepare(run)
    storage.arm(Faults(fsync_dir, "EIO", also_at=frozenset({read_back})))
    with pytest.raises(StorageError) as err:
        scenario.committer.flush()
    storage.arm(None)
    assert err.value.maybe_committed, "the outcome is unknown"
    parts = run.parts(run.data)
    assert len(parts) == 2, "the committed part is kept"
    assert sorted(parts[-1].read_parquet(columns=["prompt_id"]).column(0).to_pylist()) == NEW
    scenario.committer.flush()  # the next flush looks again, finds it, and writes nothing twice
    assert run.parts(run.data) == parts and scenario.committer.records == []
    scenario.check(run)


def test_an_interrupt_between_write_and_commit_leaves_nothing_and_commits_once(any_run_dir, monkeypatch):
    """A KeyboardInterrupt after the bytes are written and before the rename (POSIX) or the upload's completion
    (S3): on S3 the dropped stream used to complete the upload later, so the salvage flush committed twice."""
    committer = Committer(any_run_dir, done=set(), flush_records=100, flush_interval_s=60)
    for pid in "abc":
        committer.add_records([record(pid)])
    from pipeline.store.faults import Faults

    previous = storage.arm(Faults(1, "interrupt", ops=frozenset({"link", "rename", "copy"}), where="/data/part-"))
    try:
        with pytest.raises(KeyboardInterrupt):
            committer.flush()
    finally:
        storage.arm(previous)
    assert committed_everywhere(any_run_dir) == [], "nothing was committed, and no empty part is listed"
    committer.flush()  # the salvage flush
    assert sorted(committed_everywhere(any_run_dir)) == ["a", "b", "c"]


def test_a_signal_during_a_commit_waits_until_the_buffer_is_settled(tmp_path, monkeypatch):
    """A real SIGINT delivered in the middle of a commit (the driver's second Ctrl-C raises KeyboardInterrupt)."""
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60)
    for pid in "abc":
        committer.add_records([record(pid)])
    real_io = storage._io

    def sigint_at_publish(op: str, path: str) -> bool:
        if op in ("link", "rename", "copy") and "/data/part-" in path:
            os.kill(os.getpid(), signal.SIGINT)
        return real_io(op, path)

    monkeypatch.setattr(storage, "_io", sigint_at_publish)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            committer.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert committer.records == [] and committer.buffered == set(), "settled before the interrupt was raised"
    committer.flush()
    assert sorted(committed_rows(run)) == ["a", "b", "c"]


def test_a_hard_link_whose_reply_was_lost_counts_as_committed(tmp_path, monkeypatch):
    """NFS: the server made the link, the reply was lost, the retried link says EEXIST."""
    real_link = os.link

    def link_then_eexist(src, dst):
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    monkeypatch.setattr(storage.os, "link", link_then_eexist)
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60)
    committer.add_records([record("a")])
    committer.flush()
    committer.flush()
    assert committed_rows(run) == ["a"] and committer.records == []


def test_a_filesystem_without_hard_links_still_commits(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(storage.os, "link", no_links)
    where = Location.at(tmp_path / "part-1.parquet")
    where.write_atomic(b"first", exclusive=True)
    with pytest.raises(errors.PartExists):
        where.write_atomic(b"second", exclusive=True)
    assert where.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["part-1.parquet"]


def test_writer_tags_keep_labels_apart():
    from pipeline.hidden.parts import _sanitize_tag

    long_host = "gpu-node-017.us-east-1.compute.internal"
    tags = {_sanitize_tag(label) for label in (f"{long_host}:30000", f"{long_host}:30001", "sglang-0:30000",
                                               "sglang0:30000")}
    assert len(tags) == 4 and all(len(t) <= 32 and t.isalnum() for t in tags)
