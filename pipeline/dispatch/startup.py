"""How a session's endpoint actors start: a few at a time, the first ones before the preflight.

Starting an actor is a new Python process that imports Ray and regen's worker modules (about 1.5 s of CPU). Ray
starts every actor asked for at once, so on a small machine 16 actors asked together share its cores and the first
is ready only when nearly all are: 13 s on 2 idle cores (37 s on a loaded one), where one alone is ready in 1.5 s.
So a session starts a first wave of `ray.actor_start_concurrency` actors (default: as many as the cluster has CPUs;
a big cluster starts them all at once), and the rest once one of the first is ready and has sent its first requests
(StartGate): the first request needs one ready actor, not sixteen. (Starting the rest a few at a time too was
measured: once actors work, each next start shares the CPU with them, and the fleet took 88 s to be whole instead of
about 20.) Endpoints that passed the preflight start before those it holds out.

The first wave starts early (`EarlyActors`): as soon as the session knows its run, overlapping the ledger read, the
pending scan and the fleet's preflight. They stay empty (actors.RayEndpointWorker) until the dispatch begins
them with the settings the preflight settled: nothing reaches an endpoint before the preflight has passed it, and an
actor no endpoint takes (a refused run, a signal, nothing pending) is killed. Only on a cluster to join: a run that
starts its own embedded cluster starts it with the dispatch, after the preflight (a refused fleet is refused
without starting a cluster).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection

from ..core.config import Endpoint, RunConfig
from .cluster import join_ray
from .slot import Slot

log = logging.getLogger("regen.dispatch")

# An actor still starting after this long (Ray cannot place it, or the machine is swamped) no longer holds back
# the others' start.
START_HOLD_S = 20.0
# The rest of the actors start at most this long after the first is ready, even if it has no work (none pending for
# its endpoint, its circuit open).
RELEASE_S = 1.0


def start_concurrency(cfg: RunConfig) -> int:
    """Actors started at once: `ray.actor_start_concurrency`, or as many as the cluster has CPUs."""
    if cfg.ray.actor_start_concurrency is not None:
        return cfg.ray.actor_start_concurrency
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


class EarlyActors:
    """The first actors of the session, started before the preflight; the dispatch takes them (`take`)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.handles: dict[str, tuple[Endpoint, Any]] = {}
        self.count = 0  # actors started (the factory numbers the next ones from here)
        self.asked_at: float | None = None
        self.concurrency: int | None = None

    def start(self, stop: Callable[[], bool]) -> None:
        """Join (or start) the cluster and start the first `start_concurrency` endpoints' actors. Anything but a
        signal that stops it is logged: the dispatch then joins the cluster itself, and says what fails."""
        from .actors import start_actor

        try:
            join_ray(self.cfg.ray.address, stop)
            self.concurrency = start_concurrency(self.cfg)
            self.asked_at = time.monotonic()
            for e in self.cfg.all_endpoints()[:self.concurrency]:
                self.handles[e.label] = (e, start_actor(self.cfg, e, self.count))
                self.count += 1
        except Exception as exc:  # noqa: BLE001 - the dispatch's own start reports it, at its place
            log.warning("endpoint actors not started early (%s: %s); they start with the dispatch",
                        type(exc).__name__, exc)
            self.close()
            return
        log.info("started %d of %d endpoint actors while the run is read and the fleet probed (%d at a time)",
                 len(self.handles), len(self.cfg.all_endpoints()), self.concurrency)

    def take(self, e: Endpoint) -> Any:
        """The early actor of endpoint `e` (None: none, or it was started for another entry of that label, edited
        in the endpoints file since: that one is killed, or it would hold the CPUs its new actor needs)."""
        entry = self.handles.pop(e.label, None)
        if entry is not None and entry[0] != e:
            _kill(entry[1])
            return None
        return entry[1] if entry is not None else None

    def labels(self) -> list[str]:
        return list(self.handles)

    def keep_only(self, labels: Collection[str]) -> None:
        """Kill the actors of endpoints no longer in the fleet (removed from the endpoints file since they started):
        the dispatch never takes them, and each would sit idle for the whole run on the CPUs it holds."""
        for label in [label for label in self.handles if label not in labels]:
            _kill(self.handles.pop(label)[1])

    def close(self) -> None:
        """Kill the actors no endpoint took."""
        for _, handle in self.handles.values():
            _kill(handle)
        self.handles.clear()


def _kill(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle)
    except Exception as exc:  # noqa: BLE001 - already gone, or Ray is down: nothing left to end
        log.debug("ray.kill: %s", exc)


class StartGate:
    """Which slots' actors start now: early ones at once; then at most `concurrency` starting at once (None: no
    limit) until one actor is ready and has its first work (its answer to the call that carried it: the call
    returns after its wait, so its first requests are out), or RELEASE_S after it was ready, and from then on the
    rest. Those processes would otherwise share the cores with the first actor's first requests (measured: the
    first request reached its endpoint 0.2 to 2 s after the work was handed out, 0.08 s with the cores to itself)."""

    def __init__(self, slots: dict[str, Slot], concurrency: int | None, early: list[str],
                 asked_at: float | None):
        held = [label for label, s in slots.items() if label not in early and s.state == "open"]
        self.queue = [label for label in early if label in slots] + [
            label for label in slots if label not in early and label not in held] + held
        self.early, self.concurrency = set(early), concurrency
        self.asked_at = asked_at if asked_at is not None else time.monotonic()
        self.total, self.ready = len(slots), 0
        self.ready_at: float | None = None
        self.working = False  # an actor has answered the call that carried its first work
        self.counted: set[str] = set()  # endpoints whose actor has answered once (a replacement is not counted again)

    def due(self, slots: dict[str, Slot]) -> list[Slot]:
        now = time.monotonic()
        starting = sum(1 for s in slots.values()
                       if s.handle is not None and not s.answered and now - s.created_at < START_HOLD_S)
        out = []
        while self.queue:
            slot = slots.get(self.queue[0])
            if slot is not None and slot.handle is None and not (
                    slot.label in self.early or self.concurrency is None or self._released(now)
                    or starting < self.concurrency):
                break
            self.queue.pop(0)
            if slot is not None and slot.handle is None and slot.restart_at is None:
                out.append(slot)
                starting += 1
        return out

    def _released(self, now: float) -> bool:
        return self.working or (self.ready_at is not None and now - self.ready_at >= RELEASE_S)

    def answered(self, slot: Slot) -> None:
        """The slot's actor answered (`slot.assigned`: the work it held during the call); its first answer is told in
        the log: the startup story."""
        self.working = self.working or bool(slot.assigned)
        if slot.label in self.counted or self.ready >= self.total:
            return
        self.counted.add(slot.label)
        self.ready += 1
        self.ready_at = self.ready_at or time.monotonic()
        first_or_last = self.ready in (1, self.total)
        log.info("%d of %d endpoint actors ready after %.1f s (%s)", self.ready, self.total,
                 time.monotonic() - self.asked_at, slot.label, extra={"file_only": not first_or_last})
