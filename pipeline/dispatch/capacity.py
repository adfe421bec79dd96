"""`concurrency: auto`: the pure core of the per-endpoint concurrency controller (no Ray, no HTTP, no clock).

The worker feeds it what it sees and applies the limit it returns:
- `Limits`: what the server says it batches (SGLang /server_info: `effective_max_running_requests_per_dp` times
  `dp_size`, `max_queued_requests`, `max_total_num_tokens`; vLLM dev-mode `max_num_seqs`).
- `Gauges`: the server's running and waiting counts and its retraction counter (SGLang `/metrics` with
  --enable-metrics; vLLM `vllm:num_requests_running`/`_waiting`). They lag (SGLang refreshes them every
  decode_log_interval steps), so the controller acts on a reading only once it is known to postdate its last
  change: taken at least `interval_s` after it, or, while ramping up, one where the server runs more requests than
  the limit before the raise allowed (it cannot have seen that before the raise).
- Where there are no gauges, the time per output token of each completion: a gradient limiter in the manner of
  Netflix's concurrency-limits (Gradient2): `limit * clamp(tolerance * baseline / now) + sqrt(limit)`, smoothed.

The rules with gauges:
- **Ramp** (slow start from `start`, so no burst): the limit doubles each time a confirmed reading shows the server
  running (nearly) all of it with no waiting queue, so it climbs at the pace of the gauges' refresh, not of a
  fixed interval.
- **Cut**: a retraction (the KV pool is full) or a waiting queue longer than `queue_target` in two readings in a
  row (in one alone it may be a burst of arrivals between two scheduler steps) cuts the limit to what the server
  runs (a retraction: never below half the limit, as the retracted requests have just left the running count;
  never below `floor`) and ends the ramp. The limit it cut from is remembered (`too_many`).
- **After a cut**: while the server keeps up, the limit grows each interval by half its distance to one below
  `too_many` and holds there; after `HOLDS` intervals it tries `too_many` once more (a probe). A probe that is cut
  goes back to the held limit and doubles the hold (up to `MAX_HOLDS` intervals); a probe that holds for an
  interval forgets `too_many` (the server takes more now) and the limit grows by 5% an interval. So it settles
  instead of oscillating around the server's limit.
Never above `cap` (the user's `concurrency_cap`), the server's batch plus a headroom, nor its batch plus its
`max_queued_requests` (503s past it); a change the cap clamped, where the server would take more, has the reason
`concurrency_cap`. `reset` re-starts it from the limits of a restarted server (a smaller pool, another data-parallel
size). `settled_at` is when the limit last entered the band of ±`SETTLE_BAND` around its current value and stayed.
"""
from __future__ import annotations

import collections
import math

from ..endpoints.capacity import Gauges, Limits

HOLDS, MAX_HOLDS = 4, 16      # intervals spent below `too_many` before a probe of it: first, longest
UNBOUNDED = 1 << 30           # a cap that bounds nothing: what the server's limits alone allow
SETTLE_BAND = 0.1             # `settled_at`: the limit has stayed within 10% of its current value since then


