"""Ray dispatch: one async actor per endpoint, fed by the driver in batches.

The driver keeps exactly one `exchange` call outstanding per actor. Each answer brings finished
outcomes and the actor's demand (free slots plus a small prefetch), and the next call carries that
many new prompts, chosen by the router (routing.py: prefix affinity bounded by SGLang router's two balance thresholds, then work stealing). A slow
endpoint asks for less, so it simply takes less. Work held by an actor that dies or whose circuit
opens goes back to the queue; the committer drops late duplicates.

The fleet may change during the run (an endpoints file): a new endpoint's actor starts with its circuit
open and takes work once it has passed the full preflight; a removed endpoint drains.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..core.config import Endpoint, RunConfig
from ..core.errors import RunFatal
from ..core.work import DONE, RETRY, TERMINAL, Exchange, Outcome, WorkItem
from ..endpoints.client import ClientSettings
from ..hidden.capture import HiddenRoute
from .routing import Router
from .worker import EndpointWorker

log = logging.getLogger("regen.dispatch")
ACTOR_NAMESPACE = "regen"


def client_settings(cfg: RunConfig, weight_version: str | None = None,
                    engines: dict | None = None) -> ClientSettings:
    """`engines`: each endpoint's engine adapter by label, as the preflight identified it."""
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
        **cfg.sampling.explicit(),
        engines=dict(engines or {}),
    )


@dataclass
class Slot:
    """The driver's view of one endpoint actor."""

    endpoint: Endpoint
    handle: ray.actor.ActorHandle
    assigned: dict[str, WorkItem] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    state: str = "healthy"
    stats: dict = field(default_factory=dict)
    open_since: float | None = None
    draining: bool = False  # removed from the fleet: finishes its work, takes no more
    created_at: float = field(default_factory=time.monotonic)  # of the current actor
    answered: bool = False  # the current actor has answered once: Ray placed it and it runs
    warned_unplaced: bool = False

    @property
    def label(self) -> str:
        return self.endpoint.label


ActorFactory = Callable[[Endpoint, bool], ray.actor.ActorHandle]
ACTOR_START_WARN_S = 60.0


