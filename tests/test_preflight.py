"""Fleet preflight against real emulator processes on 127.0.0.1: one test per refusal, each checking that the
message names the endpoint and the mismatch in words a user can act on; plus a healthy EAGLE-3 fleet, a fleet
with one endpoint down, a dead fleet, a hung endpoint, re-admission of a restarted endpoint, and the command."""
from __future__ import annotations

import asyncio
import logging
import time

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
EAGLE3 = dict(preset="kimi-eagle3")  # kimi_k2 parser, EAGLE3 aux hidden states (21504), radix cache off

SERVERS = {
    "good1": EAGLE3,
    "good2": EAGLE3,
    "kimi": dict(preset="kimi"),
    "other_path": dict(EAGLE3, model_path="moonshotai/Kimi-K2-Instruct", served_model_name=MODEL),
    "v2": dict(EAGLE3, weight_version="v2"),
    "other_name": dict(preset="kimi", served_model_name="Qwen/Qwen3-8B"),
    "no_parser": dict(preset="kimi", reasoning_parser="none"),
    "short_ctx": dict(preset="kimi", context_length=1000),
    "eagle": dict(EAGLE3, speculative_algorithm="EAGLE"),  # the failure that cost days: 7168 wide
    "radix_on": dict(EAGLE3, disable_radix_cache=False),
    # 0.5.18: aux layers come from the EAGLE3 draft, and hidden states are off (0.5.23's aux capture would turn
    # them on by itself)
    "no_hidden": dict(EAGLE3, enable_return_hidden_states=False, sglang_version="0.5.18"),
    "hung": dict(EAGLE3, health_ok_while_hung=True),
}


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


HIDDEN = {"hidden_states": {"enabled": True, "expected_width": 21504}}


# --- passing fleets -----------------------------------------------------------------------------------------
def test_healthy_eagle3_fleet_passes_with_hidden_states(servers):
    cfg = make_cfg([servers["good1"].url, servers["good2"].url], thinking=True, **HIDDEN)
    reports = preflight(cfg, {})
    assert [r.status for r in reports] == ["ok", "ok"]
    for r in reports:
        assert r.ok and r.reachable and not r.problems and not r.warnings
        assert r.models == [MODEL] and r.model_path == MODEL and r.weight_version == "default"
        assert r.hidden_width == 21504 and r.radix_cache is False and r.reasoning_parser == "kimi_k2"
        assert r.context == 262144 and r.sglang and r.sglang_version == "0.5.23"
        assert r.speculative_algorithm is None  # 0.5.23: aux capture without a draft resets it
        assert r.engine.describe() == "sglang 0.5.23" and r.deterministic is False
    assert fleet_problems(reports, cfg) == [] and pinned_weight_version(reports) == "default"
    table = render_table(reports, cfg).splitlines()
    assert table[0].split()[:2] == ["endpoint", "status"]
    assert label(servers["good1"]) in table[1] and " ok " in table[1] and "21504" in table[1]
    assert "kimi_k2" in table[1] and "off" in table[1] and "sglang 0.5.23" in table[1]


def test_one_endpoint_down_passes_with_a_warning(servers, caplog):
    down = dead_url()
    cfg = make_cfg([servers["good1"].url, down], **HIDDEN)
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
    cfg = make_cfg([servers["good1"].url, servers["hung"].url], **HIDDEN)
    reports = preflight(cfg, {}, probe_timeout_s=1.0)
    good, hung = reports
    assert good.ok
    assert not hung.ok and not hung.reachable and not hung.problems
    assert "hangs" in hung.down_reason and "1s" in hung.down_reason


# --- refusals -----------------------------------------------------------------------------------------------
def test_refuses_different_models(servers):
    """Same served name, different checkpoints (model_path)."""
    a, b = servers["good1"], servers["other_path"]
    error = refusal(make_cfg([a.url, b.url], **HIDDEN))
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
    error = refusal(make_cfg([a.url, b.url], **HIDDEN))
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


def test_refuses_eagle_instead_of_eagle3_hidden_width(servers):
    """The motivating failure: --speculative-algorithm EAGLE gives 7168-wide states instead of 21504."""
    bad = servers["eagle"]
    error = refusal(make_cfg([servers["good1"].url, bad.url], **HIDDEN))
    [line] = lines_of(error, bad)
    assert "7168-wide" in line and "expected 21504" in line
    assert "--speculative-algorithm EAGLE instead of EAGLE3" in line
    assert "--enable-return-aux-hidden-states" in line and "speculative_algorithm: EAGLE," in line
    report = next(r for r in error.reports if r.label == label(bad))
    assert report.hidden_width == 7168 and report.status == "REFUSED"
    assert "REFUSED" in render_table(error.reports, make_cfg([bad.url], **HIDDEN))


