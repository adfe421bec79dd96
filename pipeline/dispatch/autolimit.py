"""`concurrency: auto` inside the endpoint worker: a gate on the requests in flight, and the poll that feeds the
controller (capacity.py) the server's limits and gauges, or, where it has no /metrics, each completion's time per
output token.

The worker keeps `concurrency_cap` coroutines; each holds a permit of the gate while it works, so at most `limit`
run. The poll reads the server's limits at start, after each recovery and every minute (a restart may bring a
smaller pool or another data-parallel size: the controller restarts slowly from them); a reading that fails (down,
a 5xx, 408 or 429) is taken again after `interval_s`, then twice as long each time up to a minute, the gauges read
meanwhile. With `concurrency` unset the limits decide first: auto, or pinned to `fallback`. It reads its gauges every
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
from ..endpoints.classify import unexpected
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
        self.cap = cap                      # the user's `concurrency_cap` (a pin lowers the controller's)
        self.ctl = AutoConcurrency(cap, Limits(), start=start, interval_s=interval_s, now=time.monotonic())
        self.active = 0
        self._room = asyncio.Event()
        self._room.set()
        self.gauges: Gauges | None = None
        self.has_metrics = True
        self._task: asyncio.Task | None = None
        self._stale_limits = True
        self._limits_at = time.monotonic()
        self._limits_due, self._limits_retry_s = 0.0, 0.0   # a failed reading is retried with a backoff
        # "auto"; "deciding": `concurrency` not set, the limits not read yet; "pinned": set to `fallback` (a set
        # number is the worker's "fixed", with no AutoLimit)
        self.mode = "deciding" if fallback is not None else "auto"
        self.unset = fallback is not None
        self.poll_error: str | None = None
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
        """The server's running and waiting counts (its gauges are floats from the Prometheus text: counts, shown
        as integers) and its batch."""
        g = self.gauges
        return (None if g is None else round(g.running), None if g is None else round(g.waiting),
                self.ctl.limits.max_running)

    # -- what feeds the controller ---------------------------------------------------------------------------
    def completed(self, latency_s: float, tokens: int, in_flight: int) -> None:
        if self.has_metrics or tokens <= 0:
            return
        before = self.ctl.limit
        self.ctl.on_completion(latency_s / tokens, in_flight, time.monotonic())
        self._changed(before)

    def recovered(self) -> None:
        """The circuit closed again: the server may have restarted with other limits."""
        self._stale_limits, self._limits_due = True, 0.0

    def start(self, healthy: Callable[[], bool], in_flight: Callable[[], int]) -> None:
        if self._task is None:
            self._t0 = self._limits_at = time.monotonic()  # settle times count from the first work
            self.ctl.begin(self._t0)
            self._task = asyncio.create_task(self._poll(healthy, in_flight))

    async def _poll(self, healthy: Callable[[], bool], in_flight: Callable[[], int]) -> None:
        first = True
        while True:
            if not first:
                await asyncio.sleep(self.ctl.interval_s / (10 if self.ctl.ramping else 2))
            first = False
            if not healthy():
                continue
            try:
                if not await self._step(in_flight):
                    return                  # pinned: nothing feeds the controller any more
            except EndpointDown:
                continue
            except Exception as exc:        # noqa: BLE001 - one odd reading must not end the poll unseen
                self._poll_failed(exc)

    async def _step(self, in_flight: Callable[[], int]) -> bool:
        """One poll: the server's limits when due, then its gauges. False once the concurrency is pinned."""
        now = time.monotonic()
        if now - self._limits_at >= LIMITS_EVERY_S:
            self._stale_limits = True       # a server restarted between two polls keeps its circuit closed
        if self._stale_limits and now >= self._limits_due:
            self._limits_at = now
            engine = getattr(self.client.engine, "engine", "")
            limits = await read_limits(self.client, engine if engine in ("sglang", "vllm") else "sglang")
            if limits is None:              # not read (down, a 5xx, 408, 429): asked again later, limits kept
                self._limits_retry_s = min(LIMITS_EVERY_S, max(self.ctl.interval_s, 2 * self._limits_retry_s))
                self._limits_due = time.monotonic() + self._limits_retry_s
            elif not self._apply(limits):
                return False
        # an unset concurrency holds its start until the limits decide auto or 8
        if self.has_metrics and self.mode == "auto":
            await self._read_gauges(in_flight)
        return True

    def _apply(self, limits: Limits) -> bool:
        """A reading of the server's limits. False: an unset concurrency pinned (the server reports no batch)."""
        self._limits_retry_s, self._limits_due = 0.0, 0.0
        if self.mode == "deciding":
            if limits.max_running is None:
                self._pin(self.fallback or self.ctl.start)
                return False
            self.mode = "auto"
            self.fallback = None
        if limits != self.ctl.limits:
            before = self.ctl.limit
            self.ctl.reset(limits, time.monotonic())
            self._changed(before)
        self._stale_limits, self.has_metrics = False, True
        return True

    def _poll_failed(self, exc: Exception) -> None:
        """An exception outside the taxonomy: in the stats (the driver logs it) and the actor's log, once each."""
        error = unexpected(exc, self.label).message
        if error != self.poll_error:
            log.warning("endpoint %s: concurrency poll failed: %s", self.label, error, exc_info=exc)
        self.poll_error = error
        self._limits_retry_s = min(LIMITS_EVERY_S, max(self.ctl.interval_s, 2 * self._limits_retry_s))
        self._limits_due = time.monotonic() + self._limits_retry_s

    def _pin(self, concurrency: int) -> None:
        """`concurrency` not set on a server that reports no batch: a fixed concurrency, as before auto existed,
        never more than the workers `concurrency_cap` keeps."""
        concurrency = min(concurrency, self.ctl.cap)
        self.ctl.cap = self.ctl.start = concurrency
        self.ctl.limit, self.ctl.reason = min(concurrency, self.ctl.ceiling), "not set; no batch reported"
        self.mode = "pinned"
        self.has_metrics = True  # nothing feeds the controller any more: latency included
        self._room.set()

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
        return {"concurrency": self.ctl.limit, "concurrency_reason": self.ctl.reason,
                "concurrency_mode": self.mode, "concurrency_unset": self.unset,
                "concurrency_cap": self.cap, "concurrency_highest": self.ctl.highest,
                "concurrency_poll_error": self.poll_error, "server_running": running,
                "server_waiting": waiting, "server_batch": batch,
                "concurrency_settled_s": None if settled is None else round(settled - self._t0, 1),
                "concurrency_last_change_s": None if last is None else round(last - self._t0, 1),
                "concurrency_changes": len(self.ctl.changes) - 1}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