class Dispatcher:
    """Feeds work items to endpoint actors until every one has a final outcome (or a stop is asked)."""

    def __init__(
        self,
        cfg: RunConfig,
        items: list[WorkItem],
        on_outcome: Callable[[Outcome, int], None],
        on_tick: Callable[[dict[str, dict]], None],
        should_stop: Callable[[], bool],
        actor_factory: ActorFactory,
        fleet_watch: Callable[[], list[Endpoint] | None] | None = None,
    ):
        self.cfg = cfg
        self.router = Router(affinity=cfg.prefix_affinity_chars > 0, balance_abs=cfg.balance_abs_threshold,
                             balance_rel=cfg.balance_rel_threshold)
        self.attempts: dict[str, int] = {}
        self.unfinished = {item.prompt_id for item in items}
        self.on_outcome, self.on_tick, self.should_stop = on_outcome, on_tick, should_stop
        self.actor_factory, self.fleet_watch = actor_factory, fleet_watch
        self.slots = {e.label: Slot(e, actor_factory(e, False)) for e in cfg.all_endpoints()}
        self.router.set_endpoints(list(self.slots))
        self.router.add(items)
        self.calls: dict[ray.ObjectRef, str] = {}
        self.actor_restarts = 0
        self.requeued = 0
        self.fleet_changes: list[str] = []
        self.hedged: set[str] = set()  # prompts re-run on an idle endpoint at the tail of the run
        self.mean_latency: float | None = None  # moving average of a prompt's latency

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        for slot in self.slots.values():
            self._call(slot, [], wait_s=0.0)  # work goes only to an actor that answered: one Ray placed
        while self.unfinished and not self.should_stop():
            refs = list(self.calls)
            ready, rest = ray.wait(refs, num_returns=1, timeout=0.2)
            if ready and rest:  # take every other answer already there too
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            for ref in ready:
                label = self.calls.pop(ref)
                slot = self.slots.get(label)
                if slot is not None:
                    self._answered(slot, ref)
            self._watch_fleet()
            self._check_fleet()
            self.on_tick(self.fleet_status())

    def _answered(self, slot: Slot, ref: ray.ObjectRef) -> None:
        try:
            exchange: Exchange = ray.get(ref)
        except RayActorError as exc:
            self._actor_lost(slot, exc)
            return
        slot.answered = True
        self._absorb(slot, exchange)
        if slot.label not in self.slots:
            return
        if slot.draining and not slot.assigned:
            self._drop(slot, "drained")
            return
        self._call(slot, [] if slot.draining else self._take(slot, exchange.demand))

    def fleet_status(self) -> dict[str, dict]:
        return {label: {**s.stats, "state": "draining" if s.draining else s.state} for label, s in self.slots.items()}

    def shutdown(self) -> None:
        """End the actors. Work they still hold was never committed and stays pending."""
        for slot in self.slots.values():
            ray.kill(slot.handle)

    def _call(self, slot: Slot, work: list[WorkItem], wait_s: float = 0.5) -> None:
        now = time.monotonic()
        for item in work:
            slot.assigned[item.prompt_id] = item
            slot.sent_at[item.prompt_id] = now
        self.calls[slot.handle.exchange.remote(work, wait_s)] = slot.label

    def _take(self, slot: Slot, demand: int) -> list[WorkItem]:
        """The actor's demand is its free slots plus one concurrency's worth of prefetch. Near the end of
        the run the prefetch would strand work behind a slow endpoint, so there it gets free slots only,
        and once the queue is empty an idle endpoint re-runs the oldest work held by others (hedging:
        whichever answer comes first is committed, the late one is dropped)."""
        if len(self.router) < sum(s.endpoint.concurrency for s in self.slots.values()):
            demand = max(0, demand - slot.endpoint.concurrency)
        elsewhere = any(s.state == "healthy" for s in self.slots.values() if s is not slot and not s.draining)
        batch = self.router.take(slot.label, demand, self.unfinished.__contains__, elsewhere)
        if self.cfg.hedge_tail and len(batch) < demand and not len(self.router) and slot.state == "healthy":
            batch += self._hedge(slot, demand - len(batch))
        return batch

    def _hedge(self, slot: Slot, n: int) -> list[WorkItem]:
        """Stragglers: work held elsewhere for over twice the mean latency, oldest first, each re-run once."""
        if self.mean_latency is None:
            return []
        cutoff = time.monotonic() - 2 * self.mean_latency
        picked: list[WorkItem] = []
        for other in self.slots.values():
            if other is slot:
                continue
            for prompt_id, item in other.assigned.items():  # insertion order: oldest first
                if len(picked) == n or other.sent_at.get(prompt_id, cutoff) > cutoff:
                    break
                if prompt_id in self.unfinished and prompt_id not in self.hedged and prompt_id not in slot.assigned:
                    self.hedged.add(prompt_id)
                    picked.append(item)
        return picked

    # --- outcomes -----------------------------------------------------------------------------------
    def _absorb(self, slot: Slot, exchange: Exchange) -> None:
        slot.state, slot.stats = exchange.state, exchange.stats
        slot.open_since = (slot.open_since or time.monotonic()) if exchange.state in ("open", "fatal") else None
        for outcome in exchange.outcomes:
            item = slot.assigned.pop(outcome.prompt_id, None)
            slot.sent_at.pop(outcome.prompt_id, None)
            if outcome.kind == DONE:
                latency = sum(c.latency_s for c in outcome.completions)
                self.mean_latency = latency if self.mean_latency is None else 0.9 * self.mean_latency + 0.1 * latency
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
                self._requeue(item, failed_at=slot.label)
        if exchange.state == "fatal":
            self._drop(slot, str(exchange.stats.get("last_error", "endpoint-fatal error")))

    def _finish(self, outcome: Outcome, attempts: int) -> None:
        self.unfinished.discard(outcome.prompt_id)
        self.router.forget(outcome.prompt_id)
        self.on_outcome(outcome, attempts)

    def _requeue(self, item: WorkItem, failed_at: str | None = None) -> None:
        self.requeued += 1
        self.router.requeue(item, failed_at)

    def _return_assigned(self, slot: Slot) -> None:
        for item in slot.assigned.values():
            if item.prompt_id in self.unfinished:
                self._requeue(item)
        slot.assigned.clear()
        slot.sent_at.clear()

    # --- fleet health and changes -------------------------------------------------------------------
    def _actor_lost(self, slot: Slot, exc: Exception) -> None:
        """A dead actor's in-flight work is requeued and a fresh actor takes its place."""
        log.warning("actor for %s died (%s); requeueing %d prompts", slot.label, type(exc).__name__, len(slot.assigned))
        self._return_assigned(slot)
        self.actor_restarts += 1
        slot.handle = self.actor_factory(slot.endpoint, False)
        slot.created_at, slot.answered, slot.warned_unplaced = time.monotonic(), False, False
        self._call(slot, [], wait_s=0.0)

    def _drop(self, slot: Slot, why: str) -> None:
        level = logging.INFO if slot.draining else logging.ERROR
        log.log(level, "endpoint %s leaves the fleet: %s", slot.label, why)
        self.fleet_changes.append(f"-{slot.label}")
        self._return_assigned(slot)
        for ref, label in list(self.calls.items()):
            if label == slot.label:
                del self.calls[ref]
        del self.slots[slot.label]
        self.router.set_endpoints(list(self.slots))
        ray.kill(slot.handle)

    def _watch_fleet(self) -> None:
        """Apply the current endpoint list: new endpoints join (after their preflight), removed ones drain."""
        current = self.fleet_watch() if self.fleet_watch else None
        if current is None:
            return
        wanted = {e.label: e for e in current}
        for label, endpoint in wanted.items():
            slot = self.slots.get(label)
            if slot is None:
                log.info("endpoint %s joins the fleet; it gets work once it passes the preflight", label)
                self.fleet_changes.append(f"+{label}")
                self.slots[label] = slot = Slot(endpoint, self.actor_factory(endpoint, True), state="open")
                self.router.set_endpoints(list(self.slots))
                self._call(slot, [])
            elif slot.draining:
                slot.draining = False  # listed again before it drained
        for label, slot in self.slots.items():
            if label not in wanted and not slot.draining:
                log.info("endpoint %s was removed from the endpoints file: draining %d prompts", label,
                         len(slot.assigned))
                slot.draining = True

    def _check_fleet(self) -> None:
        if not self.slots:
            raise RunFatal("every endpoint left the fleet (endpoint-fatal errors); see the log above")
        now = time.monotonic()
        for slot in self.slots.values():
            if not slot.answered and now - slot.created_at > ACTOR_START_WARN_S and not slot.warned_unplaced:
                slot.warned_unplaced = True
                pins = {k: v for k, v in (("resources", slot.endpoint.ray_resources),
                                          ("labels", slot.endpoint.ray_labels)) if v}
                log.warning("endpoint %s: its actor has not started after %.0f s; Ray cannot place it%s",
                            slot.label, now - slot.created_at,
                            f" (does a live node have {pins}?)" if pins else " (is the cluster out of CPUs?)")
        # an actor Ray never placed counts as down since it was created
        opened = [s.open_since if s.answered else s.created_at for s in self.slots.values()]
        if all(t is not None for t in opened):
            down_for = time.monotonic() - max(opened)
            if down_for > self.cfg.dead_fleet_deadline_s:
                raise RunFatal(
                    f"no healthy endpoint for {down_for:.0f}s (dead_fleet_deadline_s="
                    f"{self.cfg.dead_fleet_deadline_s:.0f}); the run is resumable once endpoints are back"
                )


