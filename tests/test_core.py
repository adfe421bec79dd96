"""The pure core, without Ray or HTTP: config, error classification, the store and its ledger."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.core.config import flat_diff, load_config
from pipeline.endpoints.classify import classify
from pipeline.endpoints.client import parse_chat
from pipeline.store import schema
from pipeline.core.errors import (
    ConfigError, EndpointDown, EndpointFatal, Retryable, RunLocked, SecretMissing, StorageError, TerminalForPrompt,
)
from pipeline.store.committer import Committer
from pipeline.store.rundir import RunDir, RunLock, atomic_write, now_utc, resolve_run_dir

SAMPLE_SPEC = Path(__file__).resolve().parent.parent / "prompts_sources" / "sample_prompts.yaml"
BASE = f"""
run_name: r
model: m
sources: [{{spec: {SAMPLE_SPEC}}}]
endpoints: [{{url: "http://127.0.0.1:1/v1", concurrency: 2, api_key_env: REGEN_TEST_KEY}}]
"""


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# --- config ----------------------------------------------------------------------------------------
def test_unknown_key_names_the_key_and_the_file(tmp_path):
    path = write(tmp_path, BASE + "sampling: {temperature: 0.5, max_tokns: 10}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "sampling.max_tokns" in str(err.value) and str(path) in str(err.value)


def test_an_unusable_output_location_is_refused_at_load(tmp_path):
    for where, says in [("ftp://host/out", "s3://"), ("s3://KEY:SECRET@bucket/out", "credentials")]:
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, BASE + f"output_dir: {where}\n"))
        assert "output_dir" in str(err.value) and says in str(err.value) and "SECRET" not in str(err.value)
    assert load_config(write(tmp_path, BASE + "output_dir: s3://bucket/regen\n")).output_dir == "s3://bucket/regen"
def test_unknown_endpoint_key_and_missing_key_are_named(tmp_path):
    text = BASE.replace("concurrency: 2", "concurency: 2").replace("model: m\n", "")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert "endpoints.0.concurency" in str(err.value) and "missing key 'model'" in str(err.value)


def test_endpoint_url_is_normalised_and_fingerprint_ignores_the_fleet(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.endpoints[0].url == "http://127.0.0.1:1"
    other = load_config(write(tmp_path, BASE.replace("127.0.0.1:1", "127.0.0.1:2")))
    assert other.fingerprint() == cfg.fingerprint(), "endpoints do not shape the data"
    warmer = load_config(write(tmp_path, BASE + "sampling: {temperature: 0.9}\n"))
    assert warmer.fingerprint() != cfg.fingerprint()
    assert flat_diff(cfg.generation_identity(), warmer.generation_identity()) == ["sampling.temperature: 0.0 -> 0.9"]


def test_thinking_is_sent_as_kimi_template_kwarg(tmp_path):
    cfg = load_config(write(tmp_path, BASE + "thinking: false\n"))
    assert cfg.template_kwargs() == {"thinking": False}


def test_missing_api_key_variable_is_a_clear_error(tmp_path, monkeypatch):
    cfg = load_config(write(tmp_path, BASE))
    monkeypatch.delenv("REGEN_TEST_KEY", raising=False)
    with pytest.raises(SecretMissing) as err:
        cfg.check_secrets()
    assert "REGEN_TEST_KEY" in str(err.value)
    monkeypatch.setenv("REGEN_TEST_KEY", "sk-secret-value")
    assert cfg.api_key(cfg.endpoints[0]) == "sk-secret-value"
    assert "sk-secret-value" not in repr(cfg.model_dump()), "the key never enters the config"


# --- the error classifier, one case per real server message ---------------------------------------------
@pytest.mark.parametrize("status, message, expected", [
    (400, "The input (300000 tokens) is longer than the model's context length (262144 tokens).", TerminalForPrompt),
    (400, "Requested token count exceeds the model's maximum context length of 262144 tokens.", TerminalForPrompt),
    (400, "request (3031 tokens) exceeds the available context size (512 tokens), try increasing it",
     TerminalForPrompt),
    (400, "Duplicate request ID detected", Retryable),
    (400, "messages: field required", TerminalForPrompt),
    (400, "The model `x` does not exist. The served model name is `moonshotai/Kimi-K2.5`.", EndpointFatal),
    (404, "The model `x` does not exist.", EndpointFatal),
    (401, "Invalid API key", EndpointFatal),
    (429, "rate limited", Retryable),
    (503, "The request queue is full.", Retryable),
    (503, "Request waiting timeout reached.", Retryable),
    (500, "Internal server error", Retryable),
    (502, "Bad gateway", Retryable),
    (None, "connection refused", EndpointDown),
])
def test_classify_each_real_message(status, message, expected):
    error = classify(status, message, "e0")
    assert type(error) is expected
    assert error.status == status and error.endpoint == "e0"


def test_context_overflow_keeps_the_server_message():
    error = classify(400, "The input (9 tokens) is longer than the model's context length (8 tokens).")
    assert "The input (9 tokens)" in error.message


def test_parse_chat_reads_sglang_extras():
    body = {"id": "r1", "model": "moonshotai/Kimi-K2.5",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "", "reasoning_content": "hmm"},
                         "finish_reason": "length", "matched_stop": None}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 120, "total_tokens": 140,
                      "prompt_tokens_details": {"cached_tokens": 7}, "reasoning_tokens": 95},
            "metadata": {"weight_version": "v3"}}
    c = parse_chat(body, 1.5, "r1")
    assert (c.content, c.reasoning_content, c.finish_reason) == ("", "hmm", "length")
    assert (c.cached_tokens, c.reasoning_tokens, c.weight_version) == (7, 95, "v3")


# --- store ------------------------------------------------------------------------------------------
def record(pid: str) -> dict:
    return {"prompt_id": pid, "turn_index": 0, "source": "s", "messages": [{"role": "user", "content": "q"}],
            "content": "a", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
            "created_at": now_utc()}


def test_committer_commits_each_prompt_once_and_the_ledger_reads_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=3, flush_interval_s=60)
    assert committer.add_records([record("a")]) and committer.add_records([record("b")])
    assert not committer.add_records([record("a")]), "a buffered duplicate is dropped"
    committer.add_records([record("c")])
    committer.maybe_flush()
    assert not committer.add_records([record("b")]), "a committed duplicate is dropped"
    committer.add_failure({"prompt_id": "d", "message": "x", "created_at": now_utc()})
    committer.flush()
    assert run.committed_ids() == {"a", "b", "c"} and run.failed_ids() == {"d"}
    assert committer.dropped_duplicates == 2
    assert len(run.parts(run.data)) == 1
    assert pq.read_table(run.parts(run.data)[0]).schema.equals(schema.RECORDS)
    resumed = Committer(run, done=run.committed_ids() | run.failed_ids(), flush_records=3, flush_interval_s=60)
    assert not resumed.add_records([record("c")]) and not resumed.add_failure({"prompt_id": "d"})


def test_flush_interval_commits_a_small_buffer(tmp_path, monkeypatch):
    import types

    import pipeline.store.committer as committer_module

    clock = [1000.0]  # the committer's clock, moved by the test: a busy machine's pause between lines moves nothing
    monkeypatch.setattr(committer_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=0.5)
    committer.add_records([record("a")])
    clock[0] += 0.25
    assert not committer.due()
    committer.maybe_flush()
    assert run.committed_ids() == set()
    clock[0] += 0.25
    committer.maybe_flush()
    assert run.committed_ids() == {"a"}


def test_atomic_write_cleans_up_and_names_a_full_disk(tmp_path, monkeypatch):
    target = tmp_path / "x.parquet"

    def no_space(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(StorageError) as err:
        atomic_write(target, b"data")
    assert "no space left" in str(err.value) and not list(tmp_path.iterdir())


def test_cleanup_removes_only_temporary_files(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    committer = Committer(run, done=set(), flush_records=1, flush_interval_s=60)
    committer.add_records([record("a")])
    committer.flush()
    Path(run.data / ".tmp-part-000002-deadbeef.parquet.1234").write_bytes(b"torn")
    removed = run.cleanup_temp()
    assert [p.name for p in removed] == [".tmp-part-000002-deadbeef.parquet.1234"]
    assert run.committed_ids() == {"a"}


def test_resolve_run_dir_new_run_makes_a_successor(tmp_path):
    def matches(fingerprint):
        return lambda run: run.read_manifest()["fingerprint"] == fingerprint

    first = resolve_run_dir(tmp_path, "r", new_run=False)
    first.create()
    first.write_manifest({"fingerprint": "fp1"})
    assert resolve_run_dir(tmp_path, "r", False, matches("fp2")).path == first.path, "drift guard decides"
    assert resolve_run_dir(tmp_path, "r", True, matches("fp1")).path == first.path, "--new-run resumes a match"
    second = resolve_run_dir(tmp_path, "r", True, matches("fp2"))
    assert second.path.name == "r-r2"
    second.create()
    second.write_manifest({"fingerprint": "fp2"})
    assert resolve_run_dir(tmp_path, "r", False, matches("fp3")).path == second.path, "resume the newest run"


def test_a_run_whose_own_name_ends_in_rN_is_not_taken_for_a_successor(tmp_path):
    """`exp` and a user's own run `exp-r2` side by side. Before the fix `regen generate` of exp resumed exp-r2."""
    for name in ("exp", "exp-r2"):
        run = RunDir(tmp_path / name)
        run.create()
        run.write_manifest({"fingerprint": name, "run_name": name})
    assert resolve_run_dir(tmp_path, "exp", new_run=False).path.name == "exp"
    assert resolve_run_dir(tmp_path, "exp", True, lambda run: False).path.name == "exp-r2", \
        "the successor's number is free: exp-r2 is not one of exp's runs"
    assert resolve_run_dir(tmp_path, "exp-r2", new_run=False).path.name == "exp-r2"


