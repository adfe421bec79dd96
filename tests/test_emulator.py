"""The SGLang emulator, tested as real processes on 127.0.0.1 (pipeline/emulator)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import math
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from pipeline.emulator import (EOS_ID, encode, expected_chat, expected_generate, make_config, render_chat,
                               start_emulator)
from tests.helpers import wait_for

MODEL = "moonshotai/Kimi-K2.5"
MAIN_OPTS = dict(preset="kimi", enable_metrics=True, enable_cache_report=True, context_length=4096, fault_seed=7)
# queue_timeout: long enough for a third request to arrive while a second waits, on a loaded machine
SMALL_OPTS = dict(capacity=1, max_queue=1, tok_per_s=50.0, queue_timeout=3.0)
# an EAGLE3 draft: speculative meta in meta_info and /metrics
EAGLE_OPTS = dict(preset="kimi-eagle3", enable_metrics=True, sglang_version="0.5.18")


# --- helpers --------------------------------------------------------------------------------------
def call(url: str, path: str, body=None, timeout: float = 30.0, raw: bytes | None = None):
    """(status, headers, body bytes) of one request; POST when a body is given."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def jcall(url, path, body=None, **kw):
    status, _, data = call(url, path, body, **kw)
    return status, (json.loads(data) if data else None)


def admission(server) -> tuple[int, int]:
    """(running, waiting) requests of an emulator now."""
    stats = jcall(server.url, "/admin/stats")[1]
    return stats["running"], stats["waiting"]


