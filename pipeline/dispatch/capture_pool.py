"""Ray actors for `regen capture`: a fixed pool, one call outstanding per actor, each call a batch of prompts.

What the pool does with a batch that did not come back, by the class of the error (core/errors.py):
- ContractError / EndpointFatal (the route or its server can never do this capture), ConfigError, DriftError, a
  StorageError or other RunFatal (a full disk): the pass stops at once (CaptureStopped or the error itself), nothing
  is failed as a prompt, a rerun resumes.
- EndpointDown (no answer at all: refused, reset before an answer): the batch goes back to the front of the queue
  and its actor waits (backoff); when the route has answered nothing for `down_deadline_s` the pass stops
  (resumable).
- Any other Retryable (a timeout, a lock held, a dropped connection, an Unexpected answer): it may be one prompt's
  doing, so the batch is split and its prompts requeued behind the other pending work; a prompt that gets one
  running alone `max_prompt_retries` times fails, named, with the last error.
- Anything else (TerminalForPrompt, CaptureSampleError, an unexpected exception): the batch is retried prompt by
  prompt, once: only the prompt that fails alone is failed for this session (named, with the reason) and tried again
  on the next one. `max_consecutive_failures` prompts failing alone in a row, none captured between, stop the pass.
- The actor died (an OOM kill, a segfault): as generation's isolation (dispatch/isolation.py), a death is charged
  only to a prompt that ran alone. Its batch's prompts run again alone, each on a new actor; a prompt whose actor
  dies `max_solo_crashes` times running it alone fails, named. MAX_ACTOR_LOSSES deaths in a row with nothing
  captured between stop the pass (the route cannot start: the model too big for the node?).
The actors live until `close()`, across the calls of a `follow` capture.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from typing import Any, Callable

import ray

from ..core.errors import (CaptureStopped, ConfigError, ConnectionDropped, DriftError, EndpointDown, EndpointFatal,
                           Retryable, RunFatal)
from .capture_worker import CaptureWorker, Sample, request_owner_key

log = logging.getLogger("regen")

Rows = list[list[dict[str, Any]]]
MAX_ACTOR_LOSSES = 5  # actor deaths in a row without an answer: the route cannot start (model too big, node gone)
BACKOFF_S = (0.5, 10.0)  # first and longest wait of an actor whose route's server is down


def is_down(cause: Retryable) -> bool:
    """No answer at all: the server, not a prompt. A connection dropped mid-request may be the prompt's doing."""
    return isinstance(cause, EndpointDown) and not isinstance(cause, ConnectionDropped)


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
        self.owner_key = request_owner_key(capture_uri, expected)  # this host's: the actors' nodes may differ
        self.failed_prompts: list[str] = []
        self.actor_restarts = 0
        self.actors: list[Any] = []
        self.solo_deaths: Counter[str] = Counter()
        self.solo_retries: Counter[str] = Counter()  # Retryable (not EndpointDown) a prompt got running alone

    @property
    def route_name(self) -> str:
        url = getattr(self.cfg.vllm, "url", None) if self.cfg.route == "vllm" else None
        return f"route {self.cfg.route}" + (f" (server {url})" if url else f" (model {self.cfg.model})")

    def _actor(self, slot: int):
        self.generation += 1
        tag = f"cap{os.getpid()}s{slot}g{self.generation}"
        return self.remote.options(num_cpus=self.cfg.actor_num_cpus, num_gpus=self.cfg.actor_num_gpus,
                                   max_restarts=0, max_concurrency=1).remote(
            self.cfg, self.capture_uri, tag, self.fingerprint, self.session, self.expected, self.owner_key)

    def run(self, batches: list[list[list[Sample]]]) -> list[str]:
        """Capture the batches on the pool's actors (started on first use, kept for the next call: a `follow`
        capture loads the model once). Returns the prompts that failed in this call."""
        failed: list[str] = []
        try:
            self._run(deque(batches), failed)
        finally:
            self.failed_prompts += failed
        return failed

    def _run(self, queue: deque, failed: list[str]) -> None:
        cfg = self.cfg
        while len(self.actors) < min(cfg.actors, max(1, len(queue))):
            self.actors.append(self._actor(len(self.actors)))
        actors = self.actors
        idle = list(range(len(actors)))
        resting: dict[int, float] = {}  # slot -> monotonic time it may take work again (its server was down)
        inflight: dict[Any, tuple[int, list[list[Sample]]]] = {}
        losses = failures_in_row = down_retries = 0
        down_since: float | None = None

        def fail_alone(prompt_id: str, reason: str) -> None:
            nonlocal failures_in_row
            log.error("capture of prompt %s failed: %s", prompt_id, reason)
            failed.append(prompt_id)
            failures_in_row += 1
            if failures_in_row >= cfg.max_consecutive_failures:
                raise CaptureStopped(f"{self.route_name}: {failures_in_row} prompts failed in a row, none captured "
                                     f"between (last: prompt {prompt_id}: {reason}); the route looks broken. The "
                                     "capture is resumable: fix the route and rerun")

        while (queue or inflight) and not self.should_stop():
            now = time.monotonic()
            for slot in [s for s in idle if resting.get(s, 0.0) <= now]:
                if not queue:
                    break
                idle.remove(slot)
                resting.pop(slot, None)
                batch = queue.popleft()
                inflight[actors[slot].capture.remote(batch)] = (slot, batch)
            if not inflight:
                time.sleep(min(0.2, max(0.0, min(resting.values(), default=now) - now)))
                self.on_tick()
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                slot, batch = inflight.pop(ref)
                try:
                    self.on_rows(ray.get(ref))
                    losses = failures_in_row = down_retries = 0
                    down_since = None
                    idle.append(slot)
                except ray.exceptions.RayActorError as exc:
                    losses += 1
                    actors[slot] = self._actor(slot)
                    self.actor_restarts += 1
                    idle.append(slot)
                    if losses > MAX_ACTOR_LOSSES:
                        raise CaptureStopped(f"{self.route_name}: the capture actor died {losses} times in a row "
                                             "with nothing captured between: the route cannot start or run here (a "
                                             "model too big for the node's memory?); the capture is resumable. "
                                             f"Last: {type(exc).__name__}") from None
                    if len(batch) > 1:  # the crash is charged to nobody: each prompt again, alone
                        log.warning("capture actor %d died on a batch of %d prompts; each runs again alone", slot,
                                    len(batch))
                        queue.extendleft(reversed([[samples] for samples in batch]))
                        continue
                    prompt_id = batch[0][0].prompt_id
                    self.solo_deaths[prompt_id] += 1
                    if self.solo_deaths[prompt_id] >= cfg.max_solo_crashes:
                        fail_alone(prompt_id, f"the capture actor died {self.solo_deaths[prompt_id]} times running "
                                              "it alone (an OOM kill or a crash in the route)")
                    else:
                        log.warning("capture actor %d died running prompt %s alone; it runs once more", slot,
                                    prompt_id)
                        queue.appendleft(batch)
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause
                    idle.append(slot)
                    if isinstance(cause, EndpointFatal):
                        raise CaptureStopped(f"{self.route_name} cannot do this capture: {cause}. Nothing was "
                                             "failed as a prompt; fix the server or the capture config and rerun "
                                             "to resume") from None
                    if isinstance(cause, (ImportError, MemoryError, ConfigError, DriftError, RunFatal)):
                        raise cause from None  # the route (or the disk) cannot work at all: stop, resumable
                    if isinstance(cause, Retryable) and not is_down(cause):
                        if len(batch) > 1:
                            log.warning("a batch of %d prompts got %s: %s; each runs again alone, after the other "
                                        "pending work", len(batch), type(cause).__name__, cause)
                            queue.extend([samples] for samples in batch)
                            continue
                        prompt_id = batch[0][0].prompt_id
                        self.solo_retries[prompt_id] += 1
                        tries = self.solo_retries[prompt_id]
                        if tries >= cfg.max_prompt_retries:
                            fail_alone(prompt_id, f"{type(cause).__name__} {tries} times running alone "
                                                  f"(max_prompt_retries {cfg.max_prompt_retries}); last: {cause}")
                            continue
                        log.warning("prompt %s got %s running alone (%d of %d): %s; it runs again after the other "
                                    "pending work", prompt_id, type(cause).__name__, tries, cfg.max_prompt_retries,
                                    cause)
                        resting[slot] = time.monotonic() + min(BACKOFF_S[0] * 2 ** (tries - 1), BACKOFF_S[1])
                        queue.append(batch)
                        continue
                    if isinstance(cause, Retryable):
                        down_since = down_since if down_since is not None else time.monotonic()
                        down_for = time.monotonic() - down_since
                        if down_for > cfg.down_deadline_s:
                            raise CaptureStopped(f"{self.route_name}: its server has not answered for "
                                                 f"{down_for:.0f} s (down_deadline_s {cfg.down_deadline_s:g}; "
                                                 f"last: {cause}); the capture is resumable: rerun when it is "
                                                 "back") from None
                        wait = min(BACKOFF_S[0] * 2 ** down_retries, BACKOFF_S[1])
                        down_retries += 1
                        log.warning("%s did not answer (%s); retrying in %.1f s", self.route_name, cause, wait)
                        resting[slot] = time.monotonic() + wait
                        queue.appendleft(batch)
                        continue
                    if len(batch) > 1:  # one bad prompt must not fail the others: each once, alone
                        log.warning("a batch of %d prompts failed (%s); capturing them one by one", len(batch), cause)
                        queue.extendleft(reversed([[samples] for samples in batch]))
                        continue
                    fail_alone(batch[0][0].prompt_id, str(cause))
            self.on_tick()

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
