"""Ray dispatch: one async actor per endpoint, fed by the driver in batches.

The driver keeps exactly one `exchange` call outstanding per actor. Each answer brings finished
outcomes and the actor's demand (free slots plus a small prefetch), and the next call carries that
many new prompts, chosen by the router (routing.py: prefix affinity bounded by SGLang router's two balance thresholds, then work stealing). A slow
endpoint asks for less, so it simply takes less. Work held by an actor that dies or whose circuit
opens goes back to the queue; the committer drops late duplicates.

The fleet may change during the run (an endpoints file): a new endpoint's actor starts with its circuit
open and takes work once it has passed the full preflight; a removed endpoint drains. So does an endpoint
the preflight found unreachable.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Mapping

from ..core.config import Endpoint, RunConfig
from ..core.errors import RunFatal
from ..core.work import DONE, DROPPED, RETRY, RETURNED, TERMINAL, Exchange, Outcome, WorkItem
from .isolation import Isolation
from .routing import Router
from .slot import Slot, can_isolate, starting, warn_unanswered
from .startup import StartGate
from .story import log_change
from .transport import ActorLost, RayTransport, Transport
from .waste import ThrownAway

log = logging.getLogger("regen.dispatch")


ActorFactory = Callable[[Endpoint, bool], Any]
ACTOR_START_WARN_S = 60.0

RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 0.5, 30.0


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
        unreachable: Collection[str] = (),
        transport: Transport | None = None,
        refused: Mapping[str, str] | None = None,
        load: Callable[[list[Any]], list[WorkItem]] | None = None,
        start_concurrency: int | None = None,
        started_early: Collection[str] = (),
        asked_at: float | None = None,
        probed: Collection[str] | None = None,
    ):
        """`items`: WorkItems, or light pending prompts (a prompt_id and an affinity) that `load` turns into
        WorkItems when they are handed out, so the messages of the queued work are never all in memory. Actors
        start `start_concurrency` at a time (None: all); `started_early` ones were started at `asked_at`. `probed`:
        the endpoints the preflight judged (None: all); one listed since joins through its own preflight."""
        self.cfg = cfg
        self.load = load
        self.transport = transport or RayTransport()
        self.router = Router(affinity=cfg.prefix_affinity_chars > 0, balance_abs=cfg.balance_abs_threshold,
                             balance_rel=cfg.balance_rel_threshold)
        self.attempts: dict[str, int] = {}
        self.isolation = Isolation()  # prompts a crash hit, run again alone to find the one to blame
        self.unfinished = {item.prompt_id for item in items}
        self.on_outcome, self.on_tick, self.should_stop = on_outcome, on_tick, should_stop
        self.actor_factory, self.fleet_watch = actor_factory, fleet_watch
        # An endpoint unreachable at the preflight starts with its circuit open: work once it passes it. So does one
        # the preflight refused under --start-with-passing (`refused`: why), shown as `refused` until it passes.
        self.refused = dict(refused or {})
        fleet = [e for e in cfg.all_endpoints() if probed is None or e.label in probed]
        held = set(unreachable) | set(self.refused)
        # down from when the start gate asks for its actor: a wait behind an unplaceable first wave is not downtime
        self.slots = {e.label: Slot(e, None, state="open" if e.label in held else "healthy", down_since=None)
                      for e in fleet}
        self.starts = StartGate(self.slots, start_concurrency, list(started_early), asked_at)
        self.router.set_endpoints(list(self.slots))
        self.router.add(items)
        self.calls: dict[Any, str] = {}
        self.actor_restarts = 0
        self.requeued = 0
        self.fleet_changes: list[str] = []
        self.fleet_read: dict[str, Endpoint] = {e.label: e for e in fleet}  # the endpoints file's last read
        # Endpoints that left for an endpoint-fatal error, with their entry then: they stay out until it changes.
        self.left_fatal: dict[str, Endpoint] = {}
        self.hedged: set[str] = set()  # prompts re-run on an idle endpoint at the tail of the run
        self.mean_latency: float | None = None  # moving average of a prompt's latency
        self.waste = ThrownAway()  # generated tokens thrown away (store/goodput.py)

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        while self.unfinished and not self.should_stop():
            for slot in self.starts.due(self.slots):  # a few at a time; work goes to each as soon as it answers
                slot.handle, slot.created_at = self.actor_factory(slot.endpoint, slot.state == "open"), time.monotonic()
                slot.down_since = slot.down_since or slot.created_at  # down until its actor answers
                self._call(slot, [], wait_s=0.0)  # work goes only to an actor that answered: one Ray placed
            for call in self.transport.wait(list(self.calls), 0.2):
                label = self.calls.pop(call)
                slot = self.slots.get(label)
                if slot is not None:
                    self._answered(slot, call)
            self._restart_due()
            self._watch_fleet()
            self._check_fleet()
            self.on_tick(self.fleet_status())

    def _answered(self, slot: Slot, call: Any) -> None:
        try:
            exchange: Exchange = self.transport.result(call)
        except ActorLost as exc:
            self._actor_lost(slot, exc)
            return
        self.starts.answered(slot)
        slot.answered = True
        if any(o.kind != RETURNED for o in exchange.outcomes):
            slot.losses = 0  # it ran a prompt and lived: an actor that only answers an empty call is not proven
        self._absorb(slot, exchange)
        if slot.label not in self.slots:
            return
        if slot.draining and not slot.assigned:
            self._drop(slot, "drained")
            return
        self._call(slot, [] if slot.draining else self._take(slot, exchange.demand))

    def fleet_status(self) -> dict[str, dict]:
        return {label: {**s.stats, "state": "draining" if s.draining else s.state} if label not in self.refused else
                {**s.stats, "state": "refused", "refused": f"the preflight refused it: {self.refused[label]}; it "
                                                           "joins once it passes"} for label, s in self.slots.items()}

    def shutdown(self) -> None:
        """End the actors. Work they still hold was never committed and stays pending; none is in flight after."""
        self.waste.cancelled([(pid, t) for s in self.slots.values() for pid, t in s.sent_at.items()],
                             self.unfinished, self.mean_latency)
        for slot in self.slots.values():
            if slot.handle is not None:
                self.transport.kill(slot.handle)
            if slot.stats:
                slot.stats = {**slot.stats, "in_flight": 0}

    def _call(self, slot: Slot, work: list[WorkItem], wait_s: float = 0.5) -> None:
        now = time.monotonic()
        for item in work:
            slot.assigned[item.prompt_id] = item
            slot.sent_at[item.prompt_id] = now
        self.calls[self.transport.call(slot.handle, work, wait_s)] = slot.label

    def _take(self, slot: Slot, demand: int) -> list[WorkItem]:
        """The actor's demand is its free slots plus one concurrency's worth of prefetch. Near the end of
        the run the prefetch would strand work behind a slow endpoint, so there it gets free slots only,
        and once the queue is empty an idle endpoint re-runs the oldest work held by others (hedging:
        whichever answer comes first is committed, the late one is dropped). Suspects of a crash run alone
        first (isolation.py)."""
        solo = self._isolated(slot)
        if solo is not None:
            return solo
        if slot.state == "healthy" and len(self.router) < sum(s.concurrency for s in self.slots.values()):
            demand = max(0, demand - slot.concurrency)  # a probing endpoint asks for its one request only
        elsewhere = any(s.state == "healthy" for s in self.slots.values() if s is not slot and not s.draining)
        batch = self.router.take(slot.label, demand, self.unfinished.__contains__, elsewhere)
        if self.load is not None and batch:
            batch = self.load(batch)
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
                if (prompt_id in self.unfinished and prompt_id not in self.hedged and prompt_id not in slot.assigned
                        and prompt_id not in self.isolation.suspects):
                    self.hedged.add(prompt_id)
                    picked.append(item)
        return picked

    def _isolated(self, slot: Slot) -> list[WorkItem] | None:
        """The slot's work while suspects wait: one suspect alone, or nothing while it drains for one, or
        None (the slot takes from the router as usual)."""
        iso = self.isolation
        if iso.endpoint == slot.label and iso.running is not None:
            return []  # nothing beside a suspect running alone
        if not iso.queue:
            return None
        chosen = self.slots.get(iso.endpoint) if iso.endpoint else None
        if chosen is None or not can_isolate(chosen, len(self.router)):
            usable = [s for s in self.slots.values() if can_isolate(s, len(self.router))]
            # a healthy endpoint first; one whose actor has been dying is the last choice: it would charge the innocent
            chosen = min(usable, key=lambda s: (s.losses > 0, s.state != "healthy", len(s.assigned)), default=None)
            iso.endpoint = chosen.label if chosen else None
        if chosen is not slot:
            return None
        if slot.assigned:
            return []  # drains first
        while iso.queue:
            item = iso.queue.popleft()
            if item.prompt_id in self.unfinished:
                iso.running = item.prompt_id
                return [item]
        return []

    # --- outcomes -----------------------------------------------------------------------------------
    def _absorb(self, slot: Slot, exchange: Exchange) -> None:
        log_change(slot.label, slot.state, slot.stats, exchange.state, exchange.stats)
        slot.state, slot.stats = exchange.state, exchange.stats
        if slot.label in self.refused and exchange.state in ("probing", "healthy"):
            log.warning("endpoint %s now passes the preflight (refused at the start: %s): it joins the run",
                        slot.label, self.refused.pop(slot.label))
            self.fleet_changes.append(f"+{slot.label}")
        down = exchange.state in ("open", "fatal") or slot.losses > 0
        slot.down_since = (slot.down_since or time.monotonic()) if down else None
        for outcome in exchange.outcomes:
            item = slot.assigned.pop(outcome.prompt_id, None)
            slot.sent_at.pop(outcome.prompt_id, None)
            solo = self.isolation.ended(slot.label, outcome.prompt_id)
            if outcome.kind == DONE:
                latency = sum(c.latency_s for c in outcome.completions)
                self.mean_latency = latency if self.mean_latency is None else 0.9 * self.mean_latency + 0.1 * latency
                self.waste.done(outcome)
            if outcome.prompt_id not in self.unfinished:
                self.waste.late(outcome)
                continue  # a late answer for work already finished elsewhere
            attempts = self.attempts.get(outcome.prompt_id, 0) + outcome.attempts
            self.attempts[outcome.prompt_id] = attempts
            if outcome.kind == DROPPED:  # a crash: the prompt's own only if it ran alone
                if solo:
                    self.isolation.drops[outcome.prompt_id] += 1
                else:
                    self.isolation.hit(outcome.prompt_id)
            if outcome.kind == DONE:
                self._finish(outcome, attempts)
            elif self._held_elsewhere(outcome.prompt_id, slot):
                self.waste.failed(outcome, terminal=False)
                continue  # a hedged copy still runs elsewhere: that copy decides, this failure only counts
            elif self._terminal(outcome, attempts):
                self.waste.failed(outcome, terminal=True)
                self._finish(outcome, attempts)
            else:
                self.waste.failed(outcome, terminal=False)
                if item is not None:  # RETRY, RETURNED, DROPPED, ENDPOINT_FATAL: another endpoint will take it
                    self._requeue(item, failed_at=slot.label)
        if exchange.state == "fatal":
            why = str(exchange.stats.get("last_error", "endpoint-fatal error"))
            if self.fleet_watch is not None:
                self.left_fatal[slot.label] = slot.endpoint
                why += "; it stays out until its entry in the endpoints file changes"
            self._drop(slot, why)

    def _held_elsewhere(self, prompt_id: str, slot: Slot) -> bool:
        return any(prompt_id in other.assigned for other in self.slots.values() if other is not slot)

    def _terminal(self, outcome: Outcome, attempts: int) -> bool:
        """Is this failure the prompt's last? Rewrites the outcome into a terminal one if so."""
        if outcome.kind == TERMINAL:
            return True
        if outcome.kind == RETRY and attempts >= self.cfg.max_attempts:
            outcome.kind, outcome.message = TERMINAL, f"attempts exhausted ({attempts}): {outcome.message}"
            return True
        if outcome.kind == DROPPED and self.isolation.charged(outcome.prompt_id) >= self.cfg.max_connection_drops:
            outcome.kind = TERMINAL
            outcome.message = self.isolation.crash_message(outcome.prompt_id, outcome.endpoint, outcome.message)
            return True
        return False

    def _finish(self, outcome: Outcome, attempts: int) -> None:
        self.unfinished.discard(outcome.prompt_id)
        self.router.forget(outcome.prompt_id)
        self.isolation.finished(outcome.prompt_id)
        self.on_outcome(outcome, attempts)

    def _requeue(self, item: WorkItem, failed_at: str | None = None) -> None:
        self.requeued += 1
        if not self.isolation.requeue(item):
            self.router.requeue(item, failed_at)

    def _return_assigned(self, slot: Slot) -> None:
        for prompt_id in list(slot.assigned):
            self.isolation.ended(slot.label, prompt_id)
        for item in slot.assigned.values():
            if item.prompt_id in self.unfinished and not self._held_elsewhere(item.prompt_id, slot):
                self._requeue(item)
        slot.assigned.clear()
        slot.sent_at.clear()

    # --- fleet health and changes -------------------------------------------------------------------
    def _actor_lost(self, slot: Slot, exc: Exception) -> None:
        """A dead actor's in-flight work is requeued (suspects of the crash, isolation.py) and a fresh actor
        takes its place: at once the first time, then with backoff until a replacement has run a prompt (an
        actor that dies on every start, or on every prompt it is given); meanwhile the endpoint counts as down."""
        why = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line in the log
        log.warning("actor for %s died (%s); requeueing %d prompts", slot.label, why, len(slot.assigned))
        for prompt_id in slot.assigned:
            if self.isolation.ended(slot.label, prompt_id):
                self.isolation.deaths[prompt_id] += 1
                if prompt_id in self.unfinished and self.isolation.charged(prompt_id) >= self.cfg.max_connection_drops:
                    message = self.isolation.crash_message(prompt_id, slot.label, str(exc))
                    self._finish(Outcome(prompt_id, TERMINAL, slot.label, 0, message=message),
                                 self.attempts.get(prompt_id, 0))
            else:
                self.isolation.hit(prompt_id)
        self._return_assigned(slot)
        self.transport.kill(slot.handle)  # the call may have failed with the actor still alive
        slot.handle, slot.state = None, "restarting"
        slot.down_since = slot.down_since or time.monotonic()
        slot.losses += 1
        delay = 0.0 if slot.losses == 1 else min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (slot.losses - 2))
        slot.restart_at = time.monotonic() + delay
        log.info("endpoint %s: a new actor starts in %.1fs (%d lost in a row)", slot.label, delay, slot.losses)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            if slot.restart_at is not None and now >= slot.restart_at:
                self.actor_restarts += 1
                log.info("endpoint %s: actor restarted (%d restarts this session)", slot.label, self.actor_restarts)
                slot.restart_at = None
                slot.handle = self.actor_factory(slot.endpoint, False)
                slot.created_at, slot.answered, slot.warned_unplaced = now, False, False
                self._call(slot, [], wait_s=0.0)

    def _drop(self, slot: Slot, why: str) -> None:
        level = logging.INFO if slot.draining else logging.ERROR
        log.log(level, "endpoint %s leaves the fleet: %s", slot.label, why)
        self.fleet_changes.append(f"-{slot.label}")
        self.refused.pop(slot.label, None)
        self._return_assigned(slot)
        for call, label in list(self.calls.items()):
            if label == slot.label:
                del self.calls[call]
        del self.slots[slot.label]
        self.router.set_endpoints(list(self.slots))
        if slot.handle is not None:
            self.transport.kill(slot.handle)

    def _watch_fleet(self) -> None:
        """Apply the endpoint list: new endpoints join (after their preflight), removed ones drain. A list is
        applied only once two reads in a row agree, so a file read in the middle of a rewrite changes nothing."""
        read = self.fleet_watch() if self.fleet_watch else None
        if read is None:
            return
        wanted = {e.label: e for e in read}
        if wanted != self.fleet_read:
            self.fleet_read = wanted
            log.info("endpoints file changed (%d endpoints); applied once the next read agrees", len(wanted))
            return
        for label in [label for label, entry in self.left_fatal.items() if wanted.get(label) != entry]:
            del self.left_fatal[label]  # its entry changed, or it was removed: a new or re-added entry may join
        for label, endpoint in wanted.items():
            slot = self.slots.get(label)
            if slot is None and label in self.left_fatal:
                continue
            if slot is None:
                log.info("endpoint %s joins the fleet; it gets work once it passes the preflight", label)
                self.fleet_changes.append(f"+{label}")
                self.slots[label] = slot = Slot(endpoint, self.actor_factory(endpoint, True), state="open")
                self.router.set_endpoints(list(self.slots))
                self._call(slot, [])
            elif slot.draining:
                slot.draining = False  # listed again before it drained
        for label, slot in list(self.slots.items()):
            if label not in wanted and not slot.draining:
                log.info("endpoint %s was removed from the endpoints file: draining %d prompts", label,
                         len(slot.assigned))
                slot.draining = True
                if slot.handle is None:  # restarting: nothing in flight to drain
                    self._drop(slot, "removed while restarting")

    def _check_fleet(self) -> None:
        if not self.slots:
            raise RunFatal("every endpoint left the fleet (endpoint-fatal errors); see the log above")
        now = time.monotonic()
        for slot in self.slots.values():
            if (not slot.answered and slot.handle is not None and now - slot.created_at > ACTOR_START_WARN_S
                    and not slot.warned_unplaced):
                slot.warned_unplaced = True
                warn_unanswered(slot, now, getattr(self.transport, "placed", lambda _h: None)(slot.handle))
        down = [None if starting(slot, now) else slot.down_since for slot in self.slots.values()]
        if all(t is not None for t in down):
            down_for = now - max(down)
            if down_for > self.cfg.dead_fleet_deadline_s:
                restarts = f"; {self.actor_restarts} actor restarts" if self.actor_restarts else ""
                raise RunFatal(
                    f"no healthy endpoint for {down_for:.0f}s (dead_fleet_deadline_s="
                    f"{self.cfg.dead_fleet_deadline_s:.0f}{restarts}); the run is resumable once endpoints are back"
                )
