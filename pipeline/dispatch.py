"""Ray dispatch: one async actor per endpoint, fed by the driver in batches.

The driver keeps exactly one `exchange` call outstanding per actor. Each answer brings finished
outcomes and the actor's demand (free slots plus a small prefetch), and the next call carries that
many new prompts. A slow endpoint asks for less, so it simply takes less. Work held by an actor that
dies or whose circuit opens goes back to the queue; the committer drops late duplicates.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray.exceptions import RayActorError

from .config import RunConfig
from .endpoints import ClientSettings
from .errors import RunFatal
from .work import DONE, RETRY, TERMINAL, Exchange, Outcome, WorkItem
from .worker import EndpointWorker

log = logging.getLogger("regen.dispatch")


def client_settings(cfg: RunConfig, weight_version: str | None = None) -> ClientSettings:
    return ClientSettings(
        model=cfg.model,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
        chat_template_kwargs=cfg.template_kwargs(),
        timeout_s=cfg.request_timeout(),
        return_token_ids=cfg.return_token_ids,
        stream=cfg.stream,
        stall_timeout_s=cfg.stall_timeout_s,
        expected_weight_version=weight_version,
    )


@dataclass
class Slot:
    """The driver's view of one endpoint actor."""

    label: str
    handle: ray.actor.ActorHandle
    assigned: dict[str, WorkItem] = field(default_factory=dict)
    state: str = "healthy"
    stats: dict = field(default_factory=dict)
    open_since: float | None = None


