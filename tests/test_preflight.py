"""Fleet preflight against real emulator processes on 127.0.0.1: one test per refusal, each checking that the
message names the endpoint and the mismatch in words a user can act on; plus a healthy EAGLE-3 fleet, a fleet
with one endpoint down, a dead fleet, a hung endpoint, re-admission of a restarted endpoint, and the command."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import RunConfig
from pipeline.core.errors import PreflightError
from pipeline.emulator import start_emulator
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.preflight import (EndpointReport, check_endpoint, fleet_problems, pinned_weight_version, preflight,
                            run_preflight_command)
from pipeline.endpoints.engines import SGLangAdapter, VLLMAdapter
from pipeline.endpoints.preflight_table import render_table
from tests.helpers import free_port

MODEL = "moonshotai/Kimi-K2.5"
EAGLE3 = dict(preset="kimi-eagle3")  # kimi_k2 parser, an EAGLE3 draft

SERVERS = {
    "good1": EAGLE3,
    "good2": EAGLE3,
    "kimi": dict(preset="kimi"),
    "other_path": dict(EAGLE3, model_path="moonshotai/Kimi-K2-Instruct", served_model_name=MODEL),
    "v2": dict(EAGLE3, weight_version="v2"),
    "other_name": dict(preset="kimi", served_model_name="Qwen/Qwen3-8B"),
    "no_parser": dict(preset="kimi", reasoning_parser="none"),
    "short_ctx": dict(preset="kimi", context_length=1000),
    "hung": dict(EAGLE3, health_ok_while_hung=True),
}
SAMPLE_SPEC = Path(__file__).resolve().parent.parent / "prompts_sources" / "sample_prompts.yaml"


@pytest.fixture(scope="module")
def servers():
    started = {}
    try:
        for name, options in SERVERS.items():
            started[name] = start_emulator(**options)
        yield started
    finally:
        for server in started.values():
            server.stop()


def make_cfg(urls: list[str], **overrides) -> RunConfig:
    raw = {
        "run_name": "preflight-test",
        "model": MODEL,
        "sources": [{"spec": "prompts_sources/sample_prompts.yaml"}],
        "endpoints": [{"url": url} for url in urls],
        "sampling": {"max_tokens": 1024},
        "min_prompt_tokens": 256,
        "dead_fleet_deadline_s": 5,
    }
    raw.update(overrides)
    return RunConfig.model_validate(raw)


def label(server) -> str:
    return server.url.split("://", 1)[1]


def refusal(cfg: RunConfig) -> PreflightError:
    with pytest.raises(PreflightError) as info:
        preflight(cfg, {})
    return info.value


def lines_of(error: PreflightError, server) -> list[str]:
    """The refusal lines that name this endpoint."""
    return [line for line in str(error).splitlines() if label(server) in line]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# --- passing fleets -----------------------------------------------------------------------------------------
def test_healthy_eagle3_fleet_passes(servers):
    cfg = make_cfg([servers["good1"].url, servers["good2"].url], thinking=True)
    reports = preflight(cfg, {})
    assert [r.status for r in reports] == ["ok", "ok"]
    for r in reports:
        assert r.ok and r.reachable and not r.problems and not r.warnings
        assert r.models == [MODEL] and r.model_path == MODEL and r.weight_version == "default"
        assert r.reasoning_parser == "kimi_k2" and r.speculative_algorithm == "EAGLE3"
        assert r.context == 262144 and r.sglang and r.sglang_version == "0.5.23"
        assert r.engine.describe() == "sglang 0.5.23" and r.deterministic is False
    assert fleet_problems(reports, cfg) == [] and pinned_weight_version(reports) == "default"
    table = render_table(reports, cfg).splitlines()
    assert table[0].split()[:2] == ["endpoint", "status"]
    assert label(servers["good1"]) in table[1] and " ok " in table[1]
    assert "kimi_k2" in table[1] and "sglang 0.5.23" in table[1]


def test_one_endpoint_down_passes_with_a_warning(servers, caplog):
    down = dead_url()
    cfg = make_cfg([servers["good1"].url, down])
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="regen.fleet"):
        reports = preflight(cfg, {})
    assert time.monotonic() - started < 3  # no waiting: one endpoint is fine
    good, dead = reports
    assert good.ok and not dead.reachable and not dead.problems and dead.status == "unreachable"
    assert "no answer" in dead.down_reason
    assert any(down.split("://")[1] in rec.getMessage() and "unreachable" in rec.getMessage() for rec in caplog.records)
    table = render_table(reports, cfg)
    assert "unreachable" in table and "warning" in table


def test_all_endpoints_down_refuses_after_the_deadline():
    cfg = make_cfg([dead_url(), dead_url()], dead_fleet_deadline_s=2)
    started = time.monotonic()
    error = refusal(cfg)
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 6.0
    text = str(error)
    assert "no endpoint is reachable" in text and "dead_fleet_deadline_s" in text and "resume" in text
    for endpoint in cfg.endpoints:
        assert endpoint.label in text


def test_hung_generation_is_not_ready_although_health_is_200(servers):
    """/health 200 while generation hangs: the probe's timeout catches it; the endpoint is not given work."""
    cfg = make_cfg([servers["good1"].url, servers["hung"].url])
    reports = preflight(cfg, {}, probe_timeout_s=3.0)  # the good server's probes must fit too, on a loaded machine
    good, hung = reports
    assert good.ok
    assert not hung.ok and not hung.reachable and not hung.problems
    assert "hangs" in hung.down_reason and "3s" in hung.down_reason


