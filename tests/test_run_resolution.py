"""Which run a `regen generate` opens (issue 23, dead ends 1, 2, 4 and 6), through the real command.

- A run that has committed nothing binds its identity at its first commit: a rerun takes the changed config.
- A plain rerun resumes the newest run of its name whose identity matches; --run-dir names one.
- Relative paths of a run config resolve against its folder, and an old run.json's path text is not compared.
- A second driver on a busy run is refused at once.

As in test_run_identity.py, the fleet is mostly one endpoint where nothing listens: a start the drift guard allows
goes on to the preflight, which gives up (exit 1); one it refuses exits 3 first. No Ray.

A start refused at its preflight puts the run back as it was (test_refusals.py); here, where runs that have
committed nothing are what is tested, it leaves what it wrote, as a start killed at that point does."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import yaml

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.emulator import start_emulator
from pipeline.store.rundir import RunDir, RunLock
from tests.helpers import (commit_a_failure, free_port, left_as_a_kill_leaves_it, regen_cmd, write_config,
                           write_prompts, write_source)

REPO = Path(__file__).resolve().parent.parent
TODAYS_RUN = REPO / "tests" / "data" / "run_89263c8"  # a run.json written by regen at 89263c8: see its config.yaml
MODEL = "moonshotai/Kimi-K2.5"
BAD_CONFIG, STOPPED_AT_PREFLIGHT, REFUSED, LOCKED = 2, 1, 3, 4


@pytest.fixture(autouse=True)
def starts_leave_an_unbound_run():
    with left_as_a_kill_leaves_it():
        yield


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def regen(*args: str, cwd: Path = REPO) -> Result:
    """`regen ARGS` run in this process from `cwd` (the command's own main: its exit code, stdout and stderr),
    where a subprocess would spend seconds importing; its signal handlers and log handlers are put back, and the
    Ray connection its session opened (the early actors join the test cluster) is closed."""
    import ray

    from pipeline.cli import main

    connected = ray.is_initialized()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(before)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for handler in list(logging.getLogger("regen").handlers):
            handler.close()
            logging.getLogger("regen").removeHandler(handler)
        if ray.is_initialized() and not connected:
            ray.shutdown()
    return Result(code, out.getvalue(), err.getvalue())


def dead_endpoints() -> list[dict]:
    return [{"url": f"http://127.0.0.1:{free_port()}", "name": "dead"}]


def config(tmp_path: Path, n: int = 6, endpoints: list[dict] | None = None, **overrides) -> Path:
    """tmp_path/config.yaml over n prompts (one prompt file, rewritten only when n changes)."""
    prompts = tmp_path / "p.jsonl"
    if not prompts.exists() or len(prompts.read_bytes().splitlines()) != n:
        write_prompts(prompts, n)
    overrides = {"model": MODEL, "dead_fleet_deadline_s": 0.5, **overrides}
    return write_config(tmp_path, endpoints or dead_endpoints(), [write_source(tmp_path, prompts)], **overrides)


def manifest(run: Path) -> dict:
    return orjson.loads((run / "run.json").read_bytes())


def log_of(run: Path) -> str:
    return (run / "logs" / "regen.log").read_text()


# --- 1. the identity binds at the first commit --------------------------------------------------------------
def test_a_run_refused_by_the_preflight_takes_the_lowered_max_tokens_and_logs_the_diff(tmp_path):
    """The issue's sequence: max_tokens beyond the servers' context is refused by the preflight after run.json and
    the prompt set were written; following its advice (lower max_tokens) was then refused as drift (exit 3). (A
    refused start now leaves no run: here the first start stands for one killed after its writes.)"""
    server = start_emulator(preset="kimi", served_model_name=MODEL)
    try:
        first = regen("generate", "--config", str(config(tmp_path, endpoints=[{"url": server.url}],
                                                            sampling={"max_tokens": 300000})))
        assert first.returncode == 1 and "or lower sampling.max_tokens" in first.stderr, first.stderr
    finally:
        server.stop()
    run = tmp_path / "out" / "t"
    assert manifest(run)["generation"]["sampling"]["max_tokens"] == 300000
    lowered = config(tmp_path, sampling={"max_tokens": 64})
    rerun = regen("generate", "--config", str(lowered))
    assert rerun.returncode == STOPPED_AT_PREFLIGHT, rerun.stderr
    assert "generation.sampling.max_tokens: 300000 -> 64" in rerun.stderr
    assert "generation.sampling.max_tokens: 300000 -> 64" in log_of(run), "the diff is in the run's log too"
    taken = manifest(run)
    assert taken["generation"]["sampling"]["max_tokens"] == 64
    assert taken["fingerprint"] == load_config(lowered).fingerprint(), "its records will carry the new fingerprint"


def test_a_rerun_before_the_first_commit_forgets_what_the_preflight_pinned(tmp_path):
    """A session killed after its preflight pinned the fleet, before its first commit: the next start may serve
    other weights or another engine, and the run takes the served model's name the preflight asked for."""
    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "t"
    pinned = {**manifest(run), "weight_version": "w1", "deterministic": True,
              "engines": [{"engine": "sglang", "version": "0.5.18"}]}
    (run / "run.json").write_bytes(orjson.dumps(pinned))
    rerun = regen("generate", "--config", str(config(tmp_path, model="kimi-k25")))
    assert rerun.returncode == STOPPED_AT_PREFLIGHT, rerun.stderr
    taken = manifest(run)
    assert taken["generation"]["model"] == "kimi-k25"
    assert not {"weight_version", "deterministic", "engines"} & set(taken), "pinned again by the next preflight"
    assert "weight_version = 'w1'" in log_of(run)


def test_a_changed_prompt_set_before_the_first_commit_is_read_again(tmp_path):
    assert regen("generate", "--config", str(config(tmp_path, n=6))).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "t"
    rerun = regen("generate", "--config", str(config(tmp_path, n=9)))  # the source file grew
    assert rerun.returncode == STOPPED_AT_PREFLIGHT, rerun.stderr
    versions = RunDir(run).prompt_set_versions()
    assert len(versions) == 2 and RunDir(run).load_prompt_set().num_rows == 9
    assert manifest(run)["prompt_report"]["prompts"] == 9


def test_a_rerun_killed_after_restaging_then_restored_reads_the_restored_prompt_set(tmp_path):
    """An edited config's rerun (a spec limit) committed its new prompt set, and was killed before run.json
    recorded it (run.json keeps the old prompt identity until then). Restoring the original config matched that
    identity, so the run used to go on with the edited config's prompt set: 3 prompts instead of 6."""
    from pipeline.run import stage_prompt_set

    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "t"
    limited = config(tmp_path, sources=[{"spec": str(tmp_path / "test.yaml"), "limit": 3}])
    stage_prompt_set(load_config(limited)).commit(RunDir(run))  # what the killed rerun had done
    assert RunDir(run).load_prompt_set().num_rows == 3
    restored = regen("generate", "--config", str(config(tmp_path)))
    assert restored.returncode == STOPPED_AT_PREFLIGHT, restored.stderr
    assert RunDir(run).load_prompt_set().num_rows == 6
    assert manifest(run)["prompt_report"]["prompts"] == 6


def test_a_bound_run_whose_refresh_was_killed_before_run_json_recorded_it_reads_its_own_prompt_set(tmp_path):
    """The same kill during --refresh-prompts of a run that has committed: the plain rerun with the recorded
    config used to go on with the refreshed config's prompt set."""
    from pipeline.run import stage_prompt_set

    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "t"
    commit_a_failure(run)
    limited = config(tmp_path, sources=[{"spec": str(tmp_path / "test.yaml"), "limit": 3}])
    stage_prompt_set(load_config(limited)).commit(RunDir(run))
    resumed = regen("generate", "--config", str(config(tmp_path)))
    assert resumed.returncode == STOPPED_AT_PREFLIGHT, resumed.stderr
    assert RunDir(run).load_prompt_set().num_rows == 6 and "read again from the sources" in resumed.stderr


def test_after_the_first_commit_the_same_change_is_drift(tmp_path):
    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    commit_a_failure(tmp_path / "out" / "t")
    refused = regen("generate", "--config", str(config(tmp_path, sampling={"max_tokens": 64})))
    assert refused.returncode == REFUSED and "generation.sampling.max_tokens: 8 -> 64" in refused.stderr


# --- 2. which run a rerun resumes ---------------------------------------------------------------------------
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """The issue's sequence: `t` made with max_tokens 8 (bound), edited to 16 (refused), --new-run made `t-r2`."""
    out = tmp_path / "out"
    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    commit_a_failure(out / "t")
    edited = config(tmp_path, sampling={"max_tokens": 16})
    assert regen("generate", "--config", str(edited)).returncode == REFUSED
    assert regen("generate", "--config", str(edited), "--new-run").returncode == STOPPED_AT_PREFLIGHT
    commit_a_failure(out / "t-r2")
    return out / "t", out / "t-r2"


def test_restoring_the_original_values_resumes_the_original_run_and_says_it_is_not_the_newest(tmp_path):
    original, newest = two_runs(tmp_path)
    before = (original / "run.json").read_bytes()
    restored = config(tmp_path)
    resumed = regen("generate", "--config", str(restored))
    assert resumed.returncode == STOPPED_AT_PREFLIGHT, resumed.stderr
    notice = f"resuming {original}, NOT the newest run of 't' ({newest})"
    assert notice in resumed.stderr and notice in log_of(original)
    assert (original / "run.json").read_bytes() == before
    again = regen("generate", "--config", str(restored), "--new-run")
    assert again.returncode == STOPPED_AT_PREFLIGHT, again.stderr
    assert sorted(p.name for p in original.parent.iterdir()) == ["t", "t-r2"], "--new-run resumes the match too"


def test_when_no_run_matches_each_candidate_is_listed_with_its_diff(tmp_path):
    original, newest = two_runs(tmp_path)
    refused = regen("generate", "--config", str(config(tmp_path, sampling={"max_tokens": 32})))
    assert refused.returncode == REFUSED
    text = refused.stderr
    assert f"{newest} (newest):\n    generation.sampling.max_tokens: 16 -> 32" in text
    assert f"{original}:\n    generation.sampling.max_tokens: 8 -> 32" in text and "--run-dir" in text


def test_run_dir_names_the_run_to_resume_and_the_drift_guard_still_applies(tmp_path):
    original, newest = two_runs(tmp_path)
    named = regen("generate", "--config", str(config(tmp_path)), "--run-dir", str(original))
    assert named.returncode == STOPPED_AT_PREFLIGHT, named.stderr
    assert "NOT the newest" not in named.stderr, "named: nothing to warn about"
    drifted = regen("generate", "--config", str(config(tmp_path)), "--run-dir", str(newest))
    assert drifted.returncode == REFUSED and "generation.sampling.max_tokens: 16 -> 8" in drifted.stderr
    missing = regen("generate", "--config", str(config(tmp_path)), "--run-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == BAD_CONFIG and f"--run-dir {tmp_path / 'nowhere'}: no run there" in missing.stderr


def test_run_dir_of_another_run_name_is_refused_and_left_as_it_was(tmp_path):
    """--run-dir naming a run of another run_name that has committed nothing used to take it over: its run.json
    was rewritten under this config's run_name, so the other config no longer found its own run."""
    other = config(tmp_path, run_name="other")
    assert regen("generate", "--config", str(other)).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "other"
    before = (run / "run.json").read_bytes()
    named = regen("generate", "--config", str(config(tmp_path)), "--run-dir", str(run))
    assert named.returncode == BAD_CONFIG, named.stderr
    assert f"--run-dir {run}: that is a run of 'other', and this config's run_name is 't'" in named.stderr
    assert (run / "run.json").read_bytes() == before
    again = regen("generate", "--config", str(config(tmp_path, run_name="other")), "--run-dir", str(run))
    assert again.returncode == STOPPED_AT_PREFLIGHT, again.stderr


# --- 4. paths resolve against the config file's folder ------------------------------------------------------
def relative_config(tmp_path: Path) -> Path:
    """configs/run.yaml naming its spec, output folder and endpoints file relative to itself."""
    (tmp_path / "specs" / "data").mkdir(parents=True)
    write_prompts(tmp_path / "specs" / "data" / "p.jsonl", 4)
    (tmp_path / "specs" / "s.yaml").write_text(yaml.safe_dump(
        {"name": "s", "kind": "jsonl", "path": "data/p.jsonl", "format": "prompt"}))  # relative to the spec
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "fleet.txt").write_text(f"http://127.0.0.1:{free_port()}\n")
    path = tmp_path / "configs" / "run.yaml"
    path.write_text(yaml.safe_dump({"run_name": "rel", "output_dir": "../out", "model": MODEL,
                                    "sources": [{"spec": "../specs/s.yaml"}], "endpoints_file": "fleet.txt",
                                    "dead_fleet_deadline_s": 0.5}))
    return path


def test_a_config_gives_the_same_run_from_any_working_directory(tmp_path):
    path = relative_config(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checked = regen("validate", str(path), cwd=elsewhere)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert regen("generate", "--config", str(path), cwd=elsewhere).returncode == STOPPED_AT_PREFLIGHT
    run = tmp_path / "out" / "rel"
    assert manifest(run)["prompt_report"]["prompts"] == 4
    commit_a_failure(run)
    resumed = regen("generate", "--config", str(path), cwd=tmp_path / "configs")
    assert resumed.returncode == STOPPED_AT_PREFLIGHT, resumed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "elsewhere", "out", "specs"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rel"]


def test_a_path_that_does_not_exist_names_it_as_written_and_resolved_and_the_rule(tmp_path):
    path = relative_config(tmp_path)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "sources": [{"spec": "specs/s.yaml"}]}))  # relative to the root: wrong
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert (f"sources[0].spec 'specs/s.yaml' resolves to {tmp_path / 'configs' / 'specs' / 's.yaml'}, which does "
            "not exist (relative paths in a run config resolve against the config file's folder") in str(refused.value)
    path.write_text(yaml.safe_dump({**raw, "tokenizer": "./tok", "max_prompt_tokens": 100}))
    with pytest.raises(ConfigError, match=f"tokenizer './tok' resolves to {tmp_path / 'configs' / 'tok'}"):
        load_config(path)
    (tmp_path / "configs" / "tok").mkdir()
    assert load_config(path).tokenizer_path() == str(tmp_path / "configs" / "tok")
    path.write_text(yaml.safe_dump({**raw, "tokenizer": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert load_config(path).tokenizer_path() == "HuggingFaceTB/SmolLM2-135M-Instruct", "a hub id stays one"


def test_a_run_left_where_a_relative_output_dir_used_to_point_is_not_silently_started_anew(tmp_path):
    """A user's config in a subfolder with `output_dir: out` (read from the working directory before the path
    rule) used to start a new, empty run under the config's folder: the finished part of a long run would have
    been generated again from scratch."""
    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT  # tmp_path/out/t
    (tmp_path / "configs").mkdir()
    moved = tmp_path / "configs" / "old.yaml"
    moved.write_text(yaml.safe_dump({**yaml.safe_load(config(tmp_path).read_text()), "output_dir": "out"}))
    refused = regen("generate", "--config", str(moved), cwd=tmp_path)
    assert refused.returncode == BAD_CONFIG, refused.stderr
    assert f"there is {tmp_path / 'out' / 't'}. To resume it, set output_dir: {tmp_path / 'out'}" in refused.stderr
    assert not (tmp_path / "configs" / "out").exists()
    elsewhere = regen("generate", "--config", str(moved), cwd=tmp_path / "configs")  # no old run from here
    assert elsewhere.returncode == STOPPED_AT_PREFLIGHT, elsewhere.stderr


def test_the_shipped_configs_resolve_from_any_folder_to_what_they_named_from_the_repository_root(tmp_path,
                                                                                                 monkeypatch):
    """`make generate` runs them from the root, where `prompts_sources/...` and `outputs` used to be read."""
    monkeypatch.chdir(tmp_path)
    for name in ("local.yaml", "local_vllm.yaml", "kimi_k25_88k.yaml"):
        cfg = load_config(REPO / "configs" / name)
        assert cfg.output_dir == str(REPO / "outputs"), name
        assert all(Path(ref.spec).parent == REPO / "prompts_sources" for ref in cfg.sources), name


def copy_of_todays_run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The run of tests/data/run_89263c8 under tmp_path/outputs, its sources under tmp_path/prompts_sources, and
    its config as the shipped configs now read: under configs/, paths relative to that folder."""
    shutil.copytree(TODAYS_RUN / "local-sample", tmp_path / "outputs" / "local-sample")
    (tmp_path / "prompts_sources").mkdir()
    shutil.copy(REPO / "prompts_sources" / "sample_prompts.yaml", tmp_path / "prompts_sources")
    shutil.copytree(REPO / "prompts_sources" / "sample", tmp_path / "prompts_sources" / "sample")
    raw = yaml.safe_load((TODAYS_RUN / "config.yaml").read_text())
    raw.update(output_dir="../outputs", sources=[{"spec": "../prompts_sources/sample_prompts.yaml"}],
               endpoints=dead_endpoints())
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "local.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, tmp_path / "outputs" / "local-sample", tmp_path / "prompts_sources" / "sample" / "prompts.jsonl"


def test_a_run_json_written_by_89263c8_resumes_with_the_config_in_its_new_form(tmp_path):
    """Its run.json names `prompts_sources/sample_prompts.yaml` (relative to the folder regen ran in); the config
    now says `../prompts_sources/sample_prompts.yaml`. The spec's content and the files' digests decide."""
    path, run, data = copy_of_todays_run(tmp_path)
    assert manifest(run)["prompts"]["sources"] == [{"limit": None, "spec": "prompts_sources/sample_prompts.yaml"}]
    resumed = regen("generate", "--config", str(path), cwd=tmp_path / "configs")
    assert resumed.returncode == STOPPED_AT_PREFLIGHT, resumed.stderr
    now = manifest(run)
    spec = str(tmp_path / "prompts_sources" / "sample_prompts.yaml")
    assert list(now["source_files"]) == [spec] and list(now["prompts"]["specs"]) == [spec]
    assert now["fingerprint"] == "1a1c86c32cf65b40", "the run keeps its fingerprint"

    data.write_bytes(data.read_bytes() + b'{"prompt": "one more"}\n')  # a changed file is still drift
    refused = regen("generate", "--config", str(path), cwd=tmp_path)
    assert refused.returncode == REFUSED and "source file sample/prompts.jsonl" in refused.stderr, refused.stderr


def test_an_old_run_json_whose_spec_path_is_renamed_is_compared_by_content(tmp_path):
    """The rename is by position, and only the text of the path is forgiven: another spec is drift."""
    path, run, _ = copy_of_todays_run(tmp_path)
    other = tmp_path / "prompts_sources" / "sample_prompts.yaml"
    other.write_text(other.read_text().replace("format: prompt", "format: prompt\nlimit: 3"))
    refused = regen("generate", "--config", str(path), cwd=tmp_path / "configs")
    assert refused.returncode == REFUSED
    assert f"prompts.specs.{other}.limit: '<absent>' -> 3" in refused.stderr, refused.stderr


# --- 6. a busy run --------------------------------------------------------------------------------------------
def test_a_second_generate_on_a_busy_new_run_is_refused_before_it_reads_a_source(tmp_path):
    """The first driver is still reading the sources of a new run (it holds the lock; there is no run.json yet).
    The source here cannot be read: a second driver that read it would exit 2 naming it."""
    path = config(tmp_path)
    (tmp_path / "p.jsonl").unlink()
    run = tmp_path / "out" / "t"
    with RunLock(RunDir(run)):  # the second driver is a process of its own here
        refused = subprocess.run(regen_cmd("generate", "--config", str(path)), capture_output=True, text=True,
                                 timeout=120, cwd=REPO)
    assert refused.returncode == LOCKED, refused.stderr
    assert "in use by another regen driver" in refused.stderr and "p.jsonl" not in refused.stderr


def test_a_second_new_run_while_the_first_still_reads_its_sources_is_refused_not_started_beside_it(tmp_path):
    """Two `--new-run`s of one edited config: the first holds `t-r2` and is still reading its sources (no run.json
    yet). The second used to start `t-r3` beside it, sending the same prompts to the fleet twice."""
    assert regen("generate", "--config", str(config(tmp_path))).returncode == STOPPED_AT_PREFLIGHT
    out = tmp_path / "out"
    commit_a_failure(out / "t")
    edited = config(tmp_path, sampling={"max_tokens": 16})
    with RunLock(RunDir(out / "t-r2")):  # the first driver is a process of its own here
        second = subprocess.run(regen_cmd("generate", "--config", str(edited), "--new-run"), capture_output=True,
                                text=True, timeout=120, cwd=REPO)
    assert second.returncode == LOCKED, second.stderr
    assert f"{out / 't-r2'} is being started by another regen driver" in second.stderr
    assert not (out / "t-r3").exists()


def test_a_source_that_fails_still_leaves_no_run_directory(tmp_path):
    path = config(tmp_path)
    (tmp_path / "p.jsonl").unlink()
    failed = regen("generate", "--config", str(path))
    assert failed.returncode == BAD_CONFIG and "p.jsonl" in failed.stderr
    assert not (tmp_path / "out" / "t").exists()
    write_prompts(tmp_path / "p.jsonl", 6)
    assert regen("generate", "--config", str(path)).returncode == STOPPED_AT_PREFLIGHT, "and starts once fixed"


def test_a_source_that_fails_removes_the_folder_a_killed_start_left(tmp_path):
    """A start SIGKILLed while it read its sources leaves the folder its lock made (no run.json). A later start
    whose source fails used to leave that folder, as it had not made it (a concurrent start that removed it and
    re-made it between the two drivers' checks left one the same way)."""
    path = config(tmp_path)
    (tmp_path / "p.jsonl").unlink()
    run = tmp_path / "out" / "t"
    run.mkdir(parents=True)
    (run / "run.lock").touch()
    (run / "lock.json").write_text('{"pid": 999999999, "host": "elsewhere"}')
    failed = regen("generate", "--config", str(path))
    assert failed.returncode == BAD_CONFIG and "p.jsonl" in failed.stderr
    assert not run.exists()