def make_actor_factory(cfg: RunConfig, settings: ClientSettings, api_key: Callable[[Endpoint], str | None],
                       run_dir: str):
    """Actors are spread round-robin over the cluster's live nodes (Ray's SPREAD leaves zero-CPU actors on
    one node); an endpoint may pin its actor instead through Ray resources (e.g. `{"node:10.0.0.7": 0.01}`,
    or a custom resource given to `ray start --resources`) or node labels (`ray start --labels rack=b`).
    A replacement actor goes to a node still alive."""
    remote_worker = ray.remote(EndpointWorker)
    generation = itertools.count()
    hidden = cfg.hidden_states
    route = HiddenRoute(hidden.expected_width, run_dir, cfg.template_kwargs().get("thinking"),
                        hidden.max_in_memory) if hidden.enabled else None

    def factory(e: Endpoint, start_open: bool) -> ray.actor.ActorHandle:
        n = next(generation)
        # Named, so an operator (or a test) can find the actor of an endpoint in the cluster.
        name = f"{cfg.run_name}:{os.getpid()}:{e.label}:{n}"
        if e.ray_resources or e.ray_labels:
            placement = {"resources": dict(e.ray_resources), "label_selector": dict(e.ray_labels)}
        else:
            nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
            placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[n % len(nodes)], soft=False)}
        return remote_worker.options(
            num_cpus=cfg.ray.actor_num_cpus, max_concurrency=4, max_restarts=0, name=name,
            namespace=ACTOR_NAMESPACE, **placement,
        ).remote(
            e.url, e.label, e.concurrency, settings, api_key(e), cfg.mode, cfg.attempts_per_endpoint,
            cfg.circuit_failures, readmission=cfg, start_open=start_open, hidden=route,
        )

    return factory
