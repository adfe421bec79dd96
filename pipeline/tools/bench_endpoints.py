"""`regen bench-endpoints CONFIG`: decode speed of each endpoint, before and after deploying a draft.

For every endpoint: the same fixed prompts, greedy, `--max-tokens` each, first one request at a time, then
`--concurrency` at once. Per prompt: tokens, seconds, tok/s; per endpoint: tokens / total time. Where the
server exposes them, the speculative accept length and rate:
  - per request from /generate's meta_info (`spec_accept_length`, `spec_verify_ct`: completion / verify count),
    the prompt templated by the server itself (a chat request returning `prompt_token_ids`);
  - per server by sampling the /metrics gauges `sglang:spec_accept_length`, `sglang:spec_accept_rate` during
    the run (they are gauges: a before/after difference means nothing);
  - vLLM has counters instead: the difference of `vllm:generation_tokens_total` over the run gives the server's
    own throughput, and of `vllm:spec_decode_num_{accepted_tokens,draft_tokens,drafts}_total` its acceptance
    rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts).
Servers without /generate (vLLM, llama.cpp) are measured through chat completions.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.config import Endpoint, load_config
from ..core.errors import RegenError, Retryable
from ..dispatch.actors import client_settings
from ..endpoints.classify import classify, error_message
from ..endpoints.client import EndpointClient
from ..endpoints.engines import SGLangAdapter, vllm as vllm_engine
from ..endpoints.identity import identify

PROMPTS = [
    "Explain how a refrigerator moves heat out of its inside, step by step, for a curious teenager.",
    "Write a Python function that merges overlapping intervals, with a docstring and three test cases.",
    "Why is the sky blue during the day and red at sunset? Give the physics behind both.",
    "Compare TCP and UDP: what each guarantees, what each costs, and when to choose which.",
    "Summarise the causes and consequences of the French Revolution in a few paragraphs.",
    "Describe how photosynthesis turns light into chemical energy, naming the main stages.",
]


@dataclass
class Measure:
    prompt: int
    tokens: int
    seconds: float
    accept_length: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class EndpointBench:
    label: str
    sequential: list[Measure] = field(default_factory=list)
    concurrent: list[Measure] = field(default_factory=list)
    concurrent_wall_s: float = 0.0
    gauges: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # vLLM's, their increase over the whole bench
    wall_s: float = 0.0

    def tok_s(self, concurrent: bool) -> float:
        runs = self.concurrent if concurrent else self.sequential
        wall = self.concurrent_wall_s if concurrent else sum(m.seconds for m in runs)
        return sum(m.tokens for m in runs) / max(wall, 1e-9)

    def accept_length(self) -> float | None:
        values = [m.accept_length for m in self.sequential + self.concurrent if m.accept_length]
        return statistics.mean(values) if values else None


async def prompt_ids(client: EndpointClient, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as the server's own chat template renders it (one token of output)."""
    s = client.settings
    body: dict[str, Any] = {"model": s.model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                            "return_prompt_token_ids": True, "rid": uuid.uuid4().hex}
    if s.chat_template_kwargs:
        body["chat_template_kwargs"] = s.chat_template_kwargs
    status, answer = await client.post_json("/v1/chat/completions", body, timeout_s=s.timeout_s)
    if status != 200:
        raise classify(status, error_message(answer, f"/v1/chat/completions answered {status}"), client.label)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    ids = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    if not ids:
        raise Retryable("the server returned no prompt_token_ids (SGLang >= 0.5.9 is needed)", endpoint=client.label)
    return ids


async def one_request(client: EndpointClient, prompt: int, native: bool) -> Measure:
    messages = [{"role": "user", "content": PROMPTS[prompt]}]
    s = client.settings
    started = time.monotonic()
    if not native:
        completion = await client.chat(messages, seed=None)
        return Measure(prompt, completion.completion_tokens, time.monotonic() - started)
    ids = await prompt_ids(client, messages)
    started = time.monotonic()  # time the generation itself, not the templating request
    status, body = await client.post_json("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": s.max_tokens, "temperature": 0.0}}, timeout_s=s.timeout_s)
    seconds = time.monotonic() - started
    if status != 200:
        raise classify(status, error_message(body, f"/generate answered {status}"), client.label)
    meta = body["meta_info"]
    verify = meta.get("spec_verify_ct")
    accept = meta["completion_tokens"] / verify if verify else meta.get("spec_accept_length")
    return Measure(prompt, int(meta["completion_tokens"]), seconds, accept)


