"""`concurrency: auto` inside the endpoint worker: a gate on the requests in flight, and the poll that feeds the
controller (capacity.py) the server's limits and gauges, or, where it has no /metrics, each completion's time per
output token.

The worker keeps `concurrency_cap` coroutines; each holds a permit of the gate while it works, so at most `limit`
run. The poll reads the server's limits at start, after each recovery and every minute (a restart may bring a
smaller pool or another data-parallel size: the controller restarts slowly from them), and its gauges every
`interval_s / 10` while the limit ramps up (each raise waits for a reading that shows it) and every
`interval_s / 2` after. While the circuit is not healthy nothing changes: the breaker owns the endpoint then.
Hedged duplicates and prefix affinity change which prompts come, not how many run: the gate counts requests,
whatever they are.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..core.errors import EndpointDown
from ..endpoints.capacity import Gauges, Limits, parse_gauges, read_limits
from .capacity import AutoConcurrency

log = logging.getLogger("regen.dispatch")
LIMITS_EVERY_S = 60.0                      # between readings of the server's limits


class AutoLimit:
    def __init__(self, client: Any, label: str, cap: int, interval_s: float = 2.5, start: int = 8,
                 fallback: int | None = None):
        self.client, self.label = client, label
        # `concurrency` not set: auto on a server that reports its batch, else pinned to `fallback` (8) once its
        # limits are read (before: the controller's start, 8)
        self.fallback = fallback
        self.ctl = AutoConcurrency(cap, Limits(), start=start, interval_s=interval_s, now=time.monotonic())
        self.active = 0
        self._room = asyncio.Event()
        self._room.set()
        self.gauges: Gauges | None = None
        self.has_metrics = True
        self._task: asyncio.Task | None = None
        self._stale_limits = True
        self._t0 = time.monotonic()

    @property
    def limit(self) -> int:
        return self.ctl.limit

    # -- the gate ------------------------------------------------------------------------------------------
    async def acquire(self) -> None:
        while self.active >= self.ctl.limit:
            self._room.clear()
            await self._room.wait()
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        if self.active < self.ctl.limit:
            self._room.set()

    def _changed(self, before: int) -> None:
        if self.ctl.limit != before:
            log.info("endpoint %s: concurrency %d -> %d (%s; server running %s, waiting %s, batch %s)", self.label,
                     before, self.ctl.limit, self.ctl.reason, *self._server())
            self._room.set()

    def _server(self) -> tuple[Any, Any, Any]:
        g = self.gauges
        return (None if g is None else g.running, None if g is None else g.waiting, self.ctl.limits.max_running)

    # -- what feeds the controller ---------------------------------------------------------------------------
    def completed(self, latency_s: float, tokens: int, in_flight: int) -> None:
        if self.has_metrics or tokens <= 0:
            return
        before = self.ctl.limit
        self.ctl.on_completion(latency_s / tokens, in_flight, time.monotonic())
        self._changed(before)

    def recovered(self) -> None:
        """The circuit closed again: the server may have restarted with other limits."""
        self._stale_limits = True

    def start(self, healthy: Callable[[], bool], in_flight: Callable[[], int]) -> None:
        if self._task is None:
            self._t0 = time.monotonic()     # settle times count from the first work, not the actor start
            self.ctl.begin(self._t0)
            self._task = asyncio.create_task(self._poll(healthy, in_flight))

    async def _poll(self, healthy: Callable[[], bool], in_flight: Callable[[], int]) -> None:
        limits_at = time.monotonic()
        first = True
        while True:
            if not first:
                await asyncio.sleep(self.ctl.interval_s / (10 if self.ctl.ramping else 2))
            first = False
            if not healthy():
                continue
            if time.monotonic() - limits_at >= LIMITS_EVERY_S:
                self._stale_limits = True   # a server restarted between two polls keeps its circuit closed
            try:
                if self._stale_limits:
                    limits_at = time.monotonic()
                    before = self.ctl.limit
                    engine = getattr(self.client.engine, "engine", "")
                    limits = await read_limits(self.client, engine if engine in ("sglang", "vllm") else "sglang")
                    if limits is None:
                        continue            # not read (down, a 5xx): asked again, the limits in force kept
                    if self.fallback is not None:
                        if limits.max_running is None:
                            self._pin(self.fallback)
                            return
                        log.info("endpoint %s: concurrency auto (not set, and the server batches up to %d)",
                                 self.label, limits.max_running)
                        self.fallback = None
                    if limits != self.ctl.limits:
                        self.ctl.reset(limits, time.monotonic())
                        self._changed(before)
                    self._stale_limits, self.has_metrics = False, True
                if self.has_metrics:
                    await self._read_gauges(in_flight)
            except EndpointDown:
                continue

    def _pin(self, concurrency: int) -> None:
        """`concurrency` not set on a server that reports no batch: a fixed concurrency, as before auto existed."""
        self.ctl.cap = self.ctl.start = concurrency
        self.ctl.limit, self.ctl.reason = min(concurrency, self.ctl.ceiling), "not set; no batch reported"
        self.has_metrics = True  # nothing feeds the controller any more: latency included
        self._room.set()
        log.info("endpoint %s: concurrency %d (not set, and the server reports no batch limit; `concurrency: auto` "
                 "would drive it from the time per token)", self.label, self.ctl.limit)

    async def _read_gauges(self, in_flight: Callable[[], int]) -> None:
        status, body = await self.client.get_text("/metrics", timeout_s=5.0)
        gauges = parse_gauges(body, time.monotonic()) if status == 200 and isinstance(body, str) else None
        if gauges is None:
            self.has_metrics = False        # no /metrics (SGLang without --enable-metrics): latency decides
            return
        self.gauges = gauges
        before = self.ctl.limit
        self.ctl.on_gauges(gauges, in_flight(), time.monotonic())
        self._changed(before)

    def stats(self) -> dict:
        running, waiting, batch = self._server()
        settled, last = self.ctl.settled_at, self.ctl.changes[-1][0] if len(self.ctl.changes) > 1 else None
        return {"concurrency": self.ctl.limit, "concurrency_reason": self.ctl.reason, "server_running": running,
                "server_waiting": waiting, "server_batch": batch,
                "concurrency_settled_s": None if settled is None else round(settled - self._t0, 1),
                "concurrency_last_change_s": None if last is None else round(last - self._t0, 1),
                "concurrency_changes": len(self.ctl.changes) - 1}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
