"""A long run tells its story: RUN/logs/regen.log read as a user reads it after a run under nohup (no terminal),
and `regen status` while it runs. One real run on SGLang emulators, with an endpoint SIGKILLed mid-run and
started again; a real Ray head, real `regen` subprocesses."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from tests.helpers import (
    KILLED, KILLED_BEFORE_ITS_PREFLIGHT,
    committed_ids, emulators, prompt_source, regen_cmd, regen_log_says, run_regen, set_speed, start_regen,
    wait_while_running, write_config,
)

MODEL = "moonshotai/Kimi-K2.5"
PROMPTS = 200


def log_lines(run: Path) -> list[str]:
    return (run / "logs" / "regen.log").read_text().splitlines()


def serving(run: Path, label: str) -> bool:
    """status.json shows `label` with requests in flight (it has been sent work and not answered it all)."""
    try:
        stats = orjson.loads((run / "status.json").read_bytes())["endpoints"][label]
    except (OSError, KeyError, orjson.JSONDecodeError):
        return False
    return (stats.get("in_flight") or 0) > 0


def kill_actor(address: str, label: str) -> None:
    """Kill the Ray actor that serves `label` (the actors are named after their endpoint)."""
    import ray

    from pipeline.dispatch.actors import ACTOR_NAMESPACE

    ray.init(address=address, namespace=ACTOR_NAMESPACE)
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == ACTOR_NAMESPACE and f":{label}:" in a["name"]]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0]))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def story(tmp_path_factory, ray_cluster):
    """One run of PROMPTS prompts over four emulators, each with its own story:
    emu-0: its Ray actor is killed once records are committed (it dies and is restarted);
    emu-1: serves throughout;
    emu-2: SIGKILLed at the first commit, and started again serving other weights (refused, it stays out);
    emu-3: down at the preflight, started at the first commit (its circuit closes and it takes work).
    `regen status` is asked while the run goes on."""
    tmp = tmp_path_factory.mktemp("story")
    with emulators(4, preset="kimi", tok_per_s=30) as servers:
        endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)]
        config = write_config(tmp, endpoints, [prompt_source(tmp, PROMPTS)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16}, progress_log_interval_s=0.5,
                              circuit_failures=1, dead_fleet_deadline_s=120)  # four actors start on a busy machine
        run = tmp / "out" / "t"
        console = tmp / "console.txt"
        servers[3].stop()
        proc = start_regen("generate", "--config", str(config), log=console)  # stdout and stderr: a file
        try:
            # The run is held (its servers answer slowly) from its first commit until the log has told each story:
            # on a busy machine it could end first. Requests started before keep their speed.
            wait_while_running(proc, console, lambda: run.exists() and len(committed_ids(run)) >= 16, 120,
                               "a first commit")
            set_speed([servers[0], servers[1]], 2)
            # emu-2's actor may start last on a busy machine: killed before it serves, it would see only the
            # restarted server's other weights, never a dropped request
            wait_while_running(proc, console, lambda: serving(run, "emu-2"), 120, "emu-2 serving")
            servers[2].kill()  # in-flight requests are dropped: its circuit opens
            servers[3].start()
            set_speed([servers[3]], 2)
            servers[2].restart(weight_version="other-weights")
            status_running = run_regen("status", str(run))
            kill_actor(ray_cluster["address"], "emu-0")
            for said in ("endpoint emu-3: circuit closed", "endpoint emu-2 answers again but is refused",
                         "endpoint emu-0: actor restarted"):
                wait_while_running(proc, console, regen_log_says(run, said), 180, f"the log saying {said!r}")
            set_speed([servers[0], servers[1], servers[3]], 30)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return SimpleNamespace(run=run, code=proc.returncode, log=log_lines(run), console=console.read_bytes(),
                           status_running=status_running, config=config)


def test_the_log_holds_each_endpoints_preflight_verdict(story):
    verdicts = {re.search(r"endpoint (emu-\d)", line).group(1): line for line in story.log
                if "preflight: endpoint" in line}
    assert sorted(verdicts) == ["emu-0", "emu-1", "emu-2", "emu-3"]
    for label in ("emu-0", "emu-1", "emu-2"):
        assert " ok: sglang 0.5.23, weight version default" in verdicts[label], verdicts[label]
    assert " unreachable (" in verdicts["emu-3"], verdicts["emu-3"]


def test_the_log_shows_progress_at_a_steady_interval_with_rates_and_eta(story):
    progress = [line for line in story.log if "progress: " in line]
    assert len(progress) >= 3, story.log
    done = [int(re.search(r"progress: (\d+)/%d done" % PROMPTS, line).group(1)) for line in progress]
    assert done == sorted(done) and done[-1] > done[0]
    assert all(re.search(r"\d+ failed, \d+ pending; recent [\d.]+ prompts/s \d+ tok/s .*overall [\d.]+ prompts/s "
                         r"\d+ tok/s; ETA ", line) for line in progress), progress[0]


def test_the_log_says_why_an_endpoint_left_the_work_and_why_it_stays_out(story):
    opened = next(i for i, line in enumerate(story.log) if "endpoint emu-2: circuit opened (" in line)
    assert "connection failed" in story.log[opened] and "WARNING" in story.log[opened]
    refused = [line for line in story.log[opened:] if "endpoint emu-2 answers again but is refused" in line]
    assert refused and "weight version 'other-weights' differs from the run's 'default'" in refused[0], refused
    assert not any("emu-2: circuit closed" in line for line in story.log), "other weights never take work"


def test_the_log_says_when_an_endpoint_down_at_the_preflight_comes_to_work(story):
    closed = [line for line in story.log if "endpoint emu-3: circuit closed: healthy, it takes work" in line]
    assert closed, [line for line in story.log if "emu-3" in line]


def test_the_log_tells_an_actors_death_and_its_restart(story):
    died = next(i for i, line in enumerate(story.log) if "actor for emu-0 died" in line)
    assert "requeueing" in story.log[died]
    assert any("endpoint emu-0: actor restarted" in line for line in story.log[died:])


def test_the_log_holds_the_commits_and_ends_with_the_outcome_and_exit_code(story):
    assert story.code == 0
    commits = [line for line in story.log if re.search(r"committed \d+ records in part-\d+", line)]
    assert commits and sum(int(re.search(r"committed (\d+)", line).group(1)) for line in commits) == PROMPTS
    last = story.log[-1]
    assert "run ended (exit 0): run " in last and f"is complete: {PROMPTS} records, 0 failures" in last


def test_the_sessions_rates_count_from_the_start_of_the_dispatch_not_ray_starting(story):
    from datetime import datetime

    def when(line: str) -> datetime:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    started = next(i for i, line in enumerate(story.log) if " regen: dispatch: " in line)
    ended = next(line for line in story.log[started:] if "run ended (exit 0)" in line)
    assert (f"dispatch: {PROMPTS} prompts to 3 of 4 endpoints; 1 held out by the preflight, joining once it "
            "passes: emu-3 (unreachable)") in story.log[started]  # emu-3 is down at the preflight
    elapsed = orjson.loads((story.run / "status.json").read_bytes())["this_session"]["elapsed_s"]
    assert elapsed <= (when(ended) - when(story.log[started])).total_seconds() + 1.0, (elapsed, story.log[started])


def test_without_a_terminal_progress_is_plain_lines_never_a_redrawn_bar(story):
    assert b"\r" not in story.console
    text = story.console.decode()
    assert "regen: progress: " in text and "prompt/s" not in text  # tqdm's unit; the lines say prompts/s
    assert "run ended (exit 0)" in text


def test_status_shows_rates_eta_and_each_endpoints_throughput_while_running(story):
    out = story.status_running.stdout
    assert re.search(r"recent rate: [\d.]+ prompts/s, \d+ tok/s", out), out
    assert re.search(r"overall rate: [\d.]+ prompts/s, \d+ tok/s", out), out
    assert re.search(r"ETA (\d+h)?(\d+m)?\d+s at the recent rate", out) or "ETA unknown" in out, out
    for label in ("emu-0", "emu-1", "emu-2", "emu-3"):
        assert re.search(rf"{label}\s+\w+\s+on .* \d+ done\s+[\d.]+ prompts/s\s+[\d.]+ tok/s", out), out


def test_a_complete_run_shows_nothing_in_flight(story):
    report = orjson.loads(run_regen("status", str(story.run), "--json").stdout)
    assert report["state"] == "complete" and report["endpoints"]
    assert all(e["in_flight"] == 0 for e in report["endpoints"].values()), report["endpoints"]
    assert sum(e["session_done"] for e in report["endpoints"].values()) == PROMPTS


def test_a_rerun_refused_as_drift_ends_the_log_with_the_refusal_and_exit_3(story, tmp_path):
    import yaml

    edited = yaml.safe_load(story.config.read_text())
    edited["sampling"]["max_tokens"] = 17
    config = tmp_path / "edited.yaml"
    config.write_text(yaml.safe_dump(edited, sort_keys=False))
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 3, result.stderr
    last = log_lines(story.run)[-1]
    assert "run ended (exit 3): fatal: DriftError: " in last and "max_tokens: 16 -> 17" in last, last
    assert f"{PROMPTS} done, 0 failed, 0 pending of {PROMPTS}" in last, last


def test_status_into_a_pipe_that_closes_early_prints_no_traceback(story):
    # `head -n 0` leaves at once: every write of regen meets a closed pipe
    command = " ".join(regen_cmd("status", str(story.run))) + " | head -n 0"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 0


def test_a_refused_preflight_is_in_the_log_with_the_exit_code(tmp_path):
    with emulators(1, preset="kimi") as (server,):
        config = write_config(tmp_path, [{"url": server.url, "name": "emu-x"}], [prompt_source(tmp_path, 3)],
                              model="some/other-model")
        # a refused new run leaves no directory (tests/test_refusals.py): the run is one a killed start left
        assert run_regen("generate", "--config", str(config), env=KILLED_BEFORE_ITS_PREFLIGHT).returncode == KILLED
        result = run_regen("generate", "--config", str(config))
    assert result.returncode != 0, result.stderr
    lines = log_lines(tmp_path / "out" / "t")
    assert any("preflight: endpoint emu-x" in line and "REFUSED: " in line for line in lines), lines
    assert f"run ended (exit {result.returncode}): fatal: PreflightError" in lines[-1]
    assert "3 pending of 3" in lines[-1]
    assert result.stderr.count("fleet preflight refused") == 1, "the console says it once"


PROGRESS_SNIPPET = """
import sys, time
from pipeline.dispatch.stopping import setup_logging
from pipeline.store.progress import Progress
from pipeline.store.rundir import RunDir
run = RunDir(sys.argv[1])
run.create()
setup_logging(run)
progress = Progress(run, total=8, already_done=0, failed_before=0, rejects=0, status_interval_s=0.01,
                    log_interval_s=0.01)
