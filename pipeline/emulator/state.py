"""Per-server mutable state: prefix cache, admission (capacity + waiting queue), fault draws, counters, request log."""
from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import math
import random
import time
from typing import Any

import orjson

from .batch import Batch
from .config import FAULT_FIELDS, RATE_FIELDS, EmulatorConfig

_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(EmulatorConfig)}  # annotations: "int", "bool", ...

_MASK = (1 << 61) - 1
_MUL = 1_000_003

E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class Overloaded(Exception):
    """Admission refused: 503 with SGLang's message."""


class PrefixCache:
    """Token-prefix cache in the spirit of the radix cache: every prefix of a finished sequence is remembered
    (rolling hashes, LRU-bounded by the number of prefixes). `match` returns the longest cached prefix length."""

    def __init__(self, max_entries: int):
        self.max_entries = max(1, max_entries)
        self._d: collections.OrderedDict[int, None] = collections.OrderedDict()

    @staticmethod
    def prefix_hashes(ids: list[int]) -> list[int]:
        out = []
        h = 7
        for t in ids:
            h = (h * _MUL + t + 1) & _MASK
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> int:
        """Longest n such that the n-token prefix is cached (binary search: the set is prefix-closed)."""
        d = self._d
        if not hashes or hashes[0] not in d:
            return 0
        lo, hi = 1, len(hashes)           # hashes[lo-1] cached
        if hashes[-1] in d:
            lo = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if hashes[mid - 1] in d:
                    lo = mid
                else:
                    hi = mid
        return lo

    def insert(self, hashes: list[int]) -> None:
        """Remember every prefix (refreshing the ones already cached); evict the least recently used."""
        d = self._d
        move = d.move_to_end
        for h in hashes:
            if h in d:
                move(h)
            else:
                d[h] = None
        excess = len(d) - self.max_entries
        if excess > 0:
            pop = d.popitem
            for _ in range(excess):
                pop(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class ServerState:
    def __init__(self, cfg: EmulatorConfig):
        self.cfg = cfg
        self._initial_faults = cfg.faults()
        self.started = time.time()
        self.cache = PrefixCache(cfg.cache_max_tokens)
        self.running_rids: set[str] = set()
        self.running = 0
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.running_tokens = 0
        self.batch: Batch | None = None   # the throughput curve (batch.py), made on the loop at first use
        self._log = open(cfg.request_log, "ab", buffering=0) if cfg.request_log else None
        self.reset()

    # -- counters -----------------------------------------------------------------------------------
    def reset(self, faults: bool = True) -> None:
        if faults:
            for k, v in self._initial_faults.items():
                setattr(self.cfg, k, v)
        self.rng = random.Random(self.cfg.fault_seed)
        self._any_fault = self._compute_any_fault()
        self.poison_hits = 0
        self.cache.clear()
        self.by_route: dict[str, collections.Counter] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests_total = 0
        self.cache_hit_requests = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.e2e = Histogram(E2E_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self._tp_mark = (time.monotonic(), 0)
        self.last_gen_throughput = 0.0

    def count(self, route: str, outcome: str) -> None:
        c = self.by_route.get(route)
        if c is None:
            c = self.by_route[route] = collections.Counter()
        c[outcome] += 1

    def enter(self) -> None:
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight

    def leave(self) -> None:
        self.in_flight -= 1

    def record_done(self, prompt_tokens: int, cached: int, completion_tokens: int, e2e: float, ttft: float) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.cached_tokens_total += cached
        self.generation_tokens_total += completion_tokens
        if cached > 0:
            self.cache_hit_requests += 1
        self.e2e.observe(e2e)
        self.ttft.observe(ttft)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def gen_throughput(self) -> float:
        t0, n0 = self._tp_mark
        now = time.monotonic()
        if now - t0 >= 1.0:
            self.last_gen_throughput = (self.generation_tokens_total - n0) / (now - t0)
            self._tp_mark = (now, self.generation_tokens_total)
        return self.last_gen_throughput

    def stats(self) -> dict[str, Any]:
        return {
            "requests": {r: dict(c) for r, c in self.by_route.items()},
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "running": self.running,
            "waiting": len(self.waiting),
            "requests_finished": self.requests_total,
            "cache_hits": self.cache_hit_requests,
            "cache_hit_rate": self.cache_hit_rate,
            "cached_tokens_total": self.cached_tokens_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "cache_entries": len(self.cache),
            "faults": self.cfg.faults(),
            "uptime_s": time.time() - self.started,
        }

    # -- faults -------------------------------------------------------------------------------------
    def _compute_any_fault(self) -> bool:
        return any(getattr(self.cfg, k) for k in RATE_FIELDS)

    def update_faults(self, body: dict) -> dict:
        """Checks every setting of `body` before it applies any: a refused body changes nothing."""
        bad = sorted(set(body) - set(FAULT_FIELDS))
        if bad:
            raise ValueError(f"unknown fault settings {bad}; valid: {list(FAULT_FIELDS)}")
        checked = {k: self._checked_fault(k, v) for k, v in body.items()}
        if checked.get("tok_per_s") and self.cfg.throughput_curve:
            raise ValueError("tok_per_s has no effect with the throughput curve on (its step_ms times the batch)")
        for k, v in checked.items():
            setattr(self.cfg, k, v)
        if "fault_seed" in body:
            self.rng = random.Random(self.cfg.fault_seed)
        self._any_fault = self._compute_any_fault()
        return self.cfg.faults()

    def _checked_fault(self, k: str, v: Any) -> Any:
        """The value as the setting's type, never a conversion that changes what was asked ("false" is no bool,
        1.9 no int)."""
        declared = _FIELD_TYPES[k]  # the field's type, not its current value's (a launch may pass 40 for 40.0)
        if k == "served_model_name":
            if not isinstance(v, str) or not v:
                raise ValueError(f"{k} must be a non-empty string")
            return v
        if declared == "bool":
            if not isinstance(v, bool):
                raise ValueError(f"{k} must be true or false")
            return v
        if declared == "int":  # context_length, fault_seed
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{k} must be an integer")
            if k == "context_length" and v <= 0:
                raise ValueError("context_length must be > 0")
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{k} must be a finite number")
        if k in RATE_FIELDS and not 0.0 <= v <= 1.0:
            raise ValueError(f"{k} must be in [0, 1]")
        if v < 0.0:
            raise ValueError(f"{k} must be >= 0")
        return float(v)

    def poison(self, body: dict) -> str | None:
        """The poison fault, if this request carries the poison text (and the hits are not used up)."""
        needle = self.cfg.poison_text
        if not needle:
            return None
        parts = [body.get("text")] + [m.get("content") for m in body.get("messages") or [] if isinstance(m, dict)]
        text = " ".join(p if isinstance(p, str) else str(p) for p in parts if p)
        if needle not in text or (self.cfg.poison_times and self.poison_hits >= self.cfg.poison_times):
            return None
        self.poison_hits += 1
        return self.cfg.poison_fault

    def draw_fault(self) -> str | None:
        """One uniform draw per generation request, tested against the cumulative rates in RATE_FIELDS order."""
        if not self._any_fault:
            return None
        u = self.rng.random()
        acc = 0.0
        cfg = self.cfg
        for k in RATE_FIELDS:
            acc += getattr(cfg, k)
            if u < acc:
                return k[6:]            # "500", "503", "429", "400", "hang", "reset", "abort"
        return None

    # -- admission ----------------------------------------------------------------------------------
    async def acquire(self) -> None:
        cap = self.cfg.capacity
        if cap <= 0 or (self.running < cap and not self.waiting):
            self.running += 1
            return
        mq = self.cfg.max_queue
        if mq >= 0 and len(self.waiting) >= mq:
            raise Overloaded("The request queue is full.")
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            if self.cfg.queue_timeout:
                await asyncio.wait_for(asyncio.shield(fut), self.cfg.queue_timeout)
            else:
                await fut
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():
                return                  # granted at the last moment: keep the slot
            fut.cancel()
            self._drop(fut)
            raise Overloaded("Request waiting timeout reached.") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()          # the slot was handed to us; pass it on
            else:
                fut.cancel()
                self._drop(fut)
            raise

    def _drop(self, fut: asyncio.Future) -> None:
        try:
            self.waiting.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)    # the running slot passes to the waiter
                return
        self.running -= 1

    def curve(self) -> Batch:
        if self.batch is None:
            c = self.cfg
            self.batch = Batch(c.step_ms / 1000.0, c.knee, c.max_total_num_tokens,
                               c.capacity if c.capacity > 0 else 1 << 30, c.max_queue, c.prefill_tok_per_s,
                               c.decode_log_interval)
        return self.batch

    def gauges(self) -> tuple[int, int, float]:
        """(running, waiting, token_usage) as /metrics reports them: the curve's lagging snapshot, or now."""
        if self.batch is not None:
            return self.batch.gauges
        return self.running, len(self.waiting), min(1.0, self.running_tokens / max(1, self.cfg.max_total_num_tokens))

    # -- request log ----------------------------------------------------------------------------------
    def log_request(self, route: str, rid: str, body: dict, outcome: str, **extra: Any) -> None:
        if self._log is None:
            return
        rec = {"time": time.time(), "rid": rid, "route": route}
        if "messages" in body:
            rec["messages"] = body.get("messages")
            rec["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            if body.get("text") is not None:
                rec["text"] = body.get("text")
            else:
                rec["input_ids"] = body.get("input_ids")
            sp = body.get("sampling_params") or {}
            rec["max_tokens"] = sp.get("max_new_tokens", 128) if isinstance(sp, dict) else None
        rec["outcome"] = outcome
        rec.update(extra)
        if self.cfg.request_log_bodies:
            rec["body"] = body
        self._log.write(orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS))

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
        if self._log is not None:
            self._log.close()
            self._log = None
