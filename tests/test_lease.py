"""The run lease on an object store (lock.json): a driver whose lease was taken over (on renewal, or between
renewals) or ran out commits nothing more; a lease lost while salvaging keeps the error that stopped the run; a
failed read of the lease at commit time is retried within its slack. Single faults are enumerated in
tests/test_enumerated_faults.py; these need two."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import orjson
import pytest

from pipeline.core.errors import LeaseLost, RunLocked, StorageError
from pipeline.store import storage
from pipeline.store.committer import Committer
from pipeline.store.faults import Faults
from pipeline.store.lock import RunLock
from pipeline.store.rundir import RunDir
from pipeline.store.storage import Location
from tests.storage_scenarios import NEW, record


@pytest.fixture(autouse=True)
def disarmed():
    storage.arm(None)
    yield
    storage.arm(None)


def buffered_committer(run: RunDir, lock: RunLock) -> Committer:
    committer = Committer(run, set(), 100, 3600, lock=lock)
    for pid in NEW:
        committer.add_records([record(pid)])
    return committer


def test_a_driver_whose_lease_was_taken_over_commits_nothing(object_store):
    """The lease holder finds another driver's lease on renewal: it stops like SIGTERM, and its final flush
    (run.py commits the buffer on the way out) must not commit: the new holder owns those prompts now."""
    run = RunDir(Location.at(object_store("lease-taken")) / "run")
    lost = threading.Event()
    lock = RunLock(run, on_lost=lost.set, lease_s=30, renew_s=0.1, settle_s=0).acquire()
    try:
        committer = buffered_committer(run, lock)
        usurper = {"pid": 1, "host": "gpu-node-9", "owner": "u" * 32, "since": "x", "expires": time.time() + 60}
        (run.path / "lock.json").write_atomic(orjson.dumps(usurper))
        assert lost.wait(10), "the holder notices"
        with pytest.raises(LeaseLost) as err:
            committer.flush()
        assert isinstance(err.value, RunLocked), "exit 4: the run directory is in use by another driver"
        assert run.parts(run.data) == [] and committer.buffered == set(NEW), "nothing committed"
    finally:
        lock.release()
    assert (orjson.loads((run.path / "lock.json").read_bytes()))["owner"] == "u" * 32, "the new lease stands"


def test_a_driver_whose_lease_ran_out_commits_nothing(object_store, monkeypatch):
    """Renewals that keep failing let the lease run out; another driver may then take the run over, so the
    holder must stop committing before that (less than one renewal period before the expiry)."""
    import pipeline.store.lock as lock_module

    run = RunDir(Location.at(object_store("lease-expired")) / "run")
    lost = threading.Event()
    lock = RunLock(run, on_lost=lost.set, lease_s=60, renew_s=3600, settle_s=0).acquire()  # never renewed
    try:
        committer = buffered_committer(run, lock)
        committer.flush()
        assert sorted(run.committed_ids()) == NEW, "a live lease commits"
        for pid in ("m0", "m1"):
            committer.add_records([record(pid)])
        # 50 s pass for the lock (only its clock: the store's signatures keep the real time): past the margin it
        # keeps before the expiry (a quarter of the lease), though the lease itself still runs 10 s
        monkeypatch.setattr(lock_module, "time", SimpleNamespace(time=lambda: time.time() + 50,
                                                                 monotonic=time.monotonic, sleep=time.sleep))
        with pytest.raises(LeaseLost):
            committer.flush()
        assert sorted(run.committed_ids()) == NEW
    finally:
        lock.release()


def test_a_lease_taken_over_between_renewals_stops_the_next_commit(object_store):
    """Another driver writes its lease (it raced this one past SETTLE_S, or took over a lease it thought expired)
    and no renewal has run since. Before the fix check() never read lock.json: this driver kept committing the
    prompts the real holder commits too, until its next renewal (up to RENEW_S)."""
    run = RunDir(Location.at(object_store("lease-race")) / "run")
    lost = threading.Event()
    lock = RunLock(run, on_lost=lost.set, lease_s=3600, renew_s=3600, settle_s=0).acquire()  # no renewal runs
    try:
        committer = buffered_committer(run, lock)
        usurper = {"pid": 1, "host": "gpu-node-9", "owner": "u" * 32, "since": "x", "expires": time.time() + 60}
        (run.path / "lock.json").write_atomic(orjson.dumps(usurper))
        with pytest.raises(LeaseLost):
            committer.flush()
        assert run.parts(run.data) == [] and committer.buffered == set(NEW), "nothing committed"
        with pytest.raises(LeaseLost):
            lock.check()  # and stays lost
    finally:
        lock.release()
    assert (orjson.loads((run.path / "lock.json").read_bytes()))["owner"] == "u" * 32, "the new lease stands"


def test_a_lease_lost_while_salvaging_keeps_the_error_that_stopped_the_run(object_store, caplog):
    """The run stops on an error (here: no healthy endpoint), and the final flush finds the lease taken. Before
    the fix LeaseLost escaped salvage() and replaced that error (exit 4, not 1); the error must stay the run's,
    the lease loss is reported beside it, and nothing is committed or written to the new holder's run."""
    from pipeline.core.errors import RunFatal
    from pipeline.run import salvage
    from pipeline.store.progress import Progress

    run = RunDir(Location.at(object_store("lease-salvage")) / "run")
    lock = RunLock(run, on_lost=lambda: None, lease_s=3600, renew_s=3600, settle_s=0).acquire()
    try:
        committer = buffered_committer(run, lock)
        progress = Progress(run, total=len(NEW), already_done=0, failed_before=0, rejects=0)
        usurper = {"pid": 1, "host": "gpu-node-9", "owner": "u" * 32, "since": "x", "expires": time.time() + 60}
        (run.path / "lock.json").write_atomic(orjson.dumps(usurper))
        with pytest.raises(RunFatal, match="no healthy endpoint"):
            try:
                raise RunFatal("no healthy endpoint for 600s")
            except BaseException:
                salvage(committer, progress, "failed")
                raise
        assert "lease was taken over" in caplog.text, "the lease loss is reported too"
        assert run.parts(run.data) == [] and not (run.path / "status.json").exists()
    finally:
        lock.release()