def chat(content: str, max_tokens: int = 24, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def sse_events(data: bytes) -> list:
    out = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def parse_prometheus(text: str) -> tuple[dict, dict]:
    """(types {family: type}, samples {name{labels}: value}); raises on a malformed line."""
    types, samples = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP "):
            continue
        else:
            name_labels, value = line.rsplit(" ", 1)
            assert "{" in name_labels and name_labels.endswith("}"), line
            samples[name_labels] = float(value)
    return types, samples


def sample(samples: dict, name: str) -> float:
    [v] = [v for k, v in samples.items() if k.split("{")[0] == name]
    return v


# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("emu") / "requests.jsonl"


@pytest.fixture(scope="module")
def main(log_path):
    p = start_emulator(request_log=str(log_path), **MAIN_OPTS)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def small():
    p = start_emulator(**SMALL_OPTS)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def eagle():
    p = start_emulator(**EAGLE_OPTS)
    yield p
    p.stop()


@pytest.fixture
def fresh(main):
    """The main emulator with counters, cache and faults back to their start values."""
    assert call(main.url, "/admin/reset", {})[0] == 200
    yield main
    call(main.url, "/admin/reset", {})


MAIN_CFG = make_config(**MAIN_OPTS)


# --- response shapes ------------------------------------------------------------------------------
def test_chat_response_shape(fresh):
    status, body = jcall(fresh.url, "/v1/chat/completions", chat("What is 2+2?"))
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert len(body["id"]) == 32 and int(body["id"], 16) >= 0
    # 0.5.23 (the default version) adds the finished request's weight-version spans (utils/weight_versions.py)
    assert body["metadata"] == {"weight_version": "default", "weight_versions": [
        {"version": "default", "start": 0, "end": body["usage"]["completion_tokens"]}]}
    [c] = body["choices"]
    assert c["index"] == 0 and c["message"]["role"] == "assistant" and c["logprobs"] is None
    assert c["finish_reason"] in ("stop", "length")
    assert c["matched_stop"] == (EOS_ID if c["finish_reason"] == "stop" else None)
    assert isinstance(c["message"]["content"], str)
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "reasoning_tokens" in u
    status, body = jcall(fresh.url, "/v1/chat/completions", chat("What is 2+2?", rid="my-rid-1"))
    assert body["id"] == "my-rid-1"


def test_determinism_and_expected_chat(fresh):
    req = chat("Name three prime numbers.", max_tokens=60)
    a = jcall(fresh.url, "/v1/chat/completions", req)[1]
    b = jcall(fresh.url, "/v1/chat/completions", {**req, "seed": 99})[1]   # seed ignored at temperature 0
    exp = expected_chat(req, MAIN_CFG)
    for r in (a, b):
        m = r["choices"][0]["message"]
        assert m["content"] == exp["content"] and m["reasoning_content"] == exp["reasoning_content"]
        assert r["choices"][0]["finish_reason"] == exp["finish_reason"]
        assert r["usage"]["prompt_tokens"] == exp["prompt_tokens"]
        assert r["usage"]["completion_tokens"] == exp["completion_tokens"]
        assert r["usage"]["reasoning_tokens"] == exp["reasoning_tokens"]
    hot = {**req, "temperature": 0.8}
    s1 = jcall(fresh.url, "/v1/chat/completions", {**hot, "seed": 1})[1]["choices"][0]["message"]
    s1b = jcall(fresh.url, "/v1/chat/completions", {**hot, "seed": 1})[1]["choices"][0]["message"]
    s2 = jcall(fresh.url, "/v1/chat/completions", {**hot, "seed": 2})[1]["choices"][0]["message"]
    assert s1 == s1b and s1 != s2
    assert s1["reasoning_content"] == expected_chat({**hot, "seed": 1}, MAIN_CFG)["reasoning_content"]


def test_both_finish_reasons_occur():
    finishes = {expected_chat(chat(f"prompt number {i}", max_tokens=32), MAIN_CFG)["finish_reason"]
                for i in range(40)}
    assert finishes == {"stop", "length"}


def test_thinking_on_off_truncated(fresh):
    on = chat("Explain gravity briefly.", max_tokens=200)
    r = jcall(fresh.url, "/v1/chat/completions", on)[1]
    m, u = r["choices"][0]["message"], r["usage"]
    assert m["reasoning_content"] and u["reasoning_tokens"] > 0 and "</think>" not in m["content"]
    # enable_thinking is not read by the kimi parser; thinking=false turns it off
    r2 = jcall(fresh.url, "/v1/chat/completions", {**on, "chat_template_kwargs": {"enable_thinking": False}})[1]
    assert r2["choices"][0]["message"]["reasoning_content"] == m["reasoning_content"]
    off = jcall(fresh.url, "/v1/chat/completions", {**on, "chat_template_kwargs": {"thinking": False}})[1]
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["usage"]["reasoning_tokens"] == 0 and off["choices"][0]["message"]["content"]
    # cut before </think>: everything is reasoning, content "", finish length
    for i in range(200):
        cut = chat(f"Think long about {i}.", max_tokens=50)
        if 163607 not in expected_chat(cut, MAIN_CFG)["output_ids"]:
            break
    t = jcall(fresh.url, "/v1/chat/completions", cut)[1]
    tm = t["choices"][0]
    assert tm["finish_reason"] == "length" and tm["message"]["content"] == ""
    assert tm["message"]["reasoning_content"] and t["usage"]["reasoning_tokens"] == t["usage"]["completion_tokens"]


def test_no_reasoning_parser_keeps_raw_text(small):
    cfg = make_config(**SMALL_OPTS)
    for i in range(30):
        req = chat(f"Tell me fact {i}.", max_tokens=12)
        exp = expected_chat(req, cfg)
        if 163607 in exp["output_ids"]:
            break
    m = jcall(small.url, "/v1/chat/completions", req)[1]["choices"][0]["message"]
    assert m["reasoning_content"] is None and m["content"] == exp["content"] and "</think>" in m["content"]


def test_stream_matches_non_stream(fresh):
    req = chat("Stream me an answer.", max_tokens=80)
    plain = jcall(fresh.url, "/v1/chat/completions", req)[1]
    status, headers, data = call(fresh.url, "/v1/chat/completions",
                                 {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    ev = sse_events(data)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"]["reasoning_content"] or "" for c in chunks if c["choices"])
    pm = plain["choices"][0]
    assert content == pm["message"]["content"] and reasoning == pm["message"]["reasoning_content"]
    fin = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(fin) == 1 and fin[0]["choices"][0]["finish_reason"] == pm["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        plain["usage"]["completion_tokens"]


def test_generate_shape_and_token_ids(fresh):
    status, r = jcall(fresh.url, "/generate", {"text": "The capital of France is",
                                               "sampling_params": {"max_new_tokens": 20}, "rid": "g1"})
    assert status == 200
    mi = r["meta_info"]
    assert mi["id"] == "g1" and mi["weight_version"] == "default"
    assert mi["completion_tokens"] == len(r["output_ids"]) and mi["prompt_tokens"] == len(encode(
        "The capital of France is"))
    assert mi["finish_reason"]["type"] in ("stop", "length") and "e2e_latency" in mi
    exp = expected_generate({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 20}})
    assert r["text"] == exp["text"] and r["output_ids"] == exp["output_ids"]
    # chat token ids: prompt ids are the rendered template's, output ids end with EOS on a stop
    req = chat("ids please", max_tokens=40, return_token_ids=True, return_prompt_token_ids=True)
    c = jcall(fresh.url, "/v1/chat/completions", req)[1]["choices"][0]
    assert c["prompt_token_ids"] == encode(render_chat(req["messages"]))
    # SGLang 0.5.18+ (the emulator's default, 0.5.23) answers in response_token_ids, as its protocol model has it
    assert "token_ids" not in c
    assert c["response_token_ids"] == expected_chat(req, MAIN_CFG)["output_ids"]
    assert (c["response_token_ids"][-1] == EOS_ID) == (c["finish_reason"] == "stop")
    # /generate on the rendered template answers what the chat endpoint answers
    g = jcall(fresh.url, "/generate", {"text": render_chat(req["messages"]),
                                       "sampling_params": {"max_new_tokens": 40}})[1]
    assert g["output_ids"] == c["response_token_ids"]
    s = call(fresh.url, "/generate", {"text": "count", "stream": True, "sampling_params": {"max_new_tokens": 5}})
    ev = sse_events(s[2])
    assert ev[-1] == "[DONE]" and ev[-2]["meta_info"]["finish_reason"] is not None


def test_openai_client_compat(fresh):
    client = openai.OpenAI(base_url=fresh.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    assert r.choices[0].message.content == expected_chat(chat("hello", 30), MAIN_CFG)["content"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    # SGLang's chat route checks no model name (only /v1/models/{m} answers 404): it echoes the request's
    echoed = client.chat.completions.create(model="other/model", messages=[{"role": "user", "content": "x"}])
    assert echoed.model == "other/model"
    with pytest.raises(openai.BadRequestError, match="longer than the model's context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w " * 5000}])

    async def stream():
        ac = openai.AsyncOpenAI(base_url=fresh.url + "/v1", api_key="none", max_retries=0)
        out, usage = [], None
        s = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=30, stream=True, stream_options={"include_usage": True})
        async for ch in s:
            if ch.choices and ch.choices[0].delta.content:
                out.append(ch.choices[0].delta.content)
            usage = ch.usage or usage
        await ac.close()
        return "".join(out), usage

    text, usage = asyncio.run(stream())
    assert text == r.choices[0].message.content and usage.completion_tokens == r.usage.completion_tokens


# --- errors ---------------------------------------------------------------------------------------
def test_every_400_message(fresh, small):
    u = fresh.url
    long_req = chat("word " * 5000)
    n = expected_chat(long_req, MAIN_CFG)["prompt_tokens"]
    st, b = jcall(u, "/v1/chat/completions", long_req)
    assert st == 400 and b == {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                               "message": f"The input ({n} tokens) is longer than the model's context length "
                                          f"(4096 tokens)."}
    req = chat("short prompt", max_tokens=4090)
    n = expected_chat(req, MAIN_CFG)["prompt_tokens"]
    st, b = jcall(u, "/v1/chat/completions", req)
    assert st == 400 and b["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total "
        f"of {4090 + n} tokens: {n} tokens from the input messages and 4090 tokens for the completion.")
    st, b = jcall(u, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 5000}})
    assert st == 400 and set(b) == {"error"} and "maximum context length" in b["error"]["message"]
    for bad in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                chat("x", max_tokens=0), chat("x", temperature=-1), chat("x", stream="yes")):
        st, b = jcall(u, "/v1/chat/completions", bad)
        assert st == 400 and b["object"] == "error" and b["code"] == 400, bad
    st, _, b = call(u, "/v1/chat/completions", raw=b"{not json")
    assert st == 400 and json.loads(b)["code"] == 400
    st, b = jcall(u, "/v1/chat/completions", chat("x", stream=True, return_prompt_token_ids=True))
    assert st == 400 and "Please set stream=false" in b["message"]
    st, b = jcall(u, "/generate", {"sampling_params": {}})
    assert st == 400 and b == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    st, b = jcall(u, "/v1/chat/completions", {**chat("x"), "model": "someone/else"})
    assert st == 200 and b["model"] == "someone/else"  # SGLang's chat checks no model name: it echoes it
    # a rid that is still running
    with cf.ThreadPoolExecutor(2) as ex:  # the first runs for 6 s: the second is sent once it runs
        first = ex.submit(jcall, small.url, "/v1/chat/completions",
                          chat("slow", max_tokens=300, rid="dup", ignore_eos=True))
        wait_for(lambda: admission(small) == (1, 0), 30, what="the first request running")
        st, b = jcall(small.url, "/v1/chat/completions", chat("again", max_tokens=2, rid="dup"))
        assert first.result()[0] == 200
    assert st == 400 and b["message"] == "Duplicate request ID detected: dup"


