"""The run's identity through the real `regen generate`: what a resume compares (the fingerprint), a run.json
written by older code, --new-run out of every kind of drift, successor numbers, and signals before dispatch.

Where a test needs only the drift guard, the fleet is one endpoint where nothing listens: a resume the guard
allows goes on to the preflight, which gives up on it (exit 1, "no endpoint is reachable"); one it refuses
exits 3 first. Neither needs Ray."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.emulator import start_emulator
from tests.helpers import (KILLED, KILLED_BEFORE_ITS_PREFLIGHT, commit_a_failure, committed_ids, data_parts,
                           free_port, regen_cmd, wait_for, write_config, write_prompts, write_source)

REPO = Path(__file__).resolve().parent.parent
OLD_RUN = REPO / "tests" / "data" / "run_c15f75f"  # written by regen at c15f75f: see its config.yaml
MODEL = "moonshotai/Kimi-K2.5"
REFUSED, STOPPED_AT_PREFLIGHT = 3, 1


def regen(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`regen` run from the repository (the old run's sources are named relative to it)."""
    return subprocess.run(regen_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def dead_fleet() -> dict:
    return {"endpoints": [{"url": f"http://127.0.0.1:{free_port()}", "name": "dead"}], "dead_fleet_deadline_s": 0.5}


def manifest(run: Path) -> dict:
    return orjson.loads((run / "run.json").read_bytes())


def sample_config(tmp_path: Path, n: int = 6, **overrides) -> Path:
    """tmp_path/config.yaml over n prompts (the same file on every call); `overrides` are config keys."""
    prompts = tmp_path / "p.jsonl"
    if not prompts.exists():
        write_prompts(prompts, n)
    endpoints = overrides.pop("endpoints")
    return write_config(tmp_path, endpoints, [write_source(tmp_path, prompts)], model=MODEL, **overrides)


# --- the fingerprint (issue 13, defect 11) ----------------------------------------------------------------
@pytest.mark.parametrize("key, changed", [("return_token_ids", False), ("stream", True)])
def test_token_ids_and_streaming_are_part_of_the_identity(tmp_path, key, changed):
    config = sample_config(tmp_path, **dead_fleet())
    fingerprint = load_config(config).fingerprint()
    assert regen("generate", "--config", str(config), env=KILLED_BEFORE_ITS_PREFLIGHT).returncode == KILLED
    commit_a_failure(tmp_path / "out" / "t")  # bound: a run that has committed nothing takes any config
    other = sample_config(tmp_path, **{key: changed}, **dead_fleet())
    assert load_config(other).fingerprint() != fingerprint
    refused = regen("generate", "--config", str(other))
    assert refused.returncode == REFUSED, refused.stderr
    assert f"generation.{key}: {not changed!r} -> {changed!r}" in refused.stderr and "--new-run" in refused.stderr


# --- the mechanism: keys a stored run.json lacks --------------------------------------------------------
def test_a_key_older_code_did_not_record_is_adopted_but_a_users_template_key_is_compared(tmp_path):
    from pipeline.core.identity import IDENTITY_VERSION, check_identity

    cfg = load_config(sample_config(tmp_path, thinking=True, **dead_fleet()))
    identity = cfg.identity()
    older = orjson.loads(orjson.dumps(identity))
    del older["generation"]["sampling"]["top_p"]  # as if top_p had been added to Sampling after this run began
    check = check_identity(older, identity, refresh_prompts=False)
    assert check.resumable and check.adopted == {"generation.sampling.top_p": 1.0}

    without_thinking = orjson.loads(orjson.dumps(identity))
    without_thinking["generation"]["chat_template_kwargs"] = {}
    check = check_identity(without_thinking, identity, refresh_prompts=False)
    # a value compared whole (not a section whose missing keys are adopted), shown key by key
    assert check.drift == ["generation.chat_template_kwargs.thinking: '<absent>' -> True"] and not check.adopted

    newer = {**identity, "identity_version": IDENTITY_VERSION + 1}
    assert not check_identity(newer, identity, refresh_prompts=False).resumable, "unknown keys cannot be checked"


# --- a run.json written by the code at c15f75f ------------------------------------------------------------
def old_run_config(tmp_path: Path, servers, **changes) -> Path:
    cfg = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    cfg["sources"] = [{**ref, "spec": str(REPO / ref["spec"])} for ref in cfg["sources"]]  # it ran from REPO
    cfg.update(output_dir=str(tmp_path / "out"), dead_fleet_deadline_s=120,  # > an actor start on a loaded machine
               endpoints=[{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)])
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_run_written_by_c15f75f_is_refused_where_its_unrecorded_settings_differ(tmp_path, ray_cluster):
    """c15f75f recorded neither stream nor return_token_ids, and sent no explicit top_k/min_p/repetition_penalty.
    Before the fix a resume adopted all three from today's config, whatever it said (a streamed resume mixed rows
    without token ids into a run with them). Now what its records show is compared (they carry token ids: it
    asked for them, unstreamed), and the explicit sampling it never sent refuses the resume: --new-run."""
    run = tmp_path / "out" / "old"
    shutil.copytree(OLD_RUN / "old", run)
    old_manifest = (run / "run.json").read_bytes()
    old_parts = {p.name: p.read_bytes() for p in data_parts(run)}
    assert 0 < len(committed_ids(run)) < 12 and "identity_version" not in orjson.loads(old_manifest)
    server = start_emulator(preset="kimi")
    try:
        changed = regen("generate", "--config", str(old_run_config(tmp_path, [server], sampling={"max_tokens": 9})))
        assert changed.returncode == REFUSED and "sampling.max_tokens: 8 -> 9" in changed.stderr

        same = regen("generate", "--config", str(old_run_config(tmp_path, [server])))
        assert same.returncode == REFUSED, same.stderr
        assert "generation.explicit_sampling: regen before identity version 2 sent no top_k" in same.stderr
        assert "--new-run" in same.stderr and "generation.stream" not in same.stderr, \
            "stream and return_token_ids are known from the records, and match"

        streamed = regen("generate", "--config", str(old_run_config(tmp_path, [server], stream=True)))
        assert streamed.returncode == REFUSED and "generation.stream: False -> True" in streamed.stderr, \
            "its records carry token ids: it did not stream"
        assert (run / "run.json").read_bytes() == old_manifest, "a refused resume changes nothing"

        successor = regen("generate", "--new-run", "--config", str(old_run_config(tmp_path, [server])))
        assert successor.returncode == 0, successor.stderr
        assert len(set(committed_ids(tmp_path / "out" / "old-r2"))) == 12
        assert (run / "run.json").read_bytes() == old_manifest
        assert {p.name: p.read_bytes() for p in data_parts(run)} == old_parts, "the old run stays as it was"
    finally:
        server.stop()


def test_an_older_run_json_takes_unrecorded_keys_from_its_records_or_refuses(tmp_path):
    """Without the fix each case adopted the config's values: nothing was refused."""
    from pipeline.core.identity import StoredRecords, check_identity

    cfg = load_config(sample_config(tmp_path, **dead_fleet()))
    identity = cfg.identity()
    v1 = orjson.loads(orjson.dumps(identity))
    for key in ("stream", "return_token_ids", "explicit_sampling"):
        del v1["generation"][key]

    empty = check_identity(v1, identity, refresh_prompts=False, records=StoredRecords())
    assert empty.resumable and {"generation.stream", "generation.explicit_sampling"} <= set(empty.adopted), \
        "no record was made with the old values: the config's are recorded"

    blind = check_identity(v1, identity, refresh_prompts=False, records=StoredRecords(count=5, with_token_ids=0))
    keys = sorted(line.split(":")[0] for line in blind.drift)
    assert keys == ["generation.explicit_sampling", "generation.return_token_ids", "generation.stream"], blind.drift
    assert all("--new-run" in line for line in blind.drift) and not blind.adopted.keys() & set(keys)
    assert "cannot be told" in next(line for line in blind.drift if line.startswith("generation.stream"))

    shown = check_identity(v1, identity, refresh_prompts=False, records=StoredRecords(count=5, with_token_ids=5))
    assert [line.split(":")[0] for line in shown.drift] == ["generation.explicit_sampling"], shown.drift


# --- --new-run and successors (defects 9 and 13) -----------------------------------------------------
def test_new_run_starts_a_successor_when_the_prompt_set_config_changed(tmp_path, ray_cluster):
    server = start_emulator(preset="kimi")
    try:
        endpoint = [{"url": server.url, "concurrency": 4, "name": "emu"}]
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 8)
        spec = write_source(tmp_path, prompts)
        config = write_config(tmp_path, endpoint, [spec], model=MODEL)
        assert regen("generate", "--config", str(config)).returncode == 0
        first = tmp_path / "out" / "t"
        first_manifest = (first / "run.json").read_bytes()

        limited = write_config(tmp_path, endpoint, [spec], model=MODEL, sources=[{"spec": str(spec), "limit": 5}])
        refused = regen("generate", "--config", str(limited))
        assert refused.returncode == REFUSED and "sources" in refused.stderr and "--new-run" in refused.stderr
        fresh = regen("generate", "--config", str(limited), "--new-run")
        assert fresh.returncode == 0, fresh.stderr
        successor = tmp_path / "out" / "t-r2"
        assert len(set(committed_ids(successor))) == len(committed_ids(successor)) == 5
        assert (first / "run.json").read_bytes() == first_manifest and len(committed_ids(first)) == 8
        again = regen("generate", "--config", str(limited))
        assert again.returncode == 0 and f"{successor} is complete" in again.stderr, "the successor is resumed"
    finally:
        server.stop()