def test_refuses_radix_cache_on(servers):
    bad = servers["radix_on"]
    error = refusal(make_cfg([servers["good1"].url, bad.url], **HIDDEN))
    [line] = lines_of(error, bad)
    assert "radix (prefix) cache is on" in line and "--disable-radix-cache" in line
    assert "the second time" in line  # the probe's prefill shortfall, not only the server's flag
    assert "disable_radix_cache: false" in line
    report = next(r for r in error.reports if r.label == label(bad))
    assert report.radix_cache is True


def test_refuses_hidden_states_not_enabled(servers):
    bad = servers["no_hidden"]
    error = refusal(make_cfg([servers["good1"].url, bad.url], **HIDDEN))
    [line] = lines_of(error, bad)
    assert "not configured to return them" in line and "--enable-return-hidden-states" in line
    assert "answered 400" in line


# --- building blocks ----------------------------------------------------------------------------------------
def test_check_endpoint_readmits_a_restarted_endpoint_only_if_it_still_fits():
    """The circuit breaker's re-admission: a server restarted with other flags fails the full check."""
    cfg = make_cfg(["http://127.0.0.1:1"], **HIDDEN)
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
        server.restart(speculative_algorithm="EAGLE")
        report = asyncio.run(check())
        assert not report.ok and report.reachable and report.hidden_width == 7168
        assert "EAGLE instead of EAGLE3" in report.problems[0]
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
    raw = {"run_name": "pf", "model": MODEL, "sources": [{"spec": "prompts_sources/sample_prompts.yaml"}],
           "endpoints": [{"url": u} for u in urls], "dead_fleet_deadline_s": 5, **overrides}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_run_preflight_command(servers, tmp_path, capsys, monkeypatch):
    good, bad = servers["good1"], servers["eagle"]
    assert run_preflight_command(write_config(tmp_path, [good.url], thinking=True, **HIDDEN)) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:3] == ["endpoint", "status", "model"]
    assert label(good) in out and "21504" in out and "preflight passed: 1 of 1" in out and err == ""

    assert run_preflight_command(write_config(tmp_path, [good.url, bad.url], **HIDDEN)) == 1
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "preflight refused" in err and label(bad) in err and "EAGLE3" in err

    # Secrets are checked before anything is contacted.
    monkeypatch.delenv("REGEN_TEST_MISSING_KEY", raising=False)
    path = write_config(tmp_path, [good.url], endpoints=[{"url": good.url, "api_key_env": "REGEN_TEST_MISSING_KEY"}])
    assert run_preflight_command(path) == 2
    assert "REGEN_TEST_MISSING_KEY" in capsys.readouterr().err


# --- chunked prefill: the run's longest prompt must fit in one chunk ------------------------------------------
LONG_PROMPT = " ".join(f"word{i}" for i in range(300))


def test_generate_refuses_a_longest_prompt_over_one_prefill_chunk(tmp_path):
    """regen generate's own preflight counts the prompt set's longest prompt against chunked_prefill_size."""
    import orjson

    from tests.helpers import run_regen, write_config, write_source

    data = tmp_path / "p.jsonl"
    data.write_bytes(orjson.dumps({"prompt": "Why is the sky blue?"}) + b"\n" + orjson.dumps({"prompt": LONG_PROMPT})
                     + b"\n")
    server = start_emulator(**EAGLE3, chunked_prefill_size=64)
    try:
        cfg = write_config(tmp_path, [{"url": server.url}], [write_source(tmp_path, data)], model=MODEL,
                           thinking=True, **HIDDEN)
        done = run_regen("generate", "--config", str(cfg), timeout=180)
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr[-2000:]
    assert "chunked_prefill_size is 64 tokens, shorter than the run's longest prompt" in done.stderr
    assert "--chunked-prefill-size" in done.stderr
    assert not list((tmp_path / "out" / "t" / "data").glob("*.parquet"))


def test_readmission_refuses_a_server_restarted_with_a_short_prefill_chunk():
    """The circuit breaker's readmission (built like the run's actors) runs the same chunked-prefill check."""
    from pipeline.dispatch.actors import client_settings, local_worker_factory

    server = start_emulator(**EAGLE3, chunked_prefill_size=8192)
    cfg = make_cfg([server.url], thinking=True, **HIDDEN)
    longest = [{"role": "user", "content": LONG_PROMPT}]
    factory = local_worker_factory(cfg, client_settings(cfg), lambda e: None, "unused", longest_prompt=longest)
    try:
        assert asyncio.run(_readmit(factory(cfg.all_endpoints()[0], True)))[0]
        server.restart(chunked_prefill_size=64)
        admitted, why = asyncio.run(_readmit(factory(cfg.all_endpoints()[0], True)))
        assert not admitted
        assert "chunked_prefill_size is 64 tokens, shorter than the run's longest prompt" in why
    finally:
        server.stop()


async def _readmit(worker) -> tuple[bool, str]:
    try:
        return await worker._passes_preflight(), worker.last_error
    finally:
        await worker.close()


