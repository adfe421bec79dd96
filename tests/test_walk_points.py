"""The smaller points of issue 30's walk, each where it is cheapest to prove."""
from __future__ import annotations


import orjson

from pipeline.prompts.prompt_set import build_prompt_set
from pipeline.prompts.sources import SourceSpec


def test_fields_not_carried_count_the_selected_records_only(tmp_path):
    """`fields not carried` counted every record read; a limit of 2 of 5 (and a duplicate) count 2."""
    data = tmp_path / "r.jsonl"
    rows = [{"id": f"r{i}", "extra": "x", "messages": [{"role": "user", "content": f"q{i}", "weight": 1}]}
            for i in range(5)] + [{"id": "dup", "extra": "x", "messages": [{"role": "user", "content": "q0"}]}]
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    spec = SourceSpec(name="s", kind="jsonl", path=str(data), format="openai", id_field="id")
    whole = build_prompt_set([(spec, None)]).reports[0]
    assert whole.selected == 5 and whole.uncarried == {"record.extra": 5, "message.weight": 5}
    limited = build_prompt_set([(spec, 2)]).reports[0]
    assert limited.selected == 2 and limited.uncarried == {"record.extra": 2, "message.weight": 2}


def test_the_docs_state_the_test_suites_time_as_measured():
    """`make test` took 1,180 s in CI at the last landing, installs included; the README said about 15 minutes, then
    20 to 22 plus installs, then 19 (1,136 s)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for page in (root / "README.md", root / "docs" / "getting-started.md"):
        text = " ".join(page.read_text().split())
        assert "about 20 minutes in CI, installs included" in text and "1,180 s at the last landing" in text, page
        assert "about 15 minutes" not in text and "20 to 22" not in text, page


def test_a_refresh_and_the_engines_check_build_no_python_set_of_a_set_or_a_ledger(tmp_path, monkeypatch):
    """`fleet._unrecorded` read the whole ledger into Python sets; a refresh diffed two sets of every prompt id. Both
    are Arrow (or a listing) now: the set-building paths raise here, and the answers are still right."""
    import pyarrow as pa

    from pipeline.dispatch.fleet import _unrecorded
    from pipeline.store.prompt_reader import PromptSetReader
    from pipeline.store.rundir import RunDir
    from pipeline.store.storage import Location

    def built_a_set(*_):
        raise AssertionError("a Python set of the whole ledger")

    run = RunDir(tmp_path / "run")
    run.create()
    monkeypatch.setattr(RunDir, "ids_in", built_a_set)
    monkeypatch.setattr(RunDir, "unit_ids", built_a_set)
    assert not _unrecorded(run, {})
    run.write_part(run.data, pa.table({"prompt_id": ["a"]}))
    assert _unrecorded(run, {}) and not _unrecorded(run, {"engines": []})

    def version(name: str, ids: list[str]) -> PromptSetReader:
        path = tmp_path / f"{name}.parquet"
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt_id": ids}), str(path), row_group_size=2)
        return PromptSetReader(Location.at(str(path)))

    assert not hasattr(PromptSetReader, "ids")
    old, new = version("old", ["c", "a", "b", "d", "e"]), version("new", ["a", "x", "e", "y", "z"])
    assert new.refreshed_from(old) == (3, 3, ["b", "c", "d"])


class _SlowToStart:
    """An endpoint worker whose first answer takes `delay_s` (a loaded cluster: the actor runs, slowly)."""

    def __init__(self, worker, delay_s: float):
        self.worker, self.delay_s, self.first = worker, delay_s, True

    async def exchange(self, work, wait_s):
        if self.first:
            import asyncio

            self.first = False
            await asyncio.sleep(self.delay_s)  # the scenario itself: the actor answers late
        return await self.worker.exchange(work, wait_s)

    async def close(self):
        await self.worker.close()


def test_an_actor_slow_to_answer_is_starting_not_down_and_not_called_unplaceable(monkeypatch, caplog):
    """A short dead_fleet_deadline_s stopped a healthy run whose only actor answered late; the `Ray cannot place it`
    warning fired for an actor that runs and is only slow."""
    import logging

    from pipeline.dispatch import dispatcher
    from pipeline.dispatch.actors import client_settings, local_worker_factory
    from pipeline.emulator import start_emulator
    from tests.local_dispatch import make_cfg, run_local, work_item

    monkeypatch.setattr(dispatcher, "ACTOR_START_WARN_S", 0.3)
    server = start_emulator(preset="kimi")
    try:
        cfg = make_cfg([{"url": server.url}], dead_fleet_deadline_s=0.5)
        plain = local_worker_factory(cfg, client_settings(cfg), cfg.api_key, backoff_initial_s=0.05)
        factory = lambda e, start_open: _SlowToStart(plain(e, start_open), 1.5)  # noqa: E731
        with caplog.at_level(logging.WARNING, logger="regen.dispatch"):
            run = run_local(cfg, [work_item(f"p{i}", f"hello {i}", cfg) for i in range(3)], factory=factory)
    finally:
        server.stop()
    assert sorted(run.kinds()) == ["p0", "p1", "p2"] and all(k == ["done"] for k in run.kinds().values())
    warned = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
    assert warned and "runs but has not answered" in warned[0] and "cannot place" not in " ".join(warned)


DRIVER = """
import subprocess, sys
import ray
from pipeline.dispatch.cluster import init_ray
init_ray(None)