def weights_config(tmp_path: Path, server, **overrides) -> Path:
    return sample_config(tmp_path, 20, endpoints=[{"url": server.url, "concurrency": 1, "name": "emu"}],
                         sampling={"temperature": 0.0, "max_tokens": 16}, **overrides)


def test_new_run_starts_a_successor_when_the_fleet_serves_other_weights(tmp_path, ray_cluster):
    first, second, third = (tmp_path / "out" / name for name in ("t", "t-r2", "t-r3"))
    # its last prompt hangs: the run is surely live when SIGINTed (it took about 8 s, over if the test got late)
    slow = start_emulator(preset="kimi", weight_version="w1", tok_per_s=40, poison_text="(#19)", poison_fault="hang")
    try:  # a run stopped half way at weights w1
        proc = subprocess.Popen(regen_cmd("generate", "--config", str(weights_config(tmp_path, slow))), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: len(committed_ids(first)) >= 2, 120, what="the first records")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        slow.stop()
    done_at_w1 = committed_ids(first)
    assert 2 <= len(done_at_w1) < 20
    server = start_emulator(preset="kimi", weight_version="w2")
    try:
        config = weights_config(tmp_path, server)
        refused = regen("generate", "--config", str(config))
        assert refused.returncode == REFUSED, refused.stderr
        assert "weight_version: 'w1' -> 'w2'" in refused.stderr and "--new-run" in refused.stderr
        first_manifest = (first / "run.json").read_bytes()
        later = time.time() + 100  # the sources copied, same content: a resume would record their new times
        os.utime(tmp_path / "p.jsonl", (later, later))
        fresh = regen("generate", "--config", str(config), "--new-run")
        assert fresh.returncode == 0, fresh.stderr
        rows = [r for p in data_parts(second) for r in pq.read_table(p).to_pylist()]
        assert len(rows) == len({r["prompt_id"] for r in rows}) == 20 and {r["weight_version"] for r in rows} == {"w2"}
        assert manifest(second)["weight_version"] == "w2" and committed_ids(first) == done_at_w1
        assert (first / "run.json").read_bytes() == first_manifest, "the run at w1 stays as it was"
    finally:
        server.stop()
    server = start_emulator(preset="kimi", weight_version="w3")
    try:  # a complete run is probed too when --new-run is asked for
        config = weights_config(tmp_path, server)
        assert "is complete" in regen("generate", "--config", str(config)).stderr, "a plain rerun does not probe"
        fresh = regen("generate", "--config", str(config), "--new-run")
        assert fresh.returncode == 0, fresh.stderr
        assert manifest(third)["weight_version"] == "w3" and len(set(committed_ids(third))) == 20
    finally:
        server.stop()


