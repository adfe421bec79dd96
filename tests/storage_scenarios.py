"""The storage operations that tests/test_enumerated_faults.py runs once per I/O call, faulting the N-th.

Each scenario has: `prepare` (unfaulted: the state before the operation), `operate` (the faulted operation),
`after` (what the same process does next: the salvage flush, the retried sample; a persistent fault is still
there), `resume` (a fresh process: new objects built from what the store holds, the same inputs again) and
`check` (the invariants: nothing lost, nothing doubled, every committed file readable, no temporary file
left or mistaken for a part). `between` checks what a reader may see before the resume, where the resume
could hide it (a torn run.json, prompt set or status.json); a torn part would still be there for `check`.
Inputs are deterministic, so a resume after a SIGKILLed child (tests/storage_kill_child.py) re-adds the
same rows.
"""
from __future__ import annotations

import functools
import os
import threading
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from pipeline.core.errors import StorageError
from pipeline.hidden.parts import HiddenPartWriter, garbage_hidden_parts, hidden_dir, iter_hidden
from pipeline.store import schema
from pipeline.store.lock import RunLock
from pipeline.store.committer import Committer
from pipeline.store.ledger_index import SEGMENT_RE, index_folder
from pipeline.store.rundir import PART_RE, RunDir

CREATED = datetime(2026, 1, 1, tzinfo=timezone.utc)
PRIOR = ["p0", "p1"]  # committed before the operation
NEW = ["n0", "n1", "n2"]  # buffered when it runs


