"""A small raw-aiohttp load generator: N long-lived workers, each posting the next request on a kept-alive
connection, for a fixed duration. Run it in its own process:

    python -m pipeline.emulator.loadgen --url http://127.0.0.1:30000 --concurrency 256 --duration 5

Prints one JSON line: requests, errors, seconds, req_per_s, latency percentiles (ms).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp
import orjson


def _bodies(route: str, n_prompts: int, max_tokens: int, model: str | None) -> list[bytes]:
    out = []
    for i in range(n_prompts):
        prompt = f"Question {i}: explain item {i * 7919 % 1000} of the list in one short sentence."
        if route == "generate":
            body = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
        else:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
            if model:
                body["model"] = model
        out.append(orjson.dumps(body))
    return out


async def run_loadgen(url: str, concurrency: int = 256, duration: float = 5.0, max_tokens: int = 16,
                      route: str = "chat", n_prompts: int = 1000, model: str | None = None,
                      warmup: float = 0.5) -> dict:
    """Drive `url` for `duration` seconds (after `warmup`) and return the measured rates."""
    path = "/generate" if route == "generate" else "/v1/chat/completions"
    target = url.rstrip("/") + path
    bodies = _bodies(route, n_prompts, max_tokens, model)
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    counts = {"ok": 0, "err": 0}
    kinds: dict[str, int] = {}
    state = {"measure": False, "stop": False}

    async def worker(k: int, session: aiohttp.ClientSession) -> None:
        i = k
        while not state["stop"]:
            body = bodies[i % len(bodies)]
            i += concurrency
            t = time.perf_counter()
            try:
                async with session.post(target, data=body, headers=headers) as r:
                    await r.read()
                    kind = "ok" if r.status == 200 else f"http_{r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                kind = type(e).__name__
            if state["measure"]:
                lat.append(time.perf_counter() - t)
                if kind == "ok":
                    counts["ok"] += 1
                else:
                    counts["err"] += 1
                    kinds[kind] = kinds.get(kind, 0) + 1

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:
        tasks = [asyncio.create_task(worker(k, session)) for k in range(concurrency)]
        await asyncio.sleep(warmup)
        state["measure"] = True
        t0 = time.perf_counter()
        await asyncio.sleep(duration)
        state["measure"] = False
        elapsed = time.perf_counter() - t0
        state["stop"] = True
        await asyncio.gather(*tasks, return_exceptions=True)
    lat.sort()

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else 0.0

    n = counts["ok"] + counts["err"]
    return {"url": target, "concurrency": concurrency, "max_tokens": max_tokens, "requests": n,
            "errors": counts["err"], "error_kinds": kinds, "seconds": round(elapsed, 3), "req_per_s": round(n / elapsed, 1),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.emulator.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--route", choices=("chat", "generate"), default="chat")
    p.add_argument("--prompts", type=int, default=1000, help="distinct prompts cycled through")
    p.add_argument("--model", default=None)
    a = p.parse_args(argv)
    res = asyncio.run(run_loadgen(a.url, a.concurrency, a.duration, a.max_tokens, a.route, a.prompts, a.model,
                                  a.warmup))
    sys.stdout.write(orjson.dumps(res).decode() + "\n")
    return 0 if res["requests"] and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