def test_a_successor_is_numbered_past_the_highest_even_after_one_was_deleted(tmp_path):
    out = tmp_path / "out"
    for temperature in (0.0, 0.1, 0.2):
        config = sample_config(tmp_path, sampling={"temperature": temperature, "max_tokens": 8}, **dead_fleet())
        assert regen("generate", "--config", str(config), "--new-run", env=KILLED_BEFORE_ITS_PREFLIGHT).returncode \
            == KILLED
        commit_a_failure(max(out.iterdir(), key=lambda p: p.stat().st_mtime_ns))  # bound: else it is reused
    assert sorted(p.name for p in out.iterdir()) == ["t", "t-r2", "t-r3"]
    shutil.rmtree(out / "t-r2")
    r3 = (out / "t-r3" / "run.json").read_bytes()

    config = sample_config(tmp_path, sampling={"temperature": 0.3, "max_tokens": 8}, **dead_fleet())
    result = regen("generate", "--config", str(config), "--new-run", env=KILLED_BEFORE_ITS_PREFLIGHT)
    assert result.returncode == KILLED, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["t", "t-r3", "t-r4"]
    assert (out / "t-r3" / "run.json").read_bytes() == r3
    assert manifest(out / "t-r4")["generation"]["sampling"]["temperature"] == 0.3


