"""A run directory on an object store (S3, served for real over HTTP on 127.0.0.1 by moto): whole-object
commits, the ledger as the listing of committed parts, a lease as the run lock, and a SIGKILL mid-upload."""
from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import orjson
import pytest

from pipeline.core.errors import ConfigError, RunLocked
from pipeline.emulator import start_emulator
from pipeline.store.lock import RunLock
from pipeline.store.rundir import RunDir
from pipeline.store.faults import kill_at_data_part
from pipeline.store.storage import Location
from tests.helpers import run_regen, wait_for, write_config, write_prompts, write_source
from tests.test_chaos import chaos, kill_the_driver_then_finish

MODEL = "moonshotai/Kimi-K2.5"


def run_dir_at(uri: str, name: str = "t") -> RunDir:
    return RunDir(Location.at(uri) / name)


def ledger_rows(run: RunDir) -> list[dict]:
    return [row for part in run.parts(run.data) for row in part.read_parquet().to_pylist()]


def test_a_run_on_s3_commits_whole_objects_survives_a_kill_mid_upload_and_resumes_exactly_once(
        tmp_path, ray_cluster, object_store):
    server = start_emulator(preset="kimi", tok_per_s=400)
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 40)
        out = object_store("e2e")
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4, "name": "emu-0"}],
                              [write_source(tmp_path, prompts)], model=MODEL, thinking=True, output_dir=out,
                              sampling={"temperature": 0.0, "max_tokens": 24}, flush_records=4)
        run = run_dir_at(out)

        # SIGKILL after the third data part's bytes are uploaded, before the copy that publishes it
        killed = run_regen("generate", "--config", str(config), env=kill_at_data_part(3))
        assert killed.returncode == -9, killed.stderr
        parts = run.parts(run.data)
        assert len(parts) == 2, "the part that was never published is not in the listing"
        assert len(ledger_rows(run)) == 8, "every listed part is whole and readable"

        resumed = run_regen("generate", "--config", str(config))
        assert resumed.returncode == 0, resumed.stderr
        assert "took over a stale lock" in resumed.stderr, "the dead driver's lease is taken over at once"
        rows = ledger_rows(run)
        ids = [r["prompt_id"] for r in rows]
        assert len(ids) == 40 and len(set(ids)) == 40, "nothing lost, nothing doubled"
        assert set(ids) == set(run.load_prompt_set().column("prompt_id").to_pylist())
        assert not run.path.local and (run.logs / "regen.log").exists(), "the session's log is uploaded"

        status = run_regen("status", run.path.uri, "--json")
        assert status.returncode == 0, status.stderr
        report = orjson.loads(status.stdout)
        assert (report["state"], report["done"], report["pending"]) == ("complete", 40, 0)

        exported = tmp_path / "sf.jsonl"
        export = run_regen("export", run.path.uri, "--format", "specforge", "--out", str(exported))
        assert export.returncode == 0, export.stderr
        counts = orjson.loads((tmp_path / "sf.jsonl.manifest.json").read_bytes())["counts"]
        assert counts["records_read"] == 40 and counts["records_exported"] + sum(counts["dropped"].values()) == 40
        assert len(exported.read_text().splitlines()) == counts["records_exported"]
        bad_out = run_regen("export", run.path.uri, "--format", "specforge", "--out", out + "/x.jsonl")
        assert bad_out.returncode == 2 and "--out" in bad_out.stderr

        card = run_regen("card", run.path.uri)
        assert card.returncode == 0, card.stderr
        assert "40 records" in (run.path / "README.md").read_bytes().decode()
        assert (run.path / "card" / "completion_length.png").size() > 0

        again = run_regen("generate", "--config", str(config))
        assert again.returncode == 0 and "is complete" in again.stderr
        assert collections.Counter(r["prompt_id"] for r in ledger_rows(run)).most_common(1)[0][1] == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_chaos_on_s3_three_driver_kills_a_flapping_and_a_faulty_endpoint_exactly_once(
        tmp_path, ray_cluster, object_store):
    servers = [start_emulator(preset="kimi", tok_per_s=40),  # killed and restarted every few seconds
               start_emulator(preset="kimi", tok_per_s=40, fault_seed=5, fault_500=0.05, fault_503=0.03,
                              fault_hang=0.01, fault_reset=0.01),
               start_emulator(preset="kimi", tok_per_s=40)]
    out = object_store("chaos")
    run = run_dir_at(out)
    with chaos(servers, run.path.uri) as (watcher, flapper):
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 600)
        config = write_config(tmp_path, [{"url": s.url, "concurrency": 8, "name": f"emu-{i}"}
                                         for i, s in enumerate(servers)],
                              [write_source(tmp_path, prompts)], model=MODEL, output_dir=out,
                              sampling={"temperature": 0.0, "max_tokens": 24}, request_timeout_s=3, max_attempts=10,
                              flush_records=25, flush_interval_s=0.5, dead_fleet_deadline_s=60,
                              max_connection_drops=10)  # servers are killed under prompts that are not poison
        kills = kill_the_driver_then_finish(config, tmp_path, 5, (4.0, 6.0))
    ids = [r["prompt_id"] for r in ledger_rows(run)]
    assert kills == 3, "the driver must have been killed three times mid-run"
    assert len(ids) == len(set(ids)) == 600, "lost or duplicated prompts"
    assert not watcher.errors, watcher.errors[:3]
    assert watcher.reads > 0
    print(f"\ns3 chaos: 600 prompts, driver kills {kills}, endpoint kills {flapper.kills}, lost 0, duplicated 0, "
          f"part reads during the run {watcher.reads}")