def test_preflight_counts_a_short_longest_prompt_as_fitting():
    """Not every chunked server is refused: a prompt the server counts under the chunk passes."""
    server = start_emulator(**EAGLE3, chunked_prefill_size=64)
    try:
        cfg = make_cfg([server.url], thinking=True, **HIDDEN)
        [report] = preflight(cfg, {}, longest_prompt=[{"role": "user", "content": "Why is the sky blue?"}])
        assert report.ok, report.problems
        long_cfg = make_cfg([server.url], thinking=True, **HIDDEN)
        error = refusal_with(long_cfg, [{"role": "user", "content": LONG_PROMPT}])
        assert "chunked_prefill_size is 64 tokens" in str(error)
    finally:
        server.stop()


def refusal_with(cfg: RunConfig, longest: list[dict]) -> PreflightError:
    with pytest.raises(PreflightError) as info:
        preflight(cfg, {}, longest_prompt=longest)
    return info.value


# --- 0.5.23 aux capture: EAGLE3's layers, not DFLASH's, DSPARK's or other ids at the same width ---------------
def test_refuses_an_aux_capture_that_is_not_eagle3s_layers():
    captures = {"dspark": dict(speculative_algorithm="DSPARK", return_aux_hidden_state_layer_ids="10,20,30"),
                "dflash": dict(speculative_algorithm="DFLASH", return_aux_hidden_state_layer_ids="5"),
                "custom": dict(return_aux_hidden_state_layer_ids="0,1,2")}
    started = {name: start_emulator(**EAGLE3, sglang_version="0.5.23", **options) for name, options in captures.items()}
    try:
        for name, server in started.items():
            error = refusal(make_cfg([server.url], thinking=True, **HIDDEN))
            [line] = [line for line in lines_of(error, server) if "the server captures" in line]
            if name == "custom":  # same width, same convention, other layers
                assert "EAGLE3 auxiliary layers [0, 1, 2]" in line and "hidden_states.aux_layer_ids" in line
                assert "without --return-aux-hidden-state-layer-ids" in line
            else:
                assert f"captures {name.upper()}'s auxiliary hidden states" in line
                assert f"aux_hidden_state_capture: {name}" in line and "--speculative-algorithm EAGLE3" in line
        # the layers the run asks for pass
        asked = make_cfg([started["custom"].url], thinking=True,
                         hidden_states={"enabled": True, "expected_width": 21504, "aux_layer_ids": [0, 1, 2]})
        [report] = preflight(asked, {})
        assert report.ok, report.problems
        other = make_cfg([started["custom"].url], thinking=True,
                         hidden_states={"enabled": True, "expected_width": 21504, "aux_layer_ids": [2, 30, 58]})
        [line] = [line for line in lines_of(refusal(other), started["custom"]) if "the server captures" in line]
        assert "the run asks for layers [2, 30, 58]" in line and "--return-aux-hidden-state-layer-ids 2 30 58" in line
    finally:
        for server in started.values():
            server.stop()


def test_the_longest_prompt_is_counted_in_bytes_without_a_tokenizer(caplog):
    """Chunks are tokens. Before the fix the prompt with the most characters was checked: an English one, while a
    CJK prompt with fewer characters has several times its tokens. UTF-8 bytes bound tokens from above."""
    import pyarrow as pa

    from pipeline.store.promptset import longest_prompt

    english, cjk = "The quick brown fox jumps over the lazy dog. " * 60, "敏捷的棕色狐狸跳过了懒狗。" * 150
    assert len(english) > len(cjk)
    table = pa.table({"messages": [[{"role": "user", "content": english}], [{"role": "user", "content": cjk}]]})
    with caplog.at_level(logging.INFO, logger="regen"):
        assert longest_prompt(table) == [{"role": "user", "content": cjk}]
    assert any("the prompt with the most UTF-8 bytes (5850) is counted" in r.getMessage() for r in caplog.records)


def test_the_longest_prompt_is_counted_in_tokens_with_the_max_prompt_tokens_tokenizer(tmp_path, caplog):
    """With a tokenizer (max_prompt_tokens) the prompt with the most tokens is checked, not the most bytes."""
    import pyarrow as pa

    from pipeline.prompts.tokens import load_length_check
    from pipeline.store.promptset import longest_prompt
    from tests.test_sharegpt_wild import tiny_tokenizer

    pytest.importorskip("transformers")
    words, one_word = "a " * 1000, "abcdefghij" * 300  # 1000 tokens in 2000 bytes; 1 token in 3000
    table = pa.table({"messages": [[{"role": "user", "content": one_word}], [{"role": "user", "content": words}]]})
    length = load_length_check(10, str(tiny_tokenizer(tmp_path / "tok")))
    with caplog.at_level(logging.INFO, logger="regen"):
        assert longest_prompt(table, length) == [{"role": "user", "content": words}]
    assert any("the longest prompt is 1000 tokens" in r.getMessage() for r in caplog.records)