class Dispatcher:
    """Feeds work items to endpoint actors until every one has a final outcome (or a stop is asked)."""

    def __init__(
        self,
        cfg: RunConfig,
        items: list[WorkItem],
        on_outcome: Callable[[Outcome, int], None],
        on_tick: Callable[[dict[str, dict]], None],
        should_stop: Callable[[], bool],
        actor_factory: Callable[[str], ray.actor.ActorHandle],
    ):
        self.cfg = cfg
        self.queue: deque[WorkItem] = deque(items)
        self.attempts: dict[str, int] = {}
        self.avoid: dict[str, str] = {}  # prompt_id -> the endpoint it last failed at
        self.unfinished = {item.prompt_id for item in items}
        self.on_outcome, self.on_tick, self.should_stop = on_outcome, on_tick, should_stop
        self.actor_factory = actor_factory
        self.slots = {e.label: Slot(e.label, actor_factory(e.label)) for e in cfg.all_endpoints()}
        self.calls: dict[ray.ObjectRef, str] = {}
        self.actor_restarts = 0
        self.requeued = 0

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        for slot in self.slots.values():
            self._call(slot, self._take(slot, slot_demand=2 * self._concurrency(slot.label)))
        while self.unfinished and not self.should_stop():
            refs = list(self.calls)
            ready, rest = ray.wait(refs, num_returns=1, timeout=0.2)
            if ready and rest:  # take every other answer already there too
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            for ref in ready:
                slot = self.slots[self.calls.pop(ref)]
                try:
                    exchange: Exchange = ray.get(ref)
                except RayActorError as exc:
                    self._actor_lost(slot, exc)
                    continue
                self._absorb(slot, exchange)
                if slot.label in self.slots:
                    self._call(slot, self._take(slot, exchange.demand))
            self._check_fleet()
            self.on_tick({label: {**s.stats, "state": s.state} for label, s in self.slots.items()})

    def shutdown(self) -> None:
        """End the actors. Work they still hold was never committed and stays pending."""
        for slot in self.slots.values():
            ray.kill(slot.handle)

    def _concurrency(self, label: str) -> int:
        return next(e.concurrency for e in self.cfg.all_endpoints() if e.label == label)

    def _call(self, slot: Slot, work: list[WorkItem]) -> None:
        for item in work:
            slot.assigned[item.prompt_id] = item
        self.calls[slot.handle.exchange.remote(work, 0.5)] = slot.label

    def _take(self, slot: Slot, slot_demand: int) -> list[WorkItem]:
        """Up to `slot_demand` items. Work that just failed at this endpoint goes to another one if any
        other is healthy (the skipped items keep their place at the head of the queue)."""
        batch: list[WorkItem] = []
        skipped: list[WorkItem] = []
        elsewhere = any(s.state == "healthy" for s in self.slots.values() if s is not slot)
        budget = 4 * slot_demand + 16  # bounded scan: never walk the whole queue
        while self.queue and len(batch) < slot_demand and budget > 0:
            budget -= 1
            item = self.queue.popleft()
            if item.prompt_id not in self.unfinished:
                continue
            if elsewhere and self.avoid.get(item.prompt_id) == slot.label:
                skipped.append(item)
            else:
                batch.append(item)
        self.queue.extendleft(reversed(skipped))
        return batch

    # --- outcomes -----------------------------------------------------------------------------------
    def _absorb(self, slot: Slot, exchange: Exchange) -> None:
        slot.state, slot.stats = exchange.state, exchange.stats
        slot.open_since = (slot.open_since or time.monotonic()) if exchange.state in ("open", "fatal") else None
        for outcome in exchange.outcomes:
            item = slot.assigned.pop(outcome.prompt_id, None)
            if outcome.prompt_id not in self.unfinished:
                continue  # a late answer for work already finished elsewhere
            attempts = self.attempts.get(outcome.prompt_id, 0) + outcome.attempts
            self.attempts[outcome.prompt_id] = attempts
            if outcome.kind in (DONE, TERMINAL):
                self._finish(outcome, attempts)
            elif outcome.kind == RETRY and attempts >= self.cfg.max_attempts:
                outcome.kind, outcome.message = TERMINAL, f"attempts exhausted ({attempts}): {outcome.message}"
                self._finish(outcome, attempts)
            elif item is not None:  # RETRY, RETURNED, ENDPOINT_FATAL: another endpoint will take it
                self.avoid[outcome.prompt_id] = slot.label
                self._requeue(item)
        if exchange.state == "fatal":
            self._retire(slot, str(exchange.stats.get("last_error", "endpoint-fatal error")))

    def _finish(self, outcome: Outcome, attempts: int) -> None:
        self.unfinished.discard(outcome.prompt_id)
        self.avoid.pop(outcome.prompt_id, None)
        self.on_outcome(outcome, attempts)

    def _requeue(self, item: WorkItem) -> None:
        self.requeued += 1
        self.queue.appendleft(item)

    def _return_assigned(self, slot: Slot) -> None:
        for item in slot.assigned.values():
            if item.prompt_id in self.unfinished:
                self._requeue(item)
        slot.assigned.clear()

    # --- fleet health -------------------------------------------------------------------------------
    def _actor_lost(self, slot: Slot, exc: Exception) -> None:
        """A dead actor's in-flight work is requeued and a fresh actor takes its place."""
        log.warning("actor for %s died (%s); requeueing %d prompts", slot.label, type(exc).__name__, len(slot.assigned))
        self._return_assigned(slot)
        self.actor_restarts += 1
        slot.handle = self.actor_factory(slot.label)
        self._call(slot, [])

    def _retire(self, slot: Slot, why: str) -> None:
        log.error("endpoint %s leaves the fleet: %s", slot.label, why)
        self._return_assigned(slot)
        for ref, label in list(self.calls.items()):
            if label == slot.label:
                del self.calls[ref]
        del self.slots[slot.label]
        ray.kill(slot.handle)

    def _check_fleet(self) -> None:
        if not self.slots:
            raise RunFatal("every endpoint left the fleet (endpoint-fatal errors); see the log above")
        opened = [s.open_since for s in self.slots.values()]
        if all(t is not None for t in opened):
            down_for = time.monotonic() - max(opened)
            if down_for > self.cfg.dead_fleet_deadline_s:
                raise RunFatal(
                    f"no healthy endpoint for {down_for:.0f}s (dead_fleet_deadline_s="
                    f"{self.cfg.dead_fleet_deadline_s:.0f}); the run is resumable once endpoints are back"
                )


ACTOR_NAMESPACE = "regen"


def make_actor_factory(cfg: RunConfig, settings: ClientSettings, api_keys: dict[str, str | None]):
    remote_worker = ray.remote(EndpointWorker)
    endpoints = {e.label: e for e in cfg.all_endpoints()}
    generation = itertools.count()

    def factory(label: str) -> ray.actor.ActorHandle:
        e = endpoints[label]
        # Named, so an operator (or a test) can find the actor of an endpoint in the cluster.
        name = f"{cfg.run_name}:{os.getpid()}:{label}:{next(generation)}"
        return remote_worker.options(
            num_cpus=cfg.ray.actor_num_cpus, max_concurrency=4, max_restarts=0, name=name,
            namespace=ACTOR_NAMESPACE,
        ).remote(
            e.url, e.label, e.concurrency, settings, api_keys[label], cfg.mode, cfg.attempts_per_endpoint,
            cfg.circuit_failures, readmission=cfg,
        )

    return factory
