"""Which engine made a run, and what regen says about it: a readmitted endpoint on another engine stays out, a
resume on another engine is drift, a run from before schema 3 does not claim an engine for its old records, the
probe asks for ids on the run's own transport, and engines it cannot identify are named. Real emulator and
llama.cpp processes on 127.0.0.1, and small HTTP servers that answer like vLLM (tests/fake_engines.py)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.dispatch.actors import client_settings, local_worker_factory
from pipeline.dispatch.fleet import UNRECORDED_ENGINE, EngineDrift, fleet_preflight
from pipeline.emulator import start_emulator
from pipeline.endpoints.engines import OpenAIAdapter, VLLMAdapter
from pipeline.endpoints.localfleet import wait_healthy
from pipeline.endpoints.preflight import probe_fleet
from pipeline.store.committer import Committer
from pipeline.store.rundir import RunDir, now_utc
from pipeline.store import schema
from tests.fake_engines import DEV_MODE_SERVER_INFO, FakeVLLM
from tests.helpers import data_parts, free_port, run_regen, write_config, write_prompts, write_source

MODEL = "SmolLM2-135M-Instruct"


def make_cfg(urls: list[str], tmp_path=None, **overrides) -> RunConfig:
    raw = {"run_name": "engine-test", "model": MODEL, "sources": [{"spec": "prompts_sources/sample_prompts.yaml"}],
           "endpoints": [{"url": url, "name": f"e{i}"} for i, url in enumerate(urls)],
           "sampling": {"temperature": 0.0, "max_tokens": 8}, "dead_fleet_deadline_s": 5}
    if tmp_path is not None:
        raw["output_dir"] = str(tmp_path / "out")
    raw.update(overrides)
    return RunConfig.model_validate(raw)


@pytest.fixture(scope="module")
def sglang():
    server = start_emulator(preset="kimi", served_model_name=MODEL)
    yield server
    server.stop()


# --- 1. readmission ---------------------------------------------------------------------------------------
async def _readmit(worker) -> tuple[bool, str, str]:
    try:
        return await worker._passes_preflight(), worker.last_error, worker.state
    finally:
        await worker.close()


def test_a_readmitted_endpoint_on_another_engine_stays_out(sglang):
    """The run's preflight admitted llama.cpp; the endpoint comes back as SGLang: refused, and for good (its
    state is fatal, so the driver drops it with that reason in its log)."""
    cfg = make_cfg([sglang.url])
    endpoint = cfg.all_endpoints()[0]
    same = local_worker_factory(cfg, client_settings(cfg, run_engines=[{"engine": "sglang", "version": "0.5.23"}]),
                                lambda e: None)
    assert asyncio.run(_readmit(same(endpoint, True)))[0], "the run's own engine is readmitted"
    other = local_worker_factory(cfg, client_settings(cfg, run_engines=[{"engine": "llamacpp", "version": "b6670"}]),
                                 lambda e: None)
    admitted, why, state = asyncio.run(_readmit(other(endpoint, True)))
    assert not admitted and state == "fatal"
    assert "it now runs sglang 0.5.23, not the run's engine (llamacpp b6670)" in why
    newer = local_worker_factory(cfg, client_settings(cfg, run_engines=[{"engine": "sglang", "version": "0.5.18"}]),
                                 lambda e: None)
    admitted, why, state = asyncio.run(_readmit(newer(endpoint, True)))
    assert not admitted and "a version the run's preflight did not admit (sglang 0.5.18)" in why
    assert state == "open", "another version is refused this time only: the breaker probes it again"


# --- 3 and 4. resume ----------------------------------------------------------------------------------------
def _run_dir(tmp_path, manifest: dict, records: int = 0) -> RunDir:
    run = RunDir(tmp_path / "out" / "engine-test")
    run.create()
    run.write_manifest(manifest)
    if records:
        committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60,
                              records_schema=schema.records_schema(manifest.get("schema_version")))
        for i in range(records):
            committer.add_records([{"prompt_id": f"p{i}", "turn_index": 0, "source": "s",
                                    "messages": [{"role": "user", "content": "q"}], "content": "a",
                                    "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
                                    "deterministic": True, "created_at": now_utc()}])
        committer.flush()
    return run


def test_a_resume_on_another_engine_is_drift(sglang, tmp_path):
    manifest = {"schema_version": 3, "engines": [{"engine": "llamacpp", "version": "b6670"}]}
    run = _run_dir(tmp_path, manifest, records=2)
    with pytest.raises(EngineDrift) as info:
        fleet_preflight(make_cfg([sglang.url], tmp_path), run)
    assert info.value.diff == ["engines: ['llamacpp'] -> ['sglang'] (reported by the fleet)"]
    assert "--new-run" in str(info.value)
    assert run.read_manifest() == manifest, "run.json is left as it was"


def test_a_resume_on_the_same_engine_adds_its_new_version(sglang, tmp_path):
    run = _run_dir(tmp_path, {"schema_version": 3, "engines": [{"engine": "sglang", "version": "0.5.18"}]}, 2)
    facts = fleet_preflight(make_cfg([sglang.url], tmp_path), run)
    assert run.read_manifest()["engines"] == [{"engine": "sglang", "version": "0.5.18"},
                                              {"engine": "sglang", "version": "0.5.23"}]
    assert facts.run_engines == run.read_manifest()["engines"]


def test_a_run_from_before_schema_3_does_not_claim_an_engine_for_its_old_records(sglang, tmp_path, caplog):
    """Its records came from an engine nobody recorded: run.json says so, then names this session's engine; the
    resume is accepted, with a note."""
    run = _run_dir(tmp_path, {"schema_version": 2}, records=2)
    with caplog.at_level(logging.WARNING, logger="regen.fleet"):
        facts = fleet_preflight(make_cfg([sglang.url], tmp_path), run)
    assert run.read_manifest()["engines"] == [UNRECORDED_ENGINE, {"engine": "sglang", "version": "0.5.23"}]
    assert UNRECORDED_ENGINE["engine"] is None
    assert facts.run_engines == [{"engine": "sglang", "version": "0.5.23"}]
    assert any("did not record their inference engine" in r.getMessage() for r in caplog.records)


def test_a_new_run_records_only_its_engine(sglang, tmp_path):
    run = _run_dir(tmp_path, {"schema_version": 3})
    fleet_preflight(make_cfg([sglang.url], tmp_path), run)
    assert run.read_manifest()["engines"] == [{"engine": "sglang", "version": "0.5.23"}]


# --- 2, 5, 7. identification and the probe ----------------------------------------------------------------
@pytest.fixture
def fake():
    started: list[FakeVLLM] = []

    def start(**options) -> FakeVLLM:
        started.append(FakeVLLM(**options).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


def probe(cfg: RunConfig):
    return asyncio.run(probe_fleet(cfg, {}))


def test_a_vllm_in_dev_mode_is_vllm_not_sglang(fake):
    """VLLM_SERVER_DEV_MODE=1 adds /server_info with vLLM's own keys: owned_by and /version still decide, and
    vLLM's `reasoning` is read (a thinking run passes)."""
    server = fake(server_info=DEV_MODE_SERVER_INFO, reasoning="2 + 2 is 4")
    [report] = probe(make_cfg([server.url], thinking=True))
    assert report.engine == VLLMAdapter(version="0.32.0")
    assert report.ok, report.problems
    assert report.sglang is False and not any("SGLang" in w for w in report.warnings), report.warnings