def test_a_failed_read_of_the_lease_at_commit_time_is_retried_within_its_slack(object_store):
    """Before the fix one failed GET of lock.json (a burst of 5xx longer than the SDK's retries) in check() ended
    the run, where renewal tolerates the same failure for the lease's slack. Two failed reads: the part commits.
    Reads that keep failing stop it before the lease runs out, resumable (StorageError), nothing committed."""
    run = RunDir(Location.at(object_store("lease-read")) / "run")
    lock = RunLock(run, on_lost=lambda: None, lease_s=4, renew_s=3600, settle_s=0).acquire()  # no renewal runs
    try:
        committer = buffered_committer(run, lock)
        storage.arm(Faults(1, "EIO", ops=frozenset({"read"}), where="lock.json", also_at=frozenset({2})))
        committer.flush()
        storage.arm(None)
        assert sorted(run.committed_ids()) == NEW, "committed after the failed reads"
        for pid in ("m0", "m1"):
            committer.add_records([record(pid)])
        storage.arm(Faults(1, "EIO", persistent=True, ops=frozenset({"read"}), where="lock.json"))
        started = time.monotonic()
        with pytest.raises(StorageError) as err:
            committer.flush()
        storage.arm(None)
        assert not isinstance(err.value, LeaseLost)
        assert time.monotonic() - started < 4, "given up before the lease runs out"
        assert sorted(run.committed_ids()) == NEW and committer.buffered == {"m0", "m1"}, "nothing more committed"
    finally:
        lock.release()