# --- the retired generating-request hidden states ---------------------------------------------------------
# What regen wrote into run.json's generation identity for a run with hidden_states.enabled (before its retirement).
OLD_HIDDEN_IDENTITY = {"enabled": True, "expected_width": 21504, "dtype": "bf16",
                       "layers_note": "EAGLE-3 auxiliary layers [2, L//2, L-3] as SGLang captures them"}


@pytest.mark.parametrize("section, named", [
    ({"enabled": True}, "hidden_states.enabled"),
    ({"enabled": False, "expected_width": 21504}, "hidden_states.enabled, hidden_states.expected_width"),
    ({"expected_width": 7168}, "hidden_states.expected_width"),
])
def test_a_config_with_a_hidden_states_key_is_refused_naming_it_and_regen_capture(tmp_path, section, named):
    config = sample_config(tmp_path, hidden_states=section, **dead_fleet())
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    message = str(refused.value)
    assert str(config) in message and f"{named}: the generating request no longer returns hidden states" in message
    assert "regen capture RUN --config capture.yaml" in message


def test_regen_generate_refuses_hidden_states_enabled_before_it_writes_anything(tmp_path):
    config = sample_config(tmp_path, hidden_states={"enabled": True, "expected_width": 21504}, **dead_fleet())
    done = regen("generate", "--config", str(config))
    assert done.returncode != 0 and "hidden_states.enabled" in done.stderr and "regen capture" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_hidden_states_enabled_false_is_ignored_and_changes_no_fingerprint(tmp_path):
    """An old config's `hidden_states: {enabled: false}`: accepted, and the run it made resumes without it."""
    old = sample_config(tmp_path, hidden_states={"enabled": False}, **dead_fleet())
    fingerprint = load_config(old).fingerprint()
    assert regen("generate", "--config", str(old), env=KILLED_BEFORE_ITS_PREFLIGHT).returncode == KILLED
    run = tmp_path / "out" / "t"
    assert manifest(run)["fingerprint"] == fingerprint and manifest(run)["generation"]["hidden_states"] is None
    without = sample_config(tmp_path, **dead_fleet())
    assert load_config(without).fingerprint() == fingerprint
    resumed = regen("generate", "--config", str(without))
    assert resumed.returncode == STOPPED_AT_PREFLIGHT and "started with another config" not in resumed.stderr, \
        resumed.stderr


def test_a_run_that_captured_hidden_states_while_generating_refuses_its_resume(tmp_path):
    """Its records name hidden parts this regen does not write: the resume is refused with the reason and what to
    do; --new-run starts a successor without them."""
    config = sample_config(tmp_path, **dead_fleet())
    assert regen("generate", "--config", str(config), env=KILLED_BEFORE_ITS_PREFLIGHT).returncode == KILLED
    run = tmp_path / "out" / "t"
    commit_a_failure(run)
    old = manifest(run)
    old["generation"]["hidden_states"] = OLD_HIDDEN_IDENTITY
    (run / "run.json").write_bytes(orjson.dumps(old))
    refused = regen("generate", "--config", str(config))
    assert refused.returncode == REFUSED, refused.stderr
    assert "generation.hidden_states: this run captured hidden states through the generating request" in refused.stderr
    assert "regen capture RUN --config capture.yaml" in refused.stderr and "--new-run" in refused.stderr
    assert manifest(run) == old, "the refused run is left as it was"
    successor = regen("generate", "--config", str(config), "--new-run", env=KILLED_BEFORE_ITS_PREFLIGHT)
    assert successor.returncode == KILLED, successor.stderr
    assert manifest(tmp_path / "out" / "t-r2")["generation"]["hidden_states"] is None


# --- signals before dispatch (defect 13) -------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_preflight_wait_exits_130(tmp_path, signum):
    config = sample_config(tmp_path, endpoints=dead_fleet()["endpoints"], dead_fleet_deadline_s=300)
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(regen_cmd("generate", "--config", str(config)), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: b"no endpoint is reachable yet" in log.read_bytes(), 120, what="the preflight wait")
        proc.send_signal(signum)
        # the events, each with a deadline a loaded machine meets: the signal obeyed (its line), then the exit;
        # the fleet's own deadline (300 s) would end the run otherwise, with a refusal
        wait_for(lambda: b"received: stopping" in log.read_bytes(), 120, what="the signal's line")
        assert proc.wait(timeout=120) == 130
        assert "interrupted" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_empty_hidden_states_section_is_accepted_like_a_disabled_one(tmp_path):
    empty = sample_config(tmp_path, hidden_states={}, **dead_fleet())
    assert load_config(empty).fingerprint() == load_config(sample_config(tmp_path, **dead_fleet())).fingerprint()