async def sample_gauges(client: EndpointClient, into: dict[str, list[float]], stop: asyncio.Event) -> None:
    names = ("sglang:spec_accept_length", "sglang:spec_accept_rate")
    while not stop.is_set():
        status, text = await client.get_json("/metrics")
        if status != 200 or not isinstance(text, str):
            return  # no metrics (not enabled, or not SGLang)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                into.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def read_counters(client: EndpointClient) -> dict[str, float]:
    """vLLM's /metrics counters, each summed over its label sets (empty when there are none)."""
    status, text = await client.get_json("/metrics")
    totals: dict[str, float] = {}
    if status != 200 or not isinstance(text, str):
        return totals
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in vllm_engine.METRIC_COUNTERS:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def bench_endpoint(client: EndpointClient, n_prompts: int, concurrency: int) -> EndpointBench:
    result = EndpointBench(client.label)
    # the engine first: its request fields (vLLM's request_id, not SGLang's rid) and where its ids are
    native = isinstance(await identify(client), SGLangAdapter)  # SGLang: /generate with meta_info
    before, bench_started = await read_counters(client), time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_gauges(client, result.gauges, stop))
    try:
        for prompt in range(n_prompts):
            result.sequential.append(await one_request(client, prompt, native))
        started = time.monotonic()
        result.concurrent = list(await asyncio.gather(
            *(one_request(client, i % n_prompts, native) for i in range(concurrency))))
        result.concurrent_wall_s = time.monotonic() - started
    finally:
        stop.set()
        await sampler
    after = await read_counters(client)
    result.wall_s = time.monotonic() - bench_started
    result.counters = {name: after[name] - before.get(name, 0.0) for name in after}
    return result


def counter_lines(r: EndpointBench) -> list[str]:
    c = r.counters
    lines = []
    if vllm_engine.GENERATION_TOKENS in c:
        tokens = c[vllm_engine.GENERATION_TOKENS]
        lines.append(f"  /metrics {vllm_engine.GENERATION_TOKENS}: {tokens:.0f} tokens in {r.wall_s:.1f}s = "
                     f"{tokens / max(r.wall_s, 1e-9):.1f} tok/s (the server's count)")
    drafts, draft_tokens = c.get(vllm_engine.SPEC_DRAFTS), c.get(vllm_engine.SPEC_DRAFT_TOKENS)
    accepted = c.get(vllm_engine.SPEC_ACCEPTED_TOKENS)
    if draft_tokens and accepted is not None and drafts:
        lines.append(f"  speculative (/metrics vllm:spec_decode_*): acceptance rate {accepted / draft_tokens:.3f} "
                     f"({accepted:.0f} of {draft_tokens:.0f} draft tokens), mean acceptance length "
                     f"{1 + accepted / drafts:.2f}")
    return lines


def report(results: list[EndpointBench], concurrency: int, baseline: str | None) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.label}")
        lines.append(f"  {'prompt':<8}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'accept':>8}")
        for m in r.sequential:
            accept = f"{m.accept_length:.2f}" if m.accept_length else "-"
            lines.append(f"  {m.prompt:<8}{m.tokens:>8}{m.seconds:>9.2f}{m.tok_s:>9.1f}{accept:>8}")
        lines.append(f"  one at a time: {r.tok_s(False):.1f} tok/s; {concurrency} at once: {r.tok_s(True):.1f} tok/s")
        accept = r.accept_length()
        gauges = {k.split(":")[1]: statistics.mean(v) for k, v in r.gauges.items() if v}
        if accept or gauges:
            lines.append(f"  speculative: accept length {accept:.2f} per request" if accept else "  speculative:")
            lines += [f"    /metrics {name} (mean of {len(r.gauges['sglang:' + name])} samples): {value:.3f}"
                      for name, value in gauges.items()]
        lines += counter_lines(r)
    if baseline:
        base = next((r for r in results if r.label == baseline), None)
        if base is None:
            raise RegenError(f"--baseline {baseline!r} is not one of the endpoints: {[r.label for r in results]}")
        lines.append(f"speed-up against {baseline}:")
        lines += [f"  {r.label:<28} {r.tok_s(False) / base.tok_s(False):.2f}x one at a time, "
                  f"{r.tok_s(True) / base.tok_s(True):.2f}x at {concurrency}" for r in results]
    return "\n".join(lines)


async def run_all(endpoints: list[Endpoint], cfg, args) -> list[EndpointBench]:
    settings = client_settings(cfg.model_copy(update={"sampling": cfg.sampling.model_copy(
        update={"max_tokens": args.max_tokens, "temperature": 0.0})}))
    results = []
    for e in endpoints:  # one endpoint at a time: they must not share the client machine's cores
        client = EndpointClient(e.url, e.label, settings, cfg.api_key(e))
        try:
            results.append(await bench_endpoint(client, args.prompts, args.concurrency))
        finally:
            await client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regen bench-endpoints", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="tokens generated per prompt, greedy (default 1024)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(5, len(PROMPTS) + 1),
                        metavar=f"5..{len(PROMPTS)}", help="how many of the fixed prompts to send (default: all)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once in the second pass")
    parser.add_argument("--baseline", help="endpoint label to compare against (speed-up ratios)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    with contextlib.ExitStack() as stack:
        if cfg.local_fleet is not None:  # the local default: start (or reuse) its llama.cpp servers
            from ..endpoints.localfleet import LocalFleetProcesses

            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="regen-bench-endpoints-")))
            stack.enter_context(LocalFleetProcesses(cfg.local_fleet, logs))
        results = asyncio.run(run_all(cfg.all_endpoints(), cfg, args))
    print(report(results, args.concurrency, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
