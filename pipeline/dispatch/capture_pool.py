"""Ray actors for `regen capture`: a fixed pool, one call outstanding per actor, each call a batch of prompts.

An actor that dies has its batch put back at the head of the queue and is replaced (its hidden part, if it had
committed one, is unreferenced: removed on the next start). A batch whose route raises fails once: its
prompts are counted as failed for this session and captured again on the next one.
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

    def _actor(self, slot: int):
        self.generation += 1
        tag = f"cap{os.getpid()}s{slot}g{self.generation}"
        return self.remote.options(num_cpus=self.cfg.actor_num_cpus, num_gpus=self.cfg.actor_num_gpus,
                                   max_restarts=0, max_concurrency=1).remote(
            self.cfg, self.capture_uri, tag, self.fingerprint, self.session, self.expected)

    def run(self, batches: list[list[list[Sample]]]) -> None:
        queue = deque(batches)
        actors = [self._actor(i) for i in range(min(self.cfg.actors, max(1, len(batches))))]
        idle = list(range(len(actors)))
        inflight: dict[Any, tuple[int, list[list[Sample]]]] = {}
        losses = 0
        try:
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
                        ids = [samples[0].prompt_id for samples in batch]
                        log.error("capture of prompts %s failed: %s", ", ".join(ids[:5]), exc.cause)
                        self.failed_prompts += ids
                        idle.append(slot)
                self.on_tick()
        finally:
            for actor in actors:
                ray.kill(actor)
