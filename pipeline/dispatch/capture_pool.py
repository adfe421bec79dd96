"""Ray actors for `regen capture`: a fixed pool, one call outstanding per actor, each call a batch of prompts.

An actor that dies has its batch put back at the head of the queue and is replaced (its hidden part, if it had
committed one, is unreferenced: removed on the next start). A batch whose route raises is retried prompt by
prompt, once: only the prompt that fails alone is counted as failed for this session (named, with the route's
reason) and tried again on the next one. The actors live until `close()`, across the calls of a `follow` capture.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Callable

import ray

from ..core.errors import ConfigError, DriftError
from .capture_worker import CaptureWorker, Sample

log = logging.getLogger("regen")

Rows = list[list[dict[str, Any]]]
MAX_ACTOR_LOSSES = 5  # in a row without an answer: the route cannot start (model too big, server gone)


class CapturePool:
    def __init__(self, cfg, capture_uri: str, fingerprint: str, on_rows: Callable[[Rows], None],
                 on_tick: Callable[[], None], should_stop: Callable[[], bool], expected: dict | None = None):
        self.cfg, self.capture_uri, self.fingerprint = cfg, capture_uri, fingerprint
        self.expected = expected  # capture.json: each actor checks its route's layout and model against it
        self.on_rows, self.on_tick, self.should_stop = on_rows, on_tick, should_stop
        self.remote = ray.remote(CaptureWorker)
        self.generation = 0
        # this driver's session: names the route's server-side files, so a later session can tell its own apart
        self.session = f"{os.getpid()}t{time.time_ns() // 1_000_000:x}"
        self.failed_prompts: list[str] = []
        self.actor_restarts = 0
        self.actors: list[Any] = []

    def _actor(self, slot: int):
        self.generation += 1
        tag = f"cap{os.getpid()}s{slot}g{self.generation}"
        return self.remote.options(num_cpus=self.cfg.actor_num_cpus, num_gpus=self.cfg.actor_num_gpus,
                                   max_restarts=0, max_concurrency=1).remote(
            self.cfg, self.capture_uri, tag, self.fingerprint, self.session, self.expected)

    def run(self, batches: list[list[list[Sample]]]) -> list[str]:
        """Capture the batches on the pool's actors (started on first use, kept for the next call: a `follow`
        capture loads the model once). Returns the prompts that failed in this call."""
        queue = deque(batches)
        failed: list[str] = []
        while len(self.actors) < min(self.cfg.actors, max(1, len(batches))):
            self.actors.append(self._actor(len(self.actors)))
        actors = self.actors
        idle = list(range(len(actors)))
        inflight: dict[Any, tuple[int, list[list[Sample]]]] = {}
        losses = 0
        while (queue or inflight) and not self.should_stop():
            while idle and queue:
                slot = idle.pop()
                batch = queue.popleft()
                inflight[actors[slot].capture.remote(batch)] = (slot, batch)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                slot, batch = inflight.pop(ref)
                try:
                    self.on_rows(ray.get(ref))
                    losses = 0
                    idle.append(slot)
                except ray.exceptions.ActorDiedError:
                    losses += 1
                    if losses > MAX_ACTOR_LOSSES:
                        raise
                    log.warning("capture actor %d died; its %d prompts go back to the queue", slot, len(batch))
                    queue.appendleft(batch)
                    actors[slot] = self._actor(slot)
                    self.actor_restarts += 1
                    idle.append(slot)
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, (ImportError, MemoryError, ConfigError, DriftError)):
                        raise exc.cause from None  # the route cannot work at all: stop the capture
                    idle.append(slot)
                    if len(batch) > 1:  # one bad prompt must not fail the others: each once, alone
                        log.warning("a batch of %d prompts failed (%s); capturing them one by one", len(batch),
                                    exc.cause)
                        queue.extendleft(reversed([[samples] for samples in batch]))
                        continue
                    log.error("capture of prompt %s failed: %s", batch[0][0].prompt_id, exc.cause)
                    failed.append(batch[0][0].prompt_id)
            self.on_tick()
        self.failed_prompts += failed
        return failed

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
