"""Regression tests for three silent data losses and one open port. Each of them failed on the code before its fix:

1. output token ids read from the field SGLang used only in 0.5.17 (`token_ids`), so 0.5.18+ stored none;
2. hidden parts named so that two samples could get one name, and a commit that silently replaced a part;
3. a flush whose outcome was unknown (a failure, or a second signal, after the rename) committed twice;
4. the embedded Ray cluster listening on the machine's network interface.
"""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from pipeline.core import errors
from pipeline.core.config import RunConfig
from pipeline.core.errors import PreflightError, StorageError
from pipeline.emulator import make_config, start_emulator
from pipeline.emulator.model import expected_chat
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.preflight import preflight
from pipeline.hidden.parts import HiddenPartWriter, hidden_parts, read_sample
from pipeline.store import seam, storage
from pipeline.store.faults import Faults
from pipeline.store.committer import Committer
from pipeline.store.rundir import RunDir, now_utc
from pipeline.store.storage import Location
from tests.helpers import data_parts, prompt_source, regen_cmd, run_regen, wait_for, write_config

MODEL = "moonshotai/Kimi-K2.5"
VERSIONS = ("0.5.23", "0.5.18", "0.5.17", "0.5.14")
MESSAGES = [{"role": "user", "content": "Name one fact about owls."}]


# --- 1. output token ids, by SGLang version ----------------------------------------------------------------
@pytest.fixture(scope="module")
def versioned():
    """One Kimi emulator per SGLang version, each answering with that version's response fields."""
    servers = {v: start_emulator(preset="kimi", sglang_version=v) for v in VERSIONS}
    yield servers
    for server in servers.values():
        server.stop()


def expected_ids(version: str) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0.0}
    return expected_chat(body, make_config(preset="kimi", sglang_version=version))


def test_the_client_reads_the_output_ids_of_every_version(versioned):
    async def ask(url: str):
        client = EndpointClient(url, "e", ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=12))
        try:
            return await client.chat(MESSAGES, seed=None)
        finally:
            await client.close()

    for version, server in versioned.items():
        completion = asyncio.run(ask(server.url))
        expected = expected_ids(version)
        assert completion.prompt_token_ids == expected["prompt_ids"], version
        if version == "0.5.14":  # no return_token_ids before 0.5.17: nothing to read, and nothing invented
            assert completion.output_token_ids is None
        else:
            assert completion.output_token_ids == expected["output_ids"], version


def make_cfg(urls: list[str], **overrides) -> RunConfig:
    raw = {"run_name": "ids", "model": MODEL, "sources": [{"spec": "prompts_sources/sample_prompts.yaml"}],
           "endpoints": [{"url": url} for url in urls], "sampling": {"max_tokens": 64}, "min_prompt_tokens": 16,
           "dead_fleet_deadline_s": 5}
    raw.update(overrides)
    return RunConfig.model_validate(raw)


def test_the_preflight_refuses_a_server_without_output_ids_naming_its_version(versioned):
    old, new = versioned["0.5.14"], versioned["0.5.23"]
    with pytest.raises(PreflightError) as info:
        preflight(make_cfg([old.url, new.url]), {})
    lines = str(info.value).splitlines()
    about_old = [line for line in lines if old.url.split("://")[1] in line]
    assert about_old and "SGLang 0.5.14" in about_old[0] and "no output token ids" in about_old[0]
    assert "return_token_ids: false" in about_old[0]
    assert not [line for line in lines if new.url.split("://")[1] in line], "0.5.23 returns its ids"
    # the way out the message names: a run that does not ask for ids passes
    assert all(r.ok for r in preflight(make_cfg([old.url, new.url], return_token_ids=False), {}))


