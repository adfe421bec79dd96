"""The driver's view of one endpoint actor: what it holds, its state, and when it went down or must restart."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.config import Endpoint
from ..core.work import WorkItem

log = logging.getLogger("regen.dispatch")


@dataclass
class Slot:
    """The driver's view of one endpoint actor."""

    endpoint: Endpoint
    handle: Any  # a Ray actor handle (an EndpointWorker under LocalTransport); None while a restart waits
    assigned: dict[str, WorkItem] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    state: str = "healthy"
    stats: dict = field(default_factory=dict)
    # Since when this endpoint has had no working actor: not placed or started yet, circuit open, endpoint-fatal,
    # or dead and restarting. Kept across restarts, so an actor that dies on every start counts as down.
    down_since: float | None = field(default_factory=time.monotonic)
    draining: bool = False  # removed from the fleet: finishes its work, takes no more
    created_at: float = field(default_factory=time.monotonic)  # of the current actor
    answered: bool = False  # the current actor has answered once: Ray placed it and it runs
    warned_unplaced: bool = False
    losses: int = 0  # actors lost in a row without one bringing back the outcome of a prompt
    restart_at: float | None = None  # a lost actor's replacement starts then (backoff)

    @property
    def label(self) -> str:
        return self.endpoint.label

    @property
    def concurrency(self) -> int:
        """Requests in flight at most now: the fixed number, or where `auto` stands (the worker's stats)."""
        return int(self.stats.get("concurrency") or self.endpoint.max_in_flight)


def can_isolate(slot: Slot, queued: int) -> bool:
    """May a crash suspect run alone on this slot's endpoint (`queued`: prompts the router still holds)?"""
    if slot.draining or slot.handle is None:
        return False
    # Half-open, once the router has no prompt to probe with: the suspect is then its one request. Only a
    # request that succeeds closes a circuit, so with only suspects left, waiting for a healthy endpoint
    # would hang the run; while other work is queued, a suspect that crashes it would only starve that work.
    return slot.state == "healthy" or (slot.state == "probing" and not queued)


# A first actor of an endpoint that has not answered yet is starting, not down (a loaded cluster starts actors
# slowly): it counts toward dead_fleet_deadline_s only once it has been starting this long.
ACTOR_START_GRACE_S = 300.0


def starting(slot: Slot, now: float) -> bool:
    """Its actor was asked for and has not answered yet, within the grace; not a replacement of a lost actor (an
    actor that dies on every start is down)."""
    return (slot.handle is not None and not slot.answered and slot.losses == 0
            and now - slot.created_at < ACTOR_START_GRACE_S)


def warn_unanswered(slot: Slot, now: float, placed: bool | None) -> None:
    """An actor slow to answer: Ray cannot place it (said only when Ray says so), or it runs and is slow."""
    waited = now - slot.created_at
    if placed:
        log.warning("endpoint %s: its actor runs but has not answered after %.0f s (a loaded machine?); it gets work "
                    "once it answers", slot.label, waited)
        return
    pins = {k: v for k, v in (("resources", slot.endpoint.ray_resources), ("labels", slot.endpoint.ray_labels)) if v}
    why = f" (does a live node have {pins}?)" if pins else " (is the cluster out of CPUs?)"
    if placed is False:
        log.warning("endpoint %s: its actor has not started after %.0f s; Ray cannot place it%s", slot.label, waited, why)
    else:
        log.warning("endpoint %s: its actor has not answered after %.0f s: Ray may not be able to place it%s, or the "
                    "machine is loaded", slot.label, waited, why)