for i in range(8):
    progress.record(True, 5, "emu-0")
    progress.committed([{"prompt_id": f"p{i}", "sample_index": 0, "completion_tokens": 5, "finish_reason": "stop"}],
                       False)  # the progress lines count commits, as the driver's committer reports them
    time.sleep(0.03)
    progress.tick({"emu-0": {"state": "healthy"}})
progress.close()
"""


def test_on_a_terminal_the_bar_stays_and_the_progress_lines_go_to_the_log_only(tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import sys
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    try:
        result = subprocess.run([sys.executable, "-c", PROGRESS_SNIPPET, str(tmp_path / "run")], stderr=follower,
                                timeout=60)
        os.close(follower)
        terminal = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other side closed: all read
                break
            if not chunk:
                break
            terminal += chunk
    finally:
        os.close(leader)
    assert result.returncode == 0
    assert b"\r" in terminal and b"8/8" in terminal, terminal[-500:]  # tqdm's bar, redrawn in place
    assert b"progress:" not in terminal
    assert any("progress: 8/8 done" in line for line in log_lines(tmp_path / "run"))


def test_a_rerun_of_a_complete_run_keeps_the_last_sessions_rates_and_throughput(story):
    result = run_regen("generate", "--config", str(story.config))
    assert result.returncode == 0, result.stderr
    report = orjson.loads(run_regen("status", str(story.run), "--json").stdout)
    assert report["state"] == "complete"
    assert sum(e["session_done"] for e in report["endpoints"].values()) == PROMPTS, report["endpoints"]
    assert report["rates"]["overall"]["prompts_s"] > 0 and report["this_session"]["done"] == PROMPTS, report
    assert "run ended (exit 0): run " in log_lines(story.run)[-1]


def test_status_of_a_killed_run_by_an_older_regen_shows_nothing_in_flight_and_no_false_zeros(tmp_path):
    from pipeline.store.rundir import RunDir

    run = RunDir(tmp_path / "old")
    run.create()
    run.write_manifest({"run_name": "old"})
    # what the previous regen wrote, and left as it was when its driver was SIGKILLed
    run.write_status({"state": "running", "updated_at": "2026-11-01T10:00:00+00:00", "total": 10, "done": 4,
                      "failed": 0, "pending": 6, "rejects": 0,
                      "this_session": {"done": 4, "failed": 0, "completion_tokens": 40, "elapsed_s": 20.0,
                                       "tok_s": 2.0},
                      "endpoints": {"node-a": {"state": "healthy", "node": "10.0.0.7", "in_flight": 3,
                                               "tok_s": 2.0, "errors": {}}}})
    text = run_regen("status", str(run.path))
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    row = next(line for line in text.stdout.splitlines() if "node-a" in line)
    assert re.search(r"in flight\s+0\s+- done\s+- prompts/s", row), text.stdout
    assert "stopped" in text.stdout.splitlines()[0] and "ETA" not in text.stdout
    report = orjson.loads(run_regen("status", str(run.path), "--json").stdout)
    assert report["endpoints"]["node-a"]["in_flight"] == 0 and report["eta_s"] is None