@pytest.mark.parametrize("version", ["0.5.23", "0.5.17"])
def test_a_run_stores_the_exact_ids(tmp_path, ray_cluster, versioned, version):
    endpoints = [{"url": versioned[version].url, "concurrency": 4}]
    config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 12)], model=MODEL,
                          sampling={"temperature": 0.0, "max_tokens": 16})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    rows = [r for part in data_parts(tmp_path / "out" / "t") for r in pq.read_table(part).to_pylist()]
    assert len(rows) == 12
    kimi = make_config(preset="kimi")
    for row in rows:
        expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 16,
                                  "temperature": 0.0}, kimi)
        assert row["output_token_ids"] == expected["output_ids"] and row["prompt_token_ids"] == expected["prompt_ids"]


# --- 2. hidden parts: names unique by construction, commits that never replace ------------------------------
def sample(seed: int, n_tokens: int = 6, width: int = 8):
    rng = np.random.default_rng(seed)
    return (list(range(n_tokens)), 2, rng.integers(0, 2**16, size=(n_tokens, width), dtype=np.uint16))


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


# --- 3. a flush whose outcome is unknown is resolved by looking ------------------------------------------
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


# --- 4. the embedded Ray cluster listens on loopback only --------------------------------------------------
def listening_addresses(root: psutil.Process) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.setdefault(proc.name(), set()).add(conn.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def test_the_embedded_ray_cluster_binds_only_to_loopback(tmp_path):
    """`regen generate` without a Ray address starts its own cluster: every port it opens is on loopback."""
    with_slow_answers = start_emulator(preset="kimi", tok_per_s=20)
    try:
        config = write_config(tmp_path, [{"url": with_slow_answers.url, "concurrency": 2}],
                              [prompt_source(tmp_path, 40)], model=MODEL, sampling={"temperature": 0.0,
                                                                                    "max_tokens": 16})
        # as a user's shell has it: no cluster to join, and none of the test cluster's Ray settings
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        with open(tmp_path / "driver.log", "wb") as log:
            driver = subprocess.Popen(regen_cmd("generate", "--config", str(config)), stdout=log,
                                      stderr=subprocess.STDOUT, env=env)
        try:
            root = psutil.Process(driver.pid)
            seen: dict[str, set[str]] = {}

            def ray_is_up() -> bool:
                seen.update(listening_addresses(root))
                return "gcs_server" in seen and "raylet" in seen and any(
                    name.startswith("ray::") for name in seen)

            wait_for(ray_is_up, timeout=90, interval=0.5, what="the embedded Ray cluster to listen")
            time.sleep(2)
            seen.update(listening_addresses(root))
        finally:
            driver.send_signal(signal.SIGINT)
            driver.wait(timeout=60)
    finally:
        with_slow_answers.stop()
    exposed = {name: ips for name, ips in seen.items() if not all(is_loopback(ip) for ip in ips)}
    assert not exposed, f"listening beyond loopback: {exposed}"


# --- found by the review: interrupts, lost replies, flaky reads, hidden mode, tags, Ray addresses ------------
@pytest.fixture(params=["posix", "s3"])
def any_run_dir(request, tmp_path):
    where = str(tmp_path / "run") if request.param == "posix" else request.getfixturevalue("object_store")("run")
    run = RunDir(where)
    run.create()
    return run


def committed_everywhere(run: RunDir) -> list[str]:
    return [pid for part in run.parts(run.data) for pid in part.read_parquet(columns=["prompt_id"]).column(0).to_pylist()]


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


@pytest.mark.parametrize("address, environ, embedded", [
    (None, {}, True), (None, {"RAY_ADDRESS": ""}, True), ("local", {}, True), (None, {"RAY_ADDRESS": "local"}, True),
    ("auto", {}, False), (None, {"RAY_ADDRESS": "127.0.0.1:6379"}, False), ("ray://head:10001", {}, False)])
def test_which_addresses_start_the_loopback_cluster(address, environ, embedded):
    from pipeline.dispatch.cluster import embedded_ray

    assert embedded_ray(address, environ) is embedded