def test_queue_full_and_queue_timeout(small):
    # each request is sent once the one before it holds its place: the first runs 6 s; the second waits 3 s
    # (queue_timeout: the window in which the third finds the queue full), timing out 3 s before the first ends
    with cf.ThreadPoolExecutor(3) as ex:
        running = ex.submit(jcall, small.url, "/v1/chat/completions",
                            chat("long one", max_tokens=300, ignore_eos=True))
        wait_for(lambda: admission(small) == (1, 0), 30, what="the first request running")
        waiting = ex.submit(jcall, small.url, "/v1/chat/completions", chat("second", max_tokens=2))
        wait_for(lambda: admission(small) == (1, 1), 30, 0.01, what="the second request waiting")
        st, b = jcall(small.url, "/v1/chat/completions", chat("third", max_tokens=2))
        assert (st, b["message"], b["code"]) == (503, "The request queue is full.", 503)
        st2, b2 = waiting.result()
        assert (st2, b2["message"]) == (503, "Request waiting timeout reached.")
        assert running.result()[0] == 200
    st, b = jcall(small.url, "/generate", {"text": "after", "sampling_params": {"max_new_tokens": 2}})
    assert st == 200


# --- prefix cache ---------------------------------------------------------------------------------
def test_prefix_cache(fresh):
    body = {"text": "Cached prefixes for this prompt, please.", "sampling_params": {"max_new_tokens": 6}}
    st, r = jcall(fresh.url, "/generate", body)
    mi = r["meta_info"]
    pt = mi["prompt_tokens"]
    assert st == 200 and mi["cached_tokens"] == 0 and pt == len(encode(body["text"]))
    # same prompt again: all but its last token come from the cache
    assert jcall(fresh.url, "/generate", body)[1]["meta_info"]["cached_tokens"] == pt - 1
    st, stats = jcall(fresh.url, "/admin/stats")
    assert stats["cache_hits"] >= 1 and 0 < stats["cache_hit_rate"] < 1