def test_cleanup_removes_temporary_files_in_logs_too(tmp_path):
    """A remote run's logs are uploaded through a temporary name; before the fix one left in logs/ stayed."""
    run = RunDir(tmp_path / "run")
    run.create()
    Path(run.logs / ".tmp-regen.log.1234").write_bytes(b"torn")
    assert [p.name for p in run.cleanup_temp()] == [".tmp-regen.log.1234"]


def test_a_prompt_set_version_is_numbered_past_the_highest(tmp_path):
    """Versions 1 and 3 are there (2 deleted by hand). Before the fix the next one was numbered len + 1 = 3 and
    replaced the newest set."""
    import pyarrow as pa

    run = RunDir(tmp_path / "run")
    run.create()
    for version in (1, 2, 3):
        run.write_prompt_set(pa.table({"prompt_id": [f"v{version}"]}), pa.table({"reason": ["-"]}))
    (run.prompts / "prompts-000002.parquet").unlink()
    newest = (run.prompts / "prompts-000003.parquet").read_bytes()
    path = run.write_prompt_set(pa.table({"prompt_id": ["v4"]}), pa.table({"reason": ["-"]}))
    assert path.name == "prompts-000004.parquet" and (run.prompts / "prompts-000003.parquet").read_bytes() == newest
    assert run.load_prompt_set().column("prompt_id").to_pylist() == ["v4"]


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pipeline.store.rundir import RunDir, RunLock
        lock = RunLock(RunDir(Path({str(run.path)!r}))).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunLocked) as err:
        RunLock(run).acquire()
    assert f"pid {holder.pid}" in str(err.value)
    holder.kill()
    holder.wait()
    lock = RunLock(run).acquire()
    assert lock.previous_holder["pid"] == holder.pid, "the stale holder is named when taken over"
    lock.release()
