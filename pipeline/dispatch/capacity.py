"""`concurrency: auto`: the pure core of the per-endpoint concurrency controller (no Ray, no HTTP, no clock).

The worker feeds it what it sees and applies the limit it returns:
- `Limits`: what the server says it batches (SGLang /server_info: `effective_max_running_requests_per_dp` times
  `dp_size`, `max_queued_requests`, `max_total_num_tokens`; vLLM dev-mode `max_num_seqs`).
- `Gauges`: the server's running and waiting counts and its retraction counter (SGLang `/metrics` with
  --enable-metrics; vLLM `vllm:num_requests_running`/`_waiting`). They lag (SGLang refreshes them every
  decode_log_interval steps), so the controller acts at most once per `interval_s`, and only on a reading taken
  at least `interval_s` after its last change.
- Where there are no gauges, the time per output token of each completion: a gradient limiter in the manner of
  Netflix's concurrency-limits (Gradient2): `limit * clamp(tolerance * baseline / now) + sqrt(limit)`, smoothed.

The rules with gauges: a retraction (the KV pool is full) or a waiting queue longer than `queue_target` cuts the
limit to what the server runs (never below `floor`); a server that runs all we send grows it, twofold while no cut
has happened yet (slow start from `start`, doubling, so no burst) and by a tenth after. Never above `cap` (the user's), the
server's batch plus a headroom, nor its batch plus its `max_queued_requests` (503s past it). `reset` re-starts
it from the limits of a restarted server (a smaller pool, another data-parallel size).
"""
from __future__ import annotations

import math

from ..endpoints.capacity import Gauges, Limits


class AutoConcurrency:
    def __init__(self, cap: int, limits: Limits = Limits(), start: int = 8, floor: int = 1,
                 interval_s: float = 2.5, now: float = 0.0, tolerance: float = 1.5):
        self.cap, self.floor, self.interval_s, self.tolerance = cap, max(1, floor), interval_s, tolerance
        self.start = start
        self.limits = limits
        self.limit = min(start, limits.ceiling(cap))
        self.changed_at = now
        self.slow_start = True
        self.last_retracted: float | None = None
        self.settled_at: float | None = None       # the last change (the time auto took to settle)
        self.baseline: float | None = None         # per-token seconds of a light batch (latency mode)
        self._samples: list[float] = []
        self.reason = "start"

    # -- the server's limits ------------------------------------------------------------------------------
    def reset(self, limits: Limits, now: float) -> int:
        """A (re)started server: its limits anew; back to a slow start from min(limit, start)."""
        self.limits = limits
        self.last_retracted = None
        self.baseline = None
        self._samples.clear()
        self.slow_start = True
        return self._set(min(self.limit, self.start), now, "server restarted")

    @property
    def ceiling(self) -> int:
        return self.limits.ceiling(self.cap)

    def _set(self, value: int, now: float, reason: str) -> int:
        value = max(self.floor, min(self.ceiling, int(value)))
        if value != self.limit:
            self.limit, self.changed_at, self.settled_at, self.reason = value, now, now, reason
        return self.limit

    # -- from the server's gauges ---------------------------------------------------------------------------
    def on_gauges(self, g: Gauges, in_flight: int, now: float) -> int:
        retracted = 0.0
        if g.retracted_total is not None:
            if self.last_retracted is not None and g.retracted_total >= self.last_retracted:
                retracted = g.retracted_total - self.last_retracted
            self.last_retracted = g.retracted_total          # a smaller counter: the server restarted
        if g.at - self.changed_at < self.interval_s or now - self.changed_at < self.interval_s:
            return self.limit                                 # the gauges may predate the last change
        if retracted > 0:
            self.slow_start = False
            return self._set(min(self.limit * 0.8, max(g.running, self.floor)), now, "retractions")
        if g.waiting > queue_target(g.running):
            self.slow_start = False
            return self._set(max(g.running + queue_target(g.running), self.limit * 0.7), now, "server queue")
        if (in_flight >= self.limit * 0.8 and g.running >= min(in_flight, self.limit) * 0.8
                and g.waiting < queue_target(g.running)):
            step = self.limit if self.slow_start else max(1.0, self.limit * 0.1)
            return self._set(math.ceil(self.limit + step), now, "server keeps up")
        return self.limit

    # -- from latency alone (no gauges) -------------------------------------------------------------------
    def on_completion(self, seconds_per_token: float, in_flight: int, now: float) -> int:
        """One completion's time per output token (seconds / tokens); acts once per interval."""
        if seconds_per_token > 0:
            self._samples.append(seconds_per_token)
        if now - self.changed_at < self.interval_s or len(self._samples) < 8:
            return self.limit
        self._samples.sort()
        short = self._samples[len(self._samples) // 2]
        self._samples.clear()
        self.baseline = short if self.baseline is None else min(short, self.baseline * 1.02)  # forgets slowly
        gradient = max(0.5, min(1.0, self.tolerance * self.baseline / short))
        if gradient >= 1.0 and in_flight < self.limit * 0.8:
            return self.limit                                 # not using the limit: no evidence to grow
        new = self.limit * gradient + math.sqrt(self.limit)
        value = self.limit * 0.5 + new * 0.5 if gradient < 1.0 else new
        return self._set(math.ceil(value) if gradient >= 1.0 else int(value), now,
                         "latency grows" if gradient < 1.0 else "latency flat")


def queue_target(running: float) -> float:
    """The waiting count that still keeps the batch full: 5% of it, at least 2."""
    return max(2.0, running * 0.05)
