"""The throughput curve (`--throughput-curve`): one continuous batch with a decode step that grows with the batch,
admission bounded by a KV pool in tokens, and retraction when the pool is full, as SGLang's scheduler does.

The shape and its sources:
- **Decode step time** `step(B) = step_s * max(1, B / knee)`: the roofline of a decode step. While the batch is
  small, a step costs one read of the weights (memory-bound: the same time for 1 or `knee` requests); past the knee
  the matrix products of B tokens dominate (compute-bound: time grows linearly with B). So the throughput, B /
  step(B), rises linearly to `knee / step_s` tokens/s and then stays flat, the curve SGLang's and vLLM's published
  serving benchmarks show (output tok/s against max concurrency: near-linear, then a plateau).
- **Admission** (SGLang `PrefillAdder`): a waiting request enters the batch while the running count is below
  `max_running_requests` and the pool holds its prompt plus the reserve of every running request's remaining
  tokens, `min(max_new - generated, 4096) * new_token_ratio` (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096). The
  ratio starts at 0.7 (SGLANG_INIT_NEW_TOKEN_RATIO), decays to 0.7 * 0.14 over 600 steps
  (SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS), and after a retraction is set to
  `(decoded + 20 * running) / sum(max_new)` (NewTokenRatioTracker.estimate_new_token_ratio_after_retract).
- **Retraction** (ScheduleBatch.retract_decode): when the pool cannot hold the batch's next step
  (check_decode_mem), requests leave the batch until it holds 20 steps (SGLANG_RETRACT_DECODE_STEPS), fewest output tokens first (longest prompt among
  equals: `_get_decode_retraction_order`), always keeping one, and go back to the front of the waiting queue; re-
  admitted, they prefill their prompt and what they had generated again. Each one counts in
  `sglang:num_retracted_requests_total`. Past the pool, throughput therefore falls: prefill redone, steps lost.
- **Gauges** (`num_running_reqs`, `num_queue_reqs`, `token_usage`) are snapshots taken every
  `decode_log_interval` steps (SGLang's default: 40), so they lag as SGLang's do, and, as SGLang's
  (`log_decode_stats` after a decode batch, whose iteration admitted what fit first), after the admissions.

Cost: the batch advances a virtual step counter V at 1/step(B) per second; a request finishes when V passes its
mark, and the pool's use is linear in V between events, so the one scheduler task wakes only at a finish, a full
pool or an arrival: O(log n) per request, no per-step work.
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import time
from dataclasses import dataclass, field

CLIP_MAX_NEW = 4096
INIT_RATIO, MIN_RATIO_FACTOR, DECAY_STEPS, RETRACT_STEPS = 0.7, 0.14, 600, 20


class QueueFull(Exception):
    """Admission refused: SGLang's 503 message."""


@dataclass(eq=False)
class BatchRequest:
    prompt: int                    # prompt tokens (in the pool while it runs)
    uncached: int                  # prompt tokens to prefill on its first admission
    need: int                      # output tokens it will generate
    max_new: int                   # what the request allows (the reserve's estimate)
    done: int = 0                  # tokens generated before its current admission (retractions)
    v0: float = 0.0                # V at its current admission
    seq: int = 0
    retracted: int = 0
    running: bool = False
    fut: asyncio.Future | None = field(default=None, repr=False)

    def mark(self) -> float:
        return self.v0 + self.need - self.done


def step_time(step_s: float, knee: int, batch: int) -> float:
    """Seconds of one decode step of `batch` requests (module docstring)."""
    return step_s * max(1.0, batch / max(1, knee))