class AutoConcurrency:
    def __init__(self, cap: int, limits: Limits = Limits(), start: int = 8, floor: int = 1,
                 interval_s: float = 2.5, now: float = 0.0, tolerance: float = 1.5):
        self.cap, self.floor, self.interval_s, self.tolerance = cap, max(1, floor), interval_s, tolerance
        self.start = start
        self.limits = limits
        self.limit = min(start, limits.ceiling(cap))
        self.highest = self.limit                  # the highest limit it reached
        self.before = 0                            # the limit before the last change
        self.changed_at = now
        self.slow_start = True
        self.too_many: int | None = None           # the limit the last cut came from: growth stays below it
        self.probe_from: int | None = None         # the held limit while a probe of `too_many` runs
        self.holds = HOLDS
        self.last_retracted: float | None = None
        self._queued = False                       # the last reading showed a waiting queue
        self.changes: collections.deque[tuple[float, int]] = collections.deque([(now, self.limit)], maxlen=512)
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
        self.too_many = self.probe_from = None
        self.holds, self._queued = HOLDS, False
        self._set(min(self.limit, self.start), now, "server restarted")
        self.before = 0                            # no raise to confirm: the new server's first reading will do
        return self.limit

    def begin(self, now: float) -> None:
        """The first request goes now: the clock of `changed_at` and `settled_at` starts here."""
        self.changed_at = now
        self.changes[0] = (now, self.limit)

    @property
    def ceiling(self) -> int:
        return self.limits.ceiling(self.cap)

    @property
    def capped(self) -> bool:
        """`cap` bounds the limit below the server's batch (or the server reports none): as status.py `capped` says
        it."""
        return self.cap < (self.limits.max_running or UNBOUNDED)

    @property
    def ramping(self) -> bool:
        """In slow start below the ceiling: each raise waits only for a reading that shows it."""
        return self.slow_start and self.limit < self.ceiling

    @property
    def settled_at(self) -> float | None:
        """When the limit last entered ±SETTLE_BAND of its current value (None: it never changed)."""
        if len(self.changes) < 2:
            return None
        lo, hi = self.limit * (1 - SETTLE_BAND), self.limit * (1 + SETTLE_BAND)
        entered = self.changes[0][0]
        for (_, before), (t, _) in zip(self.changes, list(self.changes)[1:]):
            if not lo <= before <= hi:
                entered = t
        return entered

    def _set(self, value: int, now: float, reason: str) -> int:
        wanted = max(self.floor, int(value))
        value = max(self.floor, min(self.ceiling, wanted))
        if wanted > value and self.capped:
            reason = "concurrency_cap"                 # the server would take more: the user's cap is why
        if value != self.limit:
            self.before, self.limit, self.changed_at, self.reason = self.limit, value, now, reason
            self.highest = max(self.highest, value)
            self.changes.append((now, value))
        return self.limit

    # -- from the server's gauges ---------------------------------------------------------------------------
    def on_gauges(self, g: Gauges, in_flight: int, now: float) -> int:
        retracted = 0.0
        if g.retracted_total is not None:
            if self.last_retracted is not None and g.retracted_total >= self.last_retracted:
                retracted = g.retracted_total - self.last_retracted
            self.last_retracted = g.retracted_total          # a smaller counter: the server restarted
        queued = self._queued
        self._queued = g.waiting > queue_target(g.running)
        aged = g.at - self.changed_at >= self.interval_s and now - self.changed_at >= self.interval_s
        if retracted > 0 and (aged or self.slow_start):     # ramping, the limit has only risen: it is too high
            # to what the server runs, but at most halved: a retraction has just sent running requests back to its
            # queue, so the running count of that reading can be far below what the pool holds
            return self._cut(max(math.ceil(self.limit * 0.5), min(self.limit * 0.8, g.running)), now, "retractions")
        # ramping up: the server running more than the limit before the raise has seen the raise
        confirmed = self.slow_start and g.at > self.changed_at and g.running > self.before
        if not aged and not (confirmed and self._keeps_up(g, in_flight)):
            return self.limit                                 # the gauges may predate the last change
        if self._queued and queued:
            return self._cut(max(g.running + queue_target(g.running), self.limit * 0.7), now, "server queue")
        if self._keeps_up(g, in_flight):
            return self._grow(now)
        return self.limit

    def _keeps_up(self, g: Gauges, in_flight: int) -> bool:
        return (in_flight >= self.limit * 0.8 and g.running >= min(in_flight, self.limit) * 0.8
                and g.waiting < queue_target(g.running))

    def _cut(self, value: float, now: float, reason: str) -> int:
        self.slow_start = False
        if self.probe_from is not None:               # the probe failed: back to the held limit, hold longer
            value, self.holds = self.probe_from, min(MAX_HOLDS, self.holds * 2)
            reason += " (probe)"
        else:
            self.too_many, self.holds = self.limit, HOLDS
        self.probe_from = None
        return self._set(int(value), now, reason)

    def _grow(self, now: float) -> int:
        if self.slow_start:
            return self._set(self.limit * 2, now, "server keeps up")
        if self.probe_from is not None:               # the probe held an interval: the server takes more now
            self.too_many = self.probe_from = None
            self.holds = HOLDS
        if self.too_many is None:
            return self._set(self.limit + max(1, self.limit // 20), now, "server keeps up")
        if self.limit < self.too_many - 1:            # halfway to one below the cut's limit: quick, then slow
            return self._set(self.limit + max(1, (self.too_many - 1 - self.limit) // 2), now, "server keeps up")
        if now - self.changed_at < self.holds * self.interval_s:
            return self.limit                         # held just below the limit a cut came from
        self.probe_from = self.limit
        return self._set(self.too_many, now, "probe")

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