def test_a_run_leaving_thinking_to_a_server_of_unknown_parser_is_warned(fake, sglang):
    [report] = probe(make_cfg([fake().url]))
    assert any("does not report its reasoning parser" in w for w in report.warnings), report.warnings
    [decided] = probe(make_cfg([fake().url], thinking=False))
    assert not any("reasoning parser" in w for w in decided.warnings)
    [known] = probe(make_cfg([sglang.url]))  # SGLang reports its parser (kimi_k2)
    assert not any("does not report its reasoning parser" in w for w in known.warnings)


def test_sglang_is_still_identified_by_its_server_info(sglang):
    [report] = probe(make_cfg([sglang.url]))
    assert report.engine.engine == "sglang" and report.engine.version == "0.5.23" and report.sglang


def test_stream_with_token_ids_probes_the_ids_on_a_stream(fake):
    """The run streams and stores ids: the probe streams too. An unidentified server (a proxy: owned_by openai,
    no /version) is asked for none on a stream, so it is refused before the run; vLLM itself passes."""
    proxied = fake(owned_by="openai", version=None)
    [report] = probe(make_cfg([proxied.url], stream=True, return_token_ids=True))
    assert not report.ok
    assert any("returns no output token ids" in p and "a tiny streamed generation" in p for p in report.problems)
    assert any(r.get("stream") for r in proxied.requests), "the probe streamed"
    direct = fake()
    [report] = probe(make_cfg([direct.url], stream=True, return_token_ids=True))
    assert report.ok, report.problems
    assert any(r.get("stream") and r.get("return_token_ids") for r in direct.requests)