class Batch:
    def __init__(self, step_s: float, knee: int, pool_tokens: int, max_running: int, max_queue: int = -1,
                 prefill_tok_s: float = 0.0, log_interval: int = 40):
        self.step_s, self.knee, self.pool, self.max_running = step_s, knee, pool_tokens, max_running
        self.max_queue, self.prefill_tok_s, self.log_interval = max_queue, prefill_tok_s, max(1, log_interval)
        self.ratio = INIT_RATIO
        self.min_ratio = INIT_RATIO * MIN_RATIO_FACTOR
        self.decay = (INIT_RATIO - self.min_ratio) / DECAY_STEPS
        self.running: dict[BatchRequest, None] = {}
        self.waiting: collections.deque[BatchRequest] = collections.deque()
        self.heap: list[tuple[float, int, BatchRequest]] = []
        self.v = 0.0
        self.base = 0                  # sum(prompt + done - v0) over running: used(V) = base + B * V
        self.t = time.monotonic()
        self.stall_until = self.t      # prefill pauses decoding (no V progress) until then
        self.retractions = 0
        self.steps = 0.0
        self._seq = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.gauges = (0, 0, 0.0)      # (running, waiting, token_usage) as of the last log interval
        self._logged_at = 0.0

    # -- the pool --------------------------------------------------------------------------------------
    def used(self) -> float:
        return self.base + len(self.running) * self.v

    def _reserve(self) -> float:
        r = self.ratio
        return sum(min(q.max_new - q.done - (self.v - q.v0), CLIP_MAX_NEW) * r for q in self.running)

    def _fits(self, q: BatchRequest) -> bool:
        if len(self.running) >= self.max_running:
            return False
        if not self.running:
            return True                # SGLang always admits into an empty batch (a too-long prompt is refused earlier)
        need = q.prompt + q.done + min(q.max_new - q.done, CLIP_MAX_NEW) * self.ratio
        return self.used() + self._reserve() + need <= self.pool

    # -- the clock -------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        start = max(self.t, self.stall_until)
        if now > start and self.running:
            dv = (now - start) / step_time(self.step_s, self.knee, len(self.running))
            self.v += dv
            self.steps += dv
            self.ratio = max(self.min_ratio, self.ratio - self.decay * dv)
        self.t = now

    def _snapshot(self) -> None:
        """Every `log_interval` steps, after the iteration's admissions (SGLang logs its decode stats once a
        decode batch has run, so arrivals it could admit are never counted as waiting)."""
        if self.steps - self._logged_at < self.log_interval:
            return
        self._logged_at = self.steps
        self.gauges = (len(self.running), len(self.waiting), min(1.0, self.used() / max(1, self.pool)))

    def _next_event(self) -> float | None:
        """Monotonic time of the next finish or full pool (None: nothing runs)."""
        b = len(self.running)
        if not b:
            return None
        target = self.heap[0][0] if self.heap else float("inf")
        full = (self.pool - b - self.base) / b            # the next step no longer fits
        if b > 1:
            target = min(target, max(self.v, full))
        return max(self.t, self.stall_until) + max(0.0, target - self.v) * step_time(self.step_s, self.knee, b)

    # -- admission, finish, retraction ----------------------------------------------------------------
    def _admit(self, q: BatchRequest) -> None:
        prefill = q.prompt + q.done if q.retracted else q.uncached
        if self.prefill_tok_s > 0 and prefill > 0:
            self.stall_until = max(self.t, self.stall_until) + prefill / self.prefill_tok_s
        self._seq += 1
        q.v0, q.running, q.seq = self.v, True, self._seq
        self.running[q] = None
        self.base += q.prompt + q.done - q.v0   # its pool share: prompt + done + (V - v0)
        heapq.heappush(self.heap, (q.mark(), q.seq, q))

    def _leave(self, q: BatchRequest) -> None:
        del self.running[q]
        q.running = False
        self.base -= q.prompt + q.done - q.v0

    def _finish_due(self) -> None:
        while self.heap and self.heap[0][0] <= self.v + 1e-9:
            _, seq, q = heapq.heappop(self.heap)
            if not q.running or q.seq != seq:
                continue
            self._leave(q)
            if q.fut is not None and not q.fut.done():
                q.fut.set_result(None)

    def _retract(self) -> None:
        b = len(self.running)
        if b <= 1 or self.used() + b <= self.pool:        # check_decode_mem: the next step fits
            return
        order = sorted(self.running, key=lambda q: (q.done + self.v - q.v0, -q.prompt), reverse=True)
        out = []
        while len(order) > 1 and self.used() + RETRACT_STEPS * len(self.running) > self.pool:
            q = order.pop()
            self._leave(q)
            q.done += int(self.v - q.v0)
            q.retracted += 1
            out.append(q)
        self.retractions += len(out)
        self.waiting.extendleft(reversed(out))
        decoded = sum(q.done + self.v - q.v0 for q in self.running)
        total_max = sum(q.max_new for q in self.running)
        self.ratio = min(1.0, (decoded + RETRACT_STEPS * len(self.running)) / (total_max + 1))

    def _fill(self) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            self._admit(self.waiting.popleft())

    # -- the scheduler task ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._advance(time.monotonic())
            self._finish_due()
            self._retract()
            self._fill()
            self._snapshot()
            due = self._next_event()
            self._wake.clear()
            timeout = None if due is None else max(0.0, due - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def run(self, prompt: int, uncached: int, need: int, max_new: int, queue_timeout: float | None) -> int:
        """Wait in the queue, run in the batch, return when the last token is generated: the retractions it had."""
        if self.max_queue >= 0 and len(self.waiting) >= self.max_queue:
            raise QueueFull("The request queue is full.")
        q = BatchRequest(prompt, uncached, max(1, need), max(max_new, need))
        q.fut = asyncio.get_running_loop().create_future()
        self.waiting.append(q)
        self._kick()
        try:
            if queue_timeout:
                await self._queued(q, queue_timeout)
            await q.fut
        finally:
            self._drop(q)
        return q.retracted

    async def _queued(self, q: BatchRequest, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not q.running and not q.fut.done():
            left = end - time.monotonic()
            if left <= 0:
                raise QueueFull("Request waiting timeout reached.")
            try:
                await asyncio.wait_for(asyncio.shield(q.fut), min(left, 0.05))
            except TimeoutError:
                pass

    def _drop(self, q: BatchRequest) -> None:
        """A request that leaves early (cancelled, timed out): out of the queue or the batch."""
        if q.running:
            self._advance(time.monotonic())
            self._leave(q)
            self._kick()
        else:
            try:
                self.waiting.remove(q)
            except ValueError:
                pass

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
