"""`regen bench-endpoints` against emulated SGLang servers (with and without a speculative draft) and the
local llama.cpp endpoints."""
from __future__ import annotations

from pipeline.emulator import start_emulator
from tests.helpers import run_regen, write_config, write_prompts, write_source

MODEL = "moonshotai/Kimi-K2.5"


def test_bench_endpoints_reports_speed_and_accept_length(tmp_path):
    # 0.4 s and 0.8 s a request: the client's own time a request (more on a loaded machine) barely moves the ratio
    draft = start_emulator(preset="kimi", tok_per_s=100, speculative_algorithm="EAGLE3", accept_length=3.0,
                           enable_metrics=True)
    plain = start_emulator(preset="kimi", tok_per_s=50)
    try:
        write_prompts(tmp_path / "p.jsonl", 1)
        config = write_config(tmp_path, [{"url": draft.url, "name": "eagle3"}, {"url": plain.url, "name": "plain"}],
                              [write_source(tmp_path, tmp_path / "p.jsonl")], model=MODEL)
        result = run_regen("bench-endpoints", str(config), "--max-tokens", "40", "--concurrency", "4",
                           "--baseline", "plain")
        assert result.returncode == 0, result.stderr
        out = result.stdout
        eagle, rest = out.split("plain", 1)
        assert eagle.count("\n  0 ") == 1 and len([l for l in eagle.splitlines() if l[:3].strip().isdigit()]) >= 5
        accept = float(eagle.split("accept length ")[1].split()[0])
        assert 2.0 <= accept <= 3.0, "completion_tokens / spec_verify_ct per request, with a 3.0 accept length"
        assert "spec_accept_length" in eagle and "spec_accept_rate" in eagle, "the /metrics gauges were sampled"
        assert "speculative" not in rest.split("speed-up")[0], "no accept figures without a draft"
        ratio = float(out.split("eagle3")[-1].split("x one at a time")[0].split()[-1])
        assert 1.5 < ratio < 2.5, f"100 vs 50 tok/s a request should show about 2x, got {ratio}"
    finally:
        draft.stop()
        plain.stop()


def test_bench_endpoints_on_the_local_llama_endpoints(tmp_path, llama_fleet):
    endpoints = [{"url": e.url, "concurrency": e.concurrency, "name": e.name} for e in llama_fleet.endpoints()]
    write_prompts(tmp_path / "p.jsonl", 1)
    config = write_config(tmp_path, endpoints, [write_source(tmp_path, tmp_path / "p.jsonl")])
    result = run_regen("bench-endpoints", str(config), "--max-tokens", "16", "--prompts", "5", "--concurrency", "2")
    assert result.returncode == 0, result.stderr
    for label in ("local-0", "local-1"):
        section = result.stdout.split(label, 1)[1]
        rate = float(section.split("one at a time: ")[1].split(" tok/s")[0])
        assert rate > 0
    assert "speculative" not in result.stdout


def test_bench_endpoints_identifies_the_engine_first(tmp_path):
    """A vLLM server gets vLLM's request fields (request_id, return_token_ids), not SGLang's rid and
    return_prompt_token_ids, which it would ignore."""
    from tests.fake_engines import FakeVLLM

    server = FakeVLLM().start()
    try:
        write_prompts(tmp_path / "p.jsonl", 1)
        config = write_config(tmp_path, [{"url": server.url, "name": "v"}],
                              [write_source(tmp_path, tmp_path / "p.jsonl")])
        result = run_regen("bench-endpoints", str(config), "--max-tokens", "8", "--prompts", "5", "--concurrency", "2")
        assert result.returncode == 0, result.stderr
        chats = [r for r in server.requests if "messages" in r]
        assert len(chats) == 7 and all("request_id" in r and "rid" not in r for r in chats)
        assert not any("return_prompt_token_ids" in r for r in chats)
    finally:
        server.stop()