def test_the_lease_refuses_a_live_driver_and_takes_over_a_dead_one(object_store):
    run = run_dir_at(object_store("lease-live"))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pipeline.store.rundir import RunDir, RunLock
        lock = RunLock(RunDir({run.path.uri!r})).acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked) as err:
            RunLock(run, settle_s=0).acquire()
        assert f"pid {holder.pid}" in str(err.value) and "lease expires in" in str(err.value)
        assert RunLock(run).is_held(), "regen status sees the run as running"
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(run, settle_s=0).acquire()  # same host, holder dead: no need to wait for the expiry
    assert lock.previous_holder["pid"] == holder.pid
    lock.release()
    assert not (run.path / "lock.json").exists() and not RunLock(run).is_held()


def test_a_lease_from_another_host_binds_until_it_expires(object_store):
    run = run_dir_at(object_store("lease-remote"))
    run.path.mkdir()
    foreign = {"pid": 4242, "host": "gpu-node-7", "owner": "f" * 32, "since": "2026-11-29T00:00:00+00:00"}
    (run.path / "lock.json").write_atomic(orjson.dumps({**foreign, "expires": time.time() + 30}))
    with pytest.raises(RunLocked) as err:
        RunLock(run, settle_s=0).acquire()
    assert "gpu-node-7" in str(err.value) and "pid 4242" in str(err.value)
    (run.path / "lock.json").write_atomic(orjson.dumps({**foreign, "expires": time.time() - 1}))
    lock = RunLock(run, settle_s=0).acquire()
    assert lock.previous_holder["host"] == "gpu-node-7"
    lock.release()


def test_the_lease_is_renewed_and_a_holder_that_loses_it_stops(object_store):
    run = run_dir_at(object_store("lease-renew"))
    lost = threading.Event()
    lock = RunLock(run, on_lost=lost.set, lease_s=3, renew_s=0.2, settle_s=0).acquire()
    first = lock.holder()["expires"]
    # renewed every 0.2 s: waited for (a fixed 0.8 s could pass on a loaded machine before a renewal's write)
    wait_for(lambda: lock.holder()["expires"] > first, 30, 0.1, what="the holder keeping its lease alive")
    usurper = {"pid": 1, "host": "elsewhere", "owner": "u" * 32, "since": "x", "expires": time.time() + 60}
    (run.path / "lock.json").write_atomic(orjson.dumps(usurper))
    assert lost.wait(30), "a holder that finds another's lease stops"
    lock.release()
    assert lock.holder()["owner"] == "u" * 32, "release never deletes another driver's lease"


def test_locations_parse_and_travel_without_their_filesystem(object_store, tmp_path):
    with pytest.raises(ConfigError, match="credentials"):
        Location.at("s3://AKIAKEY:secret@bucket/outputs")
    with pytest.raises(ConfigError, match="s3://"):
        Location.at("ftp://host/outputs")
    assert Location.at(f"file://{tmp_path}/x") == Location.at(tmp_path / "x")
    remote = Location.at(object_store("travel")) / "run"
    remote.mkdir()
    (remote / "a.json").write_atomic(b"{}")
    blob = pickle.dumps(remote)
    assert b"pyarrow" not in blob, "only the URI travels; each process opens the store with its own credentials"
    copy = pickle.loads(blob)
    assert copy == remote and [entry.name for entry in copy.iterdir()] == ["a.json"] and str(copy) == "s3://regen-test/travel/run"