def record(pid: str) -> dict:
    return {"prompt_id": pid, "turn_index": 0, "n_turns": 1, "source": "s",
            "messages": [{"role": "user", "content": f"question {pid}"}], "content": f"answer {pid}",
            "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2, "created_at": CREATED}


def ledger_row(pid: str, part: str, row: int, n_tokens: int) -> dict:
    """A capture ledger row (schema.CAPTURE) naming its sample's hidden part."""
    return {"prompt_id": pid, "turn_index": 0, "sample_id": f"{pid}#turn0", "n_tokens": n_tokens, "n_prompt": 4,
            "finish_reason": "stop", "hidden_part": part, "hidden_row": row, "actor": "e0", "capture_s": 0.0,
            "capture_fingerprint": "fp", "created_at": CREATED}


def failure(pid: str) -> dict:
    return {"prompt_id": pid, "source": "s", "error_class": "TerminalForPrompt", "status": 400,
            "message": f"context overflow {pid}", "endpoint": "e0", "attempts": 1, "created_at": CREATED}


def create(run: RunDir) -> None:
    """The run's folders; an object store needs no folder markers to hold keys (and each costs requests)."""
    if run.path.local:
        run.create()


def part_rows(run: RunDir, folder) -> list[dict]:
    """Every row of every committed part, reading each part whole (a torn part raises)."""
    return [row for part in run.parts(folder) for row in part.read_parquet().to_pylist()]


def stray_files(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if not PART_RE.match(p.name)]


class Scenario:
    name = ""

    def prepare(self, run: RunDir) -> None:
        create(run)

    def operate(self, run: RunDir) -> object:
        raise NotImplementedError

    def after(self, run: RunDir) -> None:
        pass

    def between(self, run: RunDir) -> None:
        pass

    def resume(self, run: RunDir) -> None:
        pass

    def check(self, run: RunDir) -> None:
        raise NotImplementedError


class DataCommit(Scenario):
    """Committer.flush of records: the run's data commit."""

    name = "data commit"
    kind = "records"

    def add(self, committer: Committer, pid: str) -> None:
        committer.add_records([record(pid)])

    def folder(self, run: RunDir):
        return run.data

    def prepare(self, run: RunDir) -> None:
        create(run)
        first = Committer(run, set(), 100, 3600)
        for pid in PRIOR:
            self.add(first, pid)
        first.flush()
        self.committer = Committer(run, run.committed_ids() | run.failed_ids(), 100, 3600)
        for pid in NEW:
            self.add(self.committer, pid)

    def operate(self, run: RunDir) -> None:
        self.committer.flush()

    def after(self, run: RunDir) -> None:
        self.committer.flush()  # run.py's salvage, or simply the next flush

    def resume(self, run: RunDir) -> None:
        run = RunDir(run.path)
        run.cleanup_temp()
        committer = Committer(run, run.committed_ids() | run.failed_ids(), 100, 3600)
        for pid in PRIOR + NEW:
            self.add(committer, pid)
        committer.flush()

    def check(self, run: RunDir) -> None:
        rows = part_rows(run, self.folder(run))
        ids = sorted(row["prompt_id"] for row in rows)
        assert ids == sorted(PRIOR + NEW), f"committed {ids}: lost or doubled"
        expected = {pid: self.expected(pid) for pid in PRIOR + NEW}
        for row in rows:
            got = {k: row[k] for k in expected[row["prompt_id"]]}
            if got.get("messages"):  # schema 5 messages read back with their tool fields null
                got["messages"] = [{k: v for k, v in m.items() if v is not None} for m in got["messages"]]
            assert got == expected[row["prompt_id"]], row
        assert not stray_files(self.folder(run)), f"left in {self.folder(run)}: {stray_files(self.folder(run))}"
        other = run.failures if self.kind == "records" else run.data
        assert not run.parts(other), "a part in the wrong folder"

    def expected(self, pid: str) -> dict:
        row = record(pid)
        return {k: row[k] for k in ("prompt_id", "content", "messages")}


class FailureCommit(DataCommit):
    """Committer.flush of terminal failures."""

    name = "failure commit"
    kind = "failures"

    def add(self, committer: Committer, pid: str) -> None:
        committer.add_failure(failure(pid))

    def folder(self, run: RunDir):
        return run.failures

    def expected(self, pid: str) -> dict:
        row = failure(pid)
        return {k: row[k] for k in ("prompt_id", "message", "status")}


class IndexSegment(DataCommit):
    """A data commit that completes a ledger index segment (store/ledger_index.py): the part, then the segment
    covering it and the part committed before it. The resume and the check read the ledger through the index."""

    name = "index segment"

    def prepare(self, run: RunDir) -> None:
        create(run)
        first = Committer(run, set(), 100, 3600)
        self.add(first, PRIOR[0])
        first.flush()
        read = run.ledger(run.data)  # the part just committed: not in a segment yet
        self.committer = Committer(run, set(read.ids.to_pylist()), 100, 3600,
                                   unindexed={run.data.name: read.unindexed})
        self.committer.index["records"].every = 2  # this flush's part completes a segment
        for pid in PRIOR[1:] + NEW:
            self.add(self.committer, pid)

    def check(self, run: RunDir) -> None:
        super().check(run)
        from_parts = sorted(row["prompt_id"] for row in part_rows(run, run.data))
        assert sorted(run.committed_ids()) == sorted(set(from_parts)), "the index says other than the parts"
        index = index_folder(run.data)
        assert all(SEGMENT_RE.match(p.name) for p in index.iterdir()), f"left in {index}: {index.iterdir()}"


def hidden_samples() -> dict[str, tuple[list[int], int, np.ndarray]]:
    rng = np.random.default_rng(13)
    return {pid: (list(range(10 + i)), 4, rng.integers(0, 2**16, size=(10 + i, 24), dtype=np.uint16))
            for i, pid in enumerate(NEW[:2])}


class HiddenPart(Scenario):
    """A capture actor's HiddenPartWriter.commit, then the ledger rows that reference the part (the commit point).
    The run here is the capture's own run directory (RUN/capture: data/ its ledger, hidden/ its parts)."""

    name = "hidden part"

    def prepare(self, run: RunDir) -> None:
        create(run)
        self.counter = iter(range(1, 10**6))  # the actor's part counter
        self.writer = self.new_writer(run, self.counter)
        self.committed: tuple[str, dict] | None = None
        self.committer = Committer(run, set(), 100, 3600, schema.CAPTURE)

    @staticmethod
    def new_writer(run: RunDir, counter) -> HiddenPartWriter:
        writer = HiddenPartWriter(run, tag="e0", counter=counter)
        for pid, (tokens, n_prompt, hidden) in hidden_samples().items():
            writer.add(pid, 0, tokens, n_prompt, hidden)
        return writer

    def add_rows(self) -> None:
        part, rows = self.committed
        samples = hidden_samples()
        for (pid, _turn), row in rows.items():
            self.committer.add_records([ledger_row(pid, part, row, len(samples[pid][0]))])

    def operate(self, run: RunDir) -> None:
        self.committed = self.writer.commit()
        self.add_rows()
        self.committer.flush()

    def after(self, run: RunDir) -> None:
        if self.committed is None:  # the worker retries the request: a new writer of the same actor
            self.committed = self.new_writer(run, self.counter).commit()
            self.add_rows()
        self.committer.flush()

    def resume(self, run: RunDir) -> None:
        run = RunDir(run.path)
        run.cleanup_temp()
        for part in garbage_hidden_parts(run):  # what capture.py does before any writer starts
            part.unlink()
        if not run.committed_ids():  # a restarted actor (its counter back at 1) does the samples again
            self.committer = Committer(run, set(), 100, 3600, schema.CAPTURE)
            self.committed = self.new_writer(run, iter(range(1, 10**6))).commit()
            self.add_rows()
            self.committer.flush()

    def check(self, run: RunDir) -> None:
        rows = part_rows(run, run.data)
        assert sorted(r["prompt_id"] for r in rows) == sorted(hidden_samples()), rows
        read = {s.prompt_id: s for s in iter_hidden(run)}
        assert sorted(read) == sorted(hidden_samples()), "a sample lost or doubled"
        for pid, (tokens, _n_prompt, hidden) in hidden_samples().items():
            assert np.array_equal(read[pid].hidden.view(np.uint16), hidden) and list(read[pid].token_ids) == tokens
        referenced = {r["hidden_part"] for r in rows}
        left = sorted(p.name for p in hidden_dir(run).iterdir() if p.name not in referenced)
        assert not left, f"garbage or temporary files left in hidden/: {left}"


def prompt_tables() -> tuple[pa.Table, pa.Table]:
    prompts = pa.Table.from_pylist(
        [{"prompt_id": pid, "source": "s", "origin": f"f.jsonl:{i}", "source_ref": None,
          "messages": [{"role": "user", "content": f"q {pid}"}], "reference": None}
         for i, pid in enumerate(PRIOR + NEW)], schema=schema.PROMPTS)
    rejects = pa.Table.from_pylist([{"source": "s", "origin": "f.jsonl:9", "reason": "no user turn", "raw": "{}"}],
                                   schema=schema.REJECTS)
    return prompts, rejects


class PromptSet(Scenario):
    """RunDir.write_prompt_set: the materialised prompt set and its rejects."""

    name = "prompt set"

    def operate(self, run: RunDir) -> None:
        run.write_prompt_set(*prompt_tables())

    def between(self, run: RunDir) -> None:
        stored = run.load_prompt_set()
        assert stored is None or stored.equals(prompt_tables()[0])

    def resume(self, run: RunDir) -> None:
        run = RunDir(run.path)
        run.cleanup_temp()
        if run.load_prompt_set() is None:  # materialise: the sources are read again
            run.write_prompt_set(*prompt_tables())

    def check(self, run: RunDir) -> None:
        prompts, rejects = prompt_tables()
        assert [p.name for p in run.prompt_set_versions()] == ["prompts-000001.parquet"]
        assert run.load_prompt_set().equals(prompts) and run.rejects_table().equals(rejects)
        for folder in (run.prompts, run.rejects):
            assert all(not p.name.startswith(".tmp-") for p in folder.iterdir()), list(folder.iterdir())


MANIFESTS = ({"fingerprint": "fp", "schema_version": 1}, {"fingerprint": "fp", "schema_version": 1, "weight_version": "w7"})


class Manifest(Scenario):
    """RunDir.write_manifest rewriting run.json (the weight-version pin): the run's identity."""

    name = "run.json"

    def prepare(self, run: RunDir) -> None:
        create(run)
        run.write_manifest(MANIFESTS[0])

    def operate(self, run: RunDir) -> None:
        run.write_manifest(MANIFESTS[1])

    def between(self, run: RunDir) -> None:
        assert run.exists() and run.read_manifest() in MANIFESTS, "run.json missing or torn"

    def resume(self, run: RunDir) -> None:
        run = RunDir(run.path)
        run.cleanup_temp()
        if run.read_manifest() != MANIFESTS[1]:  # the pin is written again on resume
            run.write_manifest(MANIFESTS[1])

    def check(self, run: RunDir) -> None:
        assert run.read_manifest() == MANIFESTS[1]
        assert all(not p.name.startswith(".tmp-") for p in run.path.iterdir())


STATUSES = ({"state": "running", "done": 1}, {"state": "running", "done": 2})


class Status(Scenario):
    """RunDir.write_status: must never end the run (a failed write is logged)."""

    name = "status.json"

    def prepare(self, run: RunDir) -> None:
        create(run)
        run.write_status(STATUSES[0])

    def operate(self, run: RunDir) -> bool:
        return run.write_status(STATUSES[1])

    def between(self, run: RunDir) -> None:
        assert run.read_status() in STATUSES, "status.json missing or torn"

    def resume(self, run: RunDir) -> None:
        RunDir(run.path).cleanup_temp()

    def check(self, run: RunDir) -> None:
        assert run.read_status() in STATUSES
        assert all(not p.name.startswith(".tmp-") for p in run.path.iterdir())


@functools.lru_cache(maxsize=1)
def dead_pid() -> int:
    """The pid of a process that has exited: the previous driver, gone."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


class Lock(Scenario):
    """RunLock.acquire (and on an object store one lease renewal), check, release."""

    name = "lock/lease"

    def prepare(self, run: RunDir) -> None:
        run.path.mkdir()
        self.lost = threading.Event()
        # check_budget_s 0: a failed read of lock.json is not retried, so each injected fault ends its point at
        # once (the retry has its own test in test_lease.py)
        self.lock = RunLock(run, on_lost=self.lost.set, renew_s=3600, settle_s=0, check_budget_s=0)
        self.lock._me["pid"] = dead_pid()  # so that a resume in this process may take a lease left behind

    def operate(self, run: RunDir) -> None:
        self.lock.acquire()
        if not run.path.local:
            self.lock.renew_once()
        self.lock.check()
        self.lock.release()

    def after(self, run: RunDir) -> None:
        self.lock.release()  # idempotent; a run releases its lock whatever happened

    def resume(self, run: RunDir) -> None:
        lock = RunLock(RunDir(run.path), settle_s=0, renew_s=3600).acquire()
        lock.check()
        lock.release()

    def check(self, run: RunDir) -> None:
        lost = getattr(self, "lost", None)  # None: prepared in a child that was killed
        assert lost is None or not lost.is_set(), "a store fault is not a lost lease"
        assert not RunLock(run).is_held(), "the lock is still held"
        try:
            assert not (run.path / "lock.json").exists(), "lock.json left behind"
        except StorageError as exc:  # pragma: no cover - the store is healthy here
            raise AssertionError(exc) from exc


SCENARIOS = {cls.name: cls for cls in (DataCommit, FailureCommit, IndexSegment, HiddenPart, PromptSet, Manifest, Status, Lock)}