def test_eagle3_spec_meta(eagle):
    body = {"text": "eagle three prompt", "sampling_params": {"max_new_tokens": 4}}
    mi = jcall(eagle.url, "/generate", body)[1]["meta_info"]
    assert mi["spec_accept_length"] == 3.2 and mi["spec_verify_ct"] == math.ceil(mi["completion_tokens"] / 3.2)
    assert 0 < mi["spec_accept_rate"] <= 1
    info = jcall(eagle.url, "/get_server_info")[1]
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["internal_states"][0]["avg_spec_accept_length"] == 3.2
    _, samples = parse_prometheus(call(eagle.url, "/metrics")[2].decode())
    assert sample(samples, "sglang:spec_accept_length") == 3.2


# --- info, metrics --------------------------------------------------------------------------------
def test_info_endpoints(main, small):
    st, h, b = call(main.url, "/health")
    assert st == 200 and b == b""
    assert call(main.url, "/health_generate")[0] == 200
    mi = jcall(main.url, "/get_model_info")[1]
    assert mi["model_type"] == "kimi_k25" and mi["weight_version"] == "default"
    assert mi["reasoning_parser"] == "kimi_k2" and mi["model_path"] == MODEL and mi["is_generation"] is True
    si = jcall(main.url, "/get_server_info")[1]
    for k in ("speculative_algorithm", "tp_size", "context_length", "disable_radix_cache", "reasoning_parser",
              "max_total_num_tokens", "internal_states", "version"):
        assert k in si, k
    assert si["context_length"] == 4096
    assert set(si["internal_states"][0]) == {"last_gen_throughput", "avg_spec_accept_length",
                                             "effective_max_running_requests_per_dp"}
    models = jcall(main.url, "/v1/models")[1]
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 4096
    assert call(small.url, "/metrics")[0] == 404
    assert jcall(small.url, "/get_model_info")[1]["reasoning_parser"] is None


