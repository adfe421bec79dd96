"""Baselines for the benchmarks: what a user would write without regen.

A bare asyncio + `openai.AsyncOpenAI` client, writing nothing. Long-lived worker coroutines (`concurrency` per
endpoint) each take the next prompt from a queue:
  --mode pool   one queue shared by every endpoint's workers (the overhead baseline);
  --mode shard  static round-robin sharding: prompt i goes to endpoint i % n up front, each endpoint's workers
                drain only their own shard (what common regeneration scripts do; the straggler baseline).
The request carries the same fields regen sends. Prints one JSON line: first request and last answer times
(time.time()), ok/error counts and the completion tokens.

    python -m pipeline.bench.clients --mode pool --urls http://127.0.0.1:30000 --prompts p.jsonl
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

import openai
import orjson


async def run(urls: list[str], prompts: list[str], concurrency: int, max_tokens: int, model: str,
              mode: str) -> dict:
    clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=600) for u in urls]
    if mode == "pool":
        shared: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            shared.put_nowait(p)
        queues = [shared] * len(urls)
    else:
        queues = [asyncio.Queue() for _ in urls]
        for i, p in enumerate(prompts):
            queues[i % len(urls)].put_nowait(p)
    state = {"first": None, "last": None, "ok": 0, "err": 0, "tokens": 0}
    per_endpoint_last = [0.0] * len(urls)

    async def worker(k: int) -> None:
        client, queue = clients[k], queues[k]
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if state["first"] is None:
                state["first"] = time.time()
            try:
                reply = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0.0, top_p=1.0, seed=None,
                    extra_body={"rid": uuid.uuid4().hex, "return_token_ids": True, "return_prompt_token_ids": True})
                state["ok"] += 1
                state["tokens"] += reply.usage.completion_tokens if reply.usage else 0
            except openai.APIError:
                state["err"] += 1
            state["last"] = per_endpoint_last[k] = time.time()

    await asyncio.gather(*(worker(k) for k in range(len(urls)) for _ in range(concurrency)))
    for client in clients:
        await client.close()
    return {"mode": mode, "first": state["first"], "last": state["last"], "ok": state["ok"], "errors": state["err"],
            "completion_tokens": state["tokens"], "elapsed_s": state["last"] - state["first"],
            "per_endpoint_last": per_endpoint_last}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.clients", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("pool", "shard"), default="pool")
    p.add_argument("--urls", required=True, help="comma-separated endpoint root URLs")
    p.add_argument("--prompts", required=True, help="JSONL of {'prompt': ...}")
    p.add_argument("--concurrency", type=int, default=64, help="workers per endpoint")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default="moonshotai/Kimi-K2.5")
    a = p.parse_args(argv)
    with open(a.prompts, "rb") as f:
        prompts = [orjson.loads(line)["prompt"] for line in f if line.strip()]
    res = asyncio.run(run(a.urls.split(","), prompts, a.concurrency, a.max_tokens, a.model, a.mode))
    sys.stdout.write(orjson.dumps(res).decode() + "\n")
    return 0 if res["ok"] and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