# --- refusals -----------------------------------------------------------------------------------------------
def test_refuses_different_models(servers):
    """Same served name, different checkpoints (model_path)."""
    a, b = servers["good1"], servers["other_path"]
    error = refusal(make_cfg([a.url, b.url]))
    text = str(error)
    assert "different models" in text
    assert label(a) in text and label(b) in text
    assert "moonshotai/Kimi-K2-Instruct" in text and f"{label(a)}: {MODEL}" in text


def test_refuses_different_served_models(servers):
    a, b = servers["kimi"], servers["other_name"]
    error = refusal(make_cfg([a.url, b.url]))
    fleet_line = next(line for line in str(error).splitlines() if "different models" in line)
    assert f"{label(a)}: {MODEL}" in fleet_line and f"{label(b)}: Qwen/Qwen3-8B" in fleet_line
    assert not lines_of(error, a) or all("different models" in line for line in lines_of(error, a))


def test_refuses_different_weight_versions(servers):
    a, b = servers["good1"], servers["v2"]
    error = refusal(make_cfg([a.url, b.url]))
    line = next(line for line in str(error).splitlines() if "weight versions" in line)
    assert f"{label(a)}: default" in line and f"{label(b)}: v2" in line and "must not mix" in line


def test_refuses_when_the_configured_model_is_absent(servers):
    a, b = servers["kimi"], servers["other_name"]
    error = refusal(make_cfg([b.url], model="moonshotai/Kimi-K2.5-typo"))
    [line] = lines_of(error, b)
    assert "serves 'Qwen/Qwen3-8B', not the configured model 'moonshotai/Kimi-K2.5-typo'" in line
    assert "--served-model-name" in line
    # Several endpoints: each is listed with what it serves.
    error = refusal(make_cfg([a.url, b.url], model="moonshotai/Kimi-K2.5-typo"))
    assert f"serves '{MODEL}'" in "\n".join(lines_of(error, a))
    assert "serves 'Qwen/Qwen3-8B'" in "\n".join(lines_of(error, b))


def test_refuses_thinking_without_a_reasoning_parser(servers):
    a, bad = servers["kimi"], servers["no_parser"]
    error = refusal(make_cfg([a.url, bad.url], thinking=True))
    [line] = lines_of(error, bad)
    assert "thinking is requested" in line and "no reasoning_content" in line
    assert "--reasoning-parser kimi_k2" in line
    assert not lines_of(error, a)
    # Thinking off: no parser is needed.
    assert [r.status for r in preflight(make_cfg([bad.url], thinking=False), {})] == ["ok"]


def test_refuses_a_context_too_short(servers):
    bad = servers["short_ctx"]
    error = refusal(make_cfg([servers["kimi"].url, bad.url]))
    [line] = lines_of(error, bad)
    assert "context is 1000 tokens" in line and "max_tokens (1024) + min_prompt_tokens (256) = 1280" in line
    assert "--context-length 1280" in line
    assert [r.ok for r in preflight(make_cfg([bad.url], sampling={"max_tokens": 512}), {})] == [True]


# --- building blocks ----------------------------------------------------------------------------------------
def test_check_endpoint_readmits_a_restarted_endpoint_only_if_it_still_fits():
    """The circuit breaker's re-admission: a server restarted with other flags fails the full check."""
    cfg = make_cfg(["http://127.0.0.1:1"], thinking=True)
    server = start_emulator(**EAGLE3)
    settings = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=1024)

    async def check():
        client = EndpointClient(server.url, "e0", settings)
        try:
            return await check_endpoint(client, cfg)
        finally:
            await client.close()

    try:
        assert asyncio.run(check()).ok
        server.restart(reasoning_parser="none")
        report = asyncio.run(check())
        assert not report.ok and report.reachable
        assert "--reasoning-parser kimi_k2" in report.problems[0]
        server.stop(remove_log=False)
        report = asyncio.run(check())
        assert not report.ok and not report.reachable and report.status == "unreachable"
    finally:
        server.stop()