def test_llama_cpp_streaming_with_token_ids_is_refused(tmp_path):
    """llama.cpp returns no ids, streamed or not: the refusal does not depend on `stream`."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pipeline.endpoints.localfleet", "--port", str(port),
                               "--slots", "1", "--ctx-per-slot", "1024", "--threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60, server)
        for stream in (False, True):
            [report] = probe(make_cfg([f"http://127.0.0.1:{port}"], stream=stream, return_token_ids=True))
            assert report.engine.engine == "llamacpp"
            # xllamacpp's llama.cpp reports build_info "b0-unknown": no version, said so
            assert report.engine.version is None
            assert any("names no build (/props build_info 'b0-unknown')" in w for w in report.warnings)
            assert any("returns no output token ids" in p for p in report.problems), (stream, report.problems)
    finally:
        server.terminate()
        server.wait(20)


def test_an_engine_behind_a_proxy_is_named_unknown(fake):
    [report] = probe(make_cfg([fake(owned_by="openai", version=None).url]))
    assert type(report.engine) is OpenAIAdapter and report.ok
    [warning] = [w for w in report.warnings if "inference engine is unknown" in w]
    assert "owned_by: openai" in warning and "cannot check that the fleet runs one engine" in warning
    [direct] = probe(make_cfg([fake().url]))
    assert not any("inference engine is unknown" in w for w in direct.warnings)


# --- 8. the context caps max_tokens ---------------------------------------------------------------------
def test_an_answer_the_context_capped_is_flagged_apart_from_max_tokens(fake, tmp_path, ray_cluster):
    """vLLM cuts max_tokens to what the context leaves, without an error: finish `length` with fewer tokens than
    max_tokens. Those records say `context_capped` (and `truncated`); one cut at max_tokens says `truncated`."""
    def tokens(body: dict) -> int:
        return 3 if "capped" in body["messages"][-1]["content"] else body["max_tokens"]

    server = fake(finish_reason="length", completion_tokens=tokens)
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a capped one"}\n{"prompt": "a full one"}\n')
    cfg = write_config(tmp_path, [{"url": server.url, "name": "v"}], [write_source(tmp_path, data)],
                       sampling={"temperature": 0.0, "max_tokens": 8}, thinking=False)
    done = run_regen("generate", "--config", str(cfg))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["messages"][-1]["content"]: r for p in data_parts(tmp_path / "out" / "t")
            for r in pq.read_table(p).to_pylist()}
    assert rows["a capped one"]["flags"] == ["truncated", "context_capped"]
    assert rows["a full one"]["flags"] == ["truncated"]


def test_new_run_on_another_engine_starts_a_successor(sglang, tmp_path, ray_cluster):
    """--new-run checks the engines before anything of the run changes: another engine makes `<run>-r2`."""
    write_prompts(tmp_path / "p.jsonl", 3)
    spec = write_source(tmp_path, tmp_path / "p.jsonl")
    first = write_config(tmp_path, [{"url": sglang.url, "name": "sgl"}], [spec], thinking=False,
                         return_token_ids=False)  # the same identity as the second: only the engine differs
    assert run_regen("generate", "--config", str(first)).returncode == 0
    before = (tmp_path / "out" / "t" / "run.json").read_text()
    port = free_port()
    llama = subprocess.Popen([sys.executable, "-m", "pipeline.endpoints.localfleet", "--port", str(port), "--slots",
                              "2", "--ctx-per-slot", "1024", "--threads", "1"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60, llama)
        second = write_config(tmp_path, [{"url": f"http://127.0.0.1:{port}", "name": "llama"}], [spec],
                              thinking=False, return_token_ids=False)
        done = run_regen("generate", "--config", str(second), "--new-run")
    finally:
        llama.terminate()
        llama.wait(20)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engines: ['sglang'] -> ['llamacpp']" in done.stderr
    assert (tmp_path / "out" / "t" / "run.json").read_text() == before
    rows = [r for p in data_parts(tmp_path / "out" / "t-r2") for r in pq.read_table(p).to_pylist()]
    assert len(rows) == 3 and {r["engine"] for r in rows} == {"llamacpp"}