def test_metrics_parse(fresh):
    for i in range(3):
        jcall(fresh.url, "/v1/chat/completions", chat("metrics", max_tokens=8))
    st, h, b = call(fresh.url, "/metrics")
    assert st == 200 and h["Content-Type"].startswith("text/plain")
    types, samples = parse_prometheus(b.decode())
    for g in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "cache_hit_rate", "token_usage",
              "spec_accept_length", "spec_accept_rate"):
        assert types[f"sglang:{g}"] == "gauge"
    for c in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total"):
        assert types[f"sglang:{c}"] == "counter"
    for hname in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert types[f"sglang:{hname}"] == "histogram"
        count = sample(samples, f"sglang:{hname}_count")
        inf = [v for k, v in samples.items() if k.startswith(f"sglang:{hname}_bucket") and 'le="+Inf"' in k]
        assert inf == [count] == [3.0]
    assert sample(samples, "sglang:num_requests_total") == 3
    assert 0 < sample(samples, "sglang:cache_hit_rate") < 1          # the same prompt three times
    assert 'model_name="moonshotai/Kimi-K2.5"' in b.decode()


# --- faults ---------------------------------------------------------------------------------------
def test_admin_faults_take_effect(fresh):
    u = fresh.url
    assert jcall(u, "/admin/faults", {"fault_500": 1.0})[1]["fault_500"] == 1.0
    st, b = jcall(u, "/v1/chat/completions", chat("x"))
    assert st == 500 and b["code"] == 500 and b["object"] == "error"
    st, _, data = call(u, "/v1/chat/completions", chat("mid stream", max_tokens=40, stream=True))
    ev = sse_events(data)
    assert st == 200 and ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 500
    jcall(u, "/admin/faults", {"fault_500": 0.0, "fault_429": 1.0})
    assert call(u, "/generate", {"text": "x"})[0] == 429
    jcall(u, "/admin/faults", {"fault_429": 0.0, "fault_abort": 1.0})
    r = jcall(u, "/v1/chat/completions", chat("abort me", max_tokens=30))[1]
    assert r["choices"][0]["finish_reason"] == "abort"
    g = jcall(u, "/generate", {"text": "abort", "sampling_params": {"max_new_tokens": 10}})[1]
    assert g["meta_info"]["finish_reason"]["type"] == "abort"
    jcall(u, "/admin/faults", {"fault_abort": 0.0, "served_model_name": "wrong/name", "context_length": 2048})
    assert jcall(u, "/v1/models")[1]["data"][0]["id"] == "wrong/name"  # chat itself checks no model name
    assert jcall(u, "/v1/models")[1]["data"][0]["id"] == "wrong/name"
    assert jcall(u, "/v1/models")[1]["data"][0]["max_model_len"] == 2048
    assert jcall(u, "/admin/faults", {"no_such_fault": 1})[0] == 400
    stats = jcall(u, "/admin/stats")[1]
    assert stats["requests"]["/v1/chat/completions"]["500"] == 1
    assert stats["requests"]["/v1/chat/completions"]["stream_error"] == 1
    assert stats["requests"]["/generate"]["429"] == 1


def test_fault_draws_are_deterministic(fresh):
    def pattern():
        jcall(fresh.url, "/admin/faults", {"fault_503": 0.3, "fault_400": 0.2, "fault_seed": 123})
        return [call(fresh.url, "/generate", {"text": f"p{i}", "sampling_params": {"max_new_tokens": 2}})[0]
                for i in range(30)]
    a = pattern()
    b = pattern()
    assert a == b and {200, 400, 503} <= set(a)