def test_fleet_problems_is_pure():
    cfg = make_cfg(["http://127.0.0.1:1"])
    a = EndpointReport("a", reachable=True, models=[MODEL], weight_version="w1")
    b = EndpointReport("b", reachable=True, models=[MODEL], weight_version="w2")
    down = EndpointReport("c", reachable=False, down_reason="no answer")
    assert fleet_problems([a, down], cfg) == []
    [problem] = fleet_problems([a, b, down], cfg)
    assert "different weight versions" in problem and "a: w1" in problem and "b: w2" in problem


def test_a_checkpoint_under_another_name_is_one_problem_not_a_second_under_the_configured_name():
    """Walk of issue 30: a server launched with another --model-path and no --served-model-name serves another
    name; the refusal said so, and then that the endpoints serve different models "under the name" configured,
    which that server does not serve. The model_path check compares the servers of the configured name."""
    cfg = make_cfg(["http://127.0.0.1:1"])
    a = EndpointReport("a", reachable=True, models=[MODEL], model_path=MODEL)
    other = EndpointReport("b", reachable=True, models=["moonshotai/Kimi-K2-Instruct"],
                           model_path="moonshotai/Kimi-K2-Instruct")
    [problem] = fleet_problems([a, other], cfg)
    assert problem.startswith("endpoints serve different models (a: ") and "under the name" not in problem
    same_name = EndpointReport("c", reachable=True, models=[MODEL], model_path="moonshotai/Kimi-K2-Instruct")
    [problem] = fleet_problems([a, same_name], cfg)
    assert f"different models under the name '{MODEL}'" in problem and "c: moonshotai/Kimi-K2-Instruct" in problem


def test_a_fleet_mixing_engines_is_refused():
    cfg = make_cfg(["http://127.0.0.1:1"])
    sglang = EndpointReport("s", reachable=True, models=[MODEL], engine=SGLangAdapter(version="0.5.23"))
    vllm = [EndpointReport(f"v{i}", reachable=True, models=[MODEL], engine=VLLMAdapter(version="0.32.0"))
            for i in range(2)]
    assert fleet_problems(vllm, cfg) == []
    [problem] = fleet_problems([sglang, *vllm], cfg)
    assert "different inference engines" in problem and "s: sglang" in problem and "v0, v1: vllm" in problem


# --- the command ----------------------------------------------------------------------------------------------
def write_config(tmp_path, urls: list[str], **overrides) -> str:
    raw = {"run_name": "pf", "model": MODEL, "sources": [{"spec": str(SAMPLE_SPEC)}],
           "endpoints": [{"url": u} for u in urls], "dead_fleet_deadline_s": 5, **overrides}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_run_preflight_command(servers, tmp_path, capsys, monkeypatch):
    good, bad = servers["good1"], servers["no_parser"]
    assert run_preflight_command(write_config(tmp_path, [good.url], thinking=True)) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:3] == ["endpoint", "status", "model"]
    assert label(good) in out and "preflight passed: 1 of 1" in out and err == ""

    assert run_preflight_command(write_config(tmp_path, [good.url, bad.url], thinking=True)) == 1
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "preflight refused" in err and label(bad) in err and "--reasoning-parser" in err

    # A concurrency far below the server's batch: the warning `regen generate` logs is printed under the table.
    assert run_preflight_command(write_config(tmp_path, [good.url],
                                              endpoints=[{"url": good.url, "concurrency": 1}])) == 0
    out, err = capsys.readouterr()
    warned = [line.strip() for line in out.splitlines() if "raise `concurrency`" in line]
    assert len(warned) == 1 and warned[0].startswith(f"endpoint {label(good)}: concurrency 1, the server batches "
                                                     "up to "), out

    # Secrets are checked before anything is contacted.
    monkeypatch.delenv("REGEN_TEST_MISSING_KEY", raising=False)
    path = write_config(tmp_path, [good.url], endpoints=[{"url": good.url, "api_key_env": "REGEN_TEST_MISSING_KEY"}])
    assert run_preflight_command(path) == 2
    assert "REGEN_TEST_MISSING_KEY" in capsys.readouterr().err