LAUNCH = ("import subprocess, sys; "
          "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], stdout=sys.stderr).pid)")


@ray.remote(num_cpus=0)
def start_a_process():  # started after the reaper, and no child of its worker: Ray does not end it
    return int(subprocess.run([sys.executable, "-c", LAUNCH], stdout=subprocess.PIPE, check=True).stdout)


print(ray.get(start_a_process.remote()), flush=True)
sys.stdin.read()
"""


def test_an_embedded_cluster_does_not_outlive_its_sigkilled_driver(tmp_path):
    """Ray's DashboardAgent and RuntimeEnvAgent outlived a SIGKILLed driver by about a minute (they wait 60 s on the
    dead GCS); the cluster regen started is gone within a few seconds of its driver, with a process a task started
    after the reaper did (an orphan, in the cluster's session: as a worker the dying raylet had just started). Each
    process is held by a pidfd from the start (a reused pid or a zombie is never taken for it) and waited on until it
    exits."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pipeline.dispatch.reaper import descendants
    from tests.helpers import wait_gone

    env = {**os.environ, "RAY_ADDRESS": ""}
    errors = tmp_path / "driver.err"
    with open(errors, "wb") as err:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=err, env=env, cwd=str(tmp_path))
    pidfds: dict[int, int] = {}
    try:
        line = driver.stdout.readline()
        assert line.strip().isdigit(), errors.read_text()[-3000:]
        late = int(line)
        reaper = sys.executable.encode() + b"\x00-m\x00pipeline.dispatch.reaper"
        names = {}
        for pid, _ in descendants(driver.pid):
            try:
                pidfd, cmdline = os.pidfd_open(pid), open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:  # gone already (a worker that ended)
                continue
            if cmdline.startswith(reaper):
                os.close(pidfd)
            else:
                pidfds[pid], names[pid] = pidfd, cmdline.split(b"\x00")[0]
        assert b"ray::DashboardAgent" in names.values() and b"ray::RuntimeEnvAgent" in names.values()
        pidfds[late], names[late] = os.pidfd_open(late), b"a process a task started"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        left = wait_gone(pidfds, 120)  # the event: every pidfd readable (Ray's own agents take 60 s)
        took = time.monotonic() - killed
        assert not left, f"alive {took:.0f} s after the driver's SIGKILL: {[names[pid] for pid in left]}"
        assert took < 20, f"the cluster took {took:.1f} s to end"
    finally:
        for pidfd in pidfds.values():
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # a failed test leaves none of them
            except OSError:  # gone
                pass
            os.close(pidfd)
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_make_generate_installs_what_the_configs_local_fleet_needs(monkeypatch):
    """`make generate CONFIG=configs/local_vllm.yaml` on a fresh clone stopped with "no python at ...": it now runs
    `make vllm` first, as `make bench` does (shown here with make -n: nothing is installed)."""
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.tools.fleet_needs import needs

    root = Path(__file__).resolve().parent.parent
    for name in ("REGEN_VLLM_PYTHON", "REGEN_VLLM_MODEL"):  # `make test` sets them: a fresh clone's user has neither
        monkeypatch.delenv(name, raising=False)
    assert needs(str(root / "configs" / "local_vllm.yaml")) == ["vllm"]
    assert needs(str(root / "configs" / "local.yaml")) == []
    dry = subprocess.run(["make", "-n", "generate", "CONFIG=configs/local_vllm.yaml",
                          f"VENV={Path(sys.executable).parent.parent}"], cwd=root, capture_output=True, text=True)
    assert "configs/local_vllm.yaml's local fleet needs: make vllm" in dry.stdout, dry.stdout + dry.stderr