def test_hang_reset_and_health_trap(fresh):
    u = fresh.url
    jcall(u, "/admin/faults", {"fault_hang": 1.0})
    host, port = u.removeprefix("http://").split(":")
    body = json.dumps(chat("hang")).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # held open until the server counted it
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: emu\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: jcall(u, "/admin/stats")[1]["requests"].get("/v1/chat/completions", {}).get("hang") == 1,
                 30, what="the hung request counted")
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(1)  # counted as hung, and no answer
    jcall(u, "/admin/faults", {"fault_hang": 0.0, "fault_reset": 1.0})

    async def fetch(body):
        async with aiohttp.ClientSession() as s:
            async with s.post(u + "/v1/chat/completions", json=body) as r:
                return await r.read()

    with pytest.raises(aiohttp.ClientError):
        asyncio.run(fetch(chat("reset me", max_tokens=40)))
    with pytest.raises(aiohttp.ClientError):
        asyncio.run(fetch(chat("reset stream", max_tokens=40, stream=True)))
    jcall(u, "/admin/faults", {"fault_reset": 0.0, "health_ok_while_hung": True})
    assert call(u, "/health")[0] == 200
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        call(u, "/generate", {"text": "stuck"}, timeout=0.3)
    jcall(u, "/admin/faults", {"health_ok_while_hung": False, "slow_stream_s": 0.05})
    t = time.monotonic()
    call(u, "/v1/chat/completions", chat("slow", max_tokens=6, stream=True, ignore_eos=True))
    assert time.monotonic() - t >= 0.25
    # a slowed server: the decode speed changes at run time, for requests that start after the change
    assert jcall(u, "/admin/faults", {"slow_stream_s": 0.0, "tok_per_s": 20})[1]["tok_per_s"] == 20.0
    t = time.monotonic()
    call(u, "/v1/chat/completions", chat("slowed", max_tokens=6, ignore_eos=True))
    assert time.monotonic() - t >= 0.25
    status, answer = jcall(u, "/admin/faults", {"tok_per_s": -1})
    assert status == 400 and "tok_per_s must be >= 0" in answer["error"]["message"]
    # a refused body changes nothing; no value is converted into another ("false" into True, 1.9 into 1)
    before = jcall(u, "/admin/faults")[1]
    for body in ({"fault_500": 0.5, "tok_per_s": -1}, {"tok_per_s": "nan"}, {"fault_500": 0.5, "context_length": -5},
                 {"health_503": "false"}, {"context_length": 1.9}, {"context_length": True}, {"fault_seed": 1.5},
                 {"served_model_name": None}, {"tok_per_s": True}, {"fault_500": True}):
        assert jcall(u, "/admin/faults", body)[0] == 400, body
    assert jcall(u, "/admin/faults")[1] == before and before["tok_per_s"] == 20.0
    stats = jcall(u, "/admin/stats")[1]
    assert stats["requests"]["/v1/chat/completions"]["hang"] == 1
    assert stats["requests"]["/v1/chat/completions"]["reset"] == 2
    assert stats["max_in_flight"] >= 1


# --- request log, crash ---------------------------------------------------------------------------
def test_request_log(fresh, log_path):
    before = log_path.read_text().count("\n") if log_path.exists() else 0
    jcall(fresh.url, "/v1/chat/completions", chat("logged prompt", rid="log-1"))
    jcall(fresh.url, "/generate", {"text": "logged text", "sampling_params": {"max_new_tokens": 3}})
    jcall(fresh.url, "/v1/chat/completions", chat("w " * 5000))
    lines = [json.loads(x) for x in log_path.read_text().splitlines()[before:]]
    assert [x["route"] for x in lines] == ["/v1/chat/completions", "/generate", "/v1/chat/completions"]
    assert lines[0]["rid"] == "log-1" and lines[0]["messages"][0]["content"] == "logged prompt"
    assert lines[0]["max_tokens"] == 24 and lines[0]["outcome"] in ("stop", "length")
    assert lines[1]["text"] == "logged text" and lines[1]["max_tokens"] == 3
    assert lines[2]["outcome"] == "error:400" and "time" in lines[2]


def test_sigkill_and_restart():
    p = start_emulator(preset="kimi")
    try:
        before = jcall(p.url, "/v1/chat/completions", chat("survive a crash"))[1]
        p.kill()
        assert not p.alive()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            call(p.url, "/health", timeout=1)
        p.restart()
        assert call(p.url, "/health")[0] == 200
        after = jcall(p.url, "/v1/chat/completions", chat("survive a crash"))[1]
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
    finally:
        p.stop()



def test_a_setting_takes_its_fields_type_not_the_value_it_holds():
    """An emulator built in this process with `tok_per_s=50` (an int) refused 12.5 as "an integer"; NaN and Inf,
    which no JSON body can carry, are refused here too."""
    from pipeline.emulator.state import ServerState

    state = ServerState(make_config(tok_per_s=50, slow_stream_s=0))
    assert state.update_faults({"tok_per_s": 12.5, "slow_stream_s": 0.2})["tok_per_s"] == 12.5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            state.update_faults({"tok_per_s": bad})
