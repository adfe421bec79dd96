"""One session's dispatch: the opt-in /metrics, Ray, the Dispatcher and its callbacks that build, commit and count
each outcome (goodput, the quality gate). Called by pipeline/run.py once the run directory, the prompt set and the
fleet's preflight are settled."""
from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ..core.errors import QualityGateStopped
from ..core.work import DONE, Outcome
from ..store.committer import Committer
from ..store.gate import QualityGate
from ..store.goodput import DUPLICATE, part_footer
from ..store.prompt_reader import PendingPrompt
from ..store.records import RecordBuilder
from ..store.rundir import RunDir
from ..store.status import concurrency_sessions
from .cluster import EndpointsFileWatch, embedded_ray, join_ray
from .startup import EarlyActors, start_concurrency
from .fleet import FleetFacts

log = logging.getLogger("regen")


def run_dispatch(cfg: Any, run_dir: RunDir, builder: RecordBuilder, pending: list[PendingPrompt], committer: Committer,
                 progress, stop: Any, fleet: FleetFacts, early: EarlyActors | None = None, metrics=None) -> str:
    """`early`: the actors the session started before the preflight; `metrics`: the opt-in /metrics, bound by the
    caller before Ray starts (a port already taken stops the run at once, no actor started)."""
    from .images import check_send_as
    from .metrics import serve_metrics

    if fleet.images:
        check_send_as(cfg.images.send_as, cfg.images.store, run_dir.path.uri)
    stop.graceful = True  # from here a signal ends the dispatch and the buffer is committed
    # what each endpoint's concurrency ended the earlier sessions at (the card's), from the last status.json: read
    # before this session writes its own
    progress.extra["concurrency_sessions"] = concurrency_sessions(run_dir.read_status())
    bound = metrics is None and cfg.metrics is not None  # not bound by session_start (no pending work expected)
    if bound:
        metrics = serve_metrics(cfg, run_dir.read_manifest().get("fingerprint"))
    if metrics is None:
        return dispatch_with_ray(cfg, run_dir, builder, pending, committer, progress, stop, fleet, None, early)
    progress.extra["metrics_url"] = metrics.url
    metrics.status(progress.status("running"))  # the run's counts from the first scrape, while Ray starts
    try:
        return dispatch_with_ray(cfg, run_dir, builder, pending, committer, progress, stop, fleet, metrics, early)
    finally:
        if bound:
            metrics.close()
        progress.extra.pop("metrics_url", None)  # status.json names no dead address


def logged_first(load):
    """`load` (the dispatcher's), saying in the run's log when the first work is handed out: the startup's last
    step before the first request."""
    first = [True]

    def logged(batch: list) -> list:
        started = time.monotonic()
        items = load(batch)
        if first[0]:
            first[0] = False
            log.info("first work handed out: %d units, their rows read in %.2f s", len(items),
                     time.monotonic() - started, extra={"file_only": True})
        return items

    return logged


@contextmanager
def session_start(cfg: Any, run_dir: RunDir, stop: Any) -> Iterator[tuple[EarlyActors, Any]]:
    """Before the ledger is read: the opt-in /metrics is bound (a port already taken stops the run at once, before
    Ray), then the first endpoint actors start (startup.py), unless the run's status says it is complete or there
    is no cluster to join: an embedded one is started by the dispatch, after the preflight, so a refused fleet (or
    a run with nothing pending) never pays a whole cluster's start. Yields them (for run_dispatch); on the way out
    the actors no endpoint took are killed and /metrics closed."""
    from .metrics import serve_metrics

    early, metrics = EarlyActors(cfg), None
    try:
        if (run_dir.read_status() or {}).get("state") != "complete":
            metrics = serve_metrics(cfg, run_dir.read_manifest().get("fingerprint"))
            if not embedded_ray(cfg.ray.address, dict(os.environ)):
                early.start(stop)
        yield early, metrics
    finally:
        early.close()
        if metrics is not None:
            metrics.close()


def dispatch_with_ray(cfg, run_dir: RunDir, builder: RecordBuilder, pending: list[PendingPrompt], committer: Committer,
                      progress, stop: Any, fleet: FleetFacts, metrics, early: EarlyActors | None = None) -> str:
    from .actors import client_settings, make_actor_factory
    from .dispatcher import Dispatcher

    join_ray(cfg.ray.address, stop)  # at once if the session's early actors joined it
    if stop():
        return "interrupted"

    gate = QualityGate(cfg.quality_gate, cfg.quality_gate_records, cfg.quality_thresholds.model_dump(),
                       cfg.sampling.max_tokens)
    kept: list[dict] = []  # the records of this outcome that the committer took (for the quality gate)
    gate_stopped: list[QualityGateStopped] = []  # raised once the dispatch has stopped: salvaged, then the run ends

    def on_outcome(outcome: Outcome, attempts: int) -> None:
        kept.clear()
        if outcome.kind == DONE:
            rows, tokens = builder.records(outcome, attempts), sum(c.completion_tokens for c in outcome.completions)
            if committer.add_records(rows):
                kept.extend(rows)  # counted for goodput once committed (committer.on_committed)
            else:  # a prompt committed already: this copy's tokens are thrown away
                progress.goodput.add(DUPLICATE, tokens)
            progress.record(True, tokens, outcome.endpoint)
        else:
            committer.add_failure(builder.failure(outcome, attempts))
            progress.record(False, 0, outcome.endpoint)
            log.info("prompt %s failed terminally at %s: %s", outcome.prompt_id, outcome.endpoint, outcome.message)
        if metrics is not None:
            metrics.outcome(outcome)
        committer.maybe_flush()
        progress.write_counted()  # status.json carries the counts to the next session: right after a commit
        try:
            gate.observe(kept)
        except QualityGateStopped as exc:  # `quality_gate: stop`: the rest of this batch is committed first
            gate_stopped.append(exc)
        finally:
            progress.quality_gate = gate.verdict

    def on_tick(endpoints: dict[str, dict]) -> None:
        committer.maybe_flush()
        progress.write_counted()
        progress.tick(endpoints)
        if metrics is not None:
            metrics.status({**progress.status("running"), "requeued": dispatcher.requeued})

    # light pending prompts: each prompt's row is read from the prompt set as it is handed out (`load`)
    dispatcher = Dispatcher(cfg, pending, on_outcome, on_tick,
                            lambda: stop() or bool(gate_stopped),
                            make_actor_factory(cfg, client_settings(cfg, fleet.weight_version, fleet.engines,
                                                                    fleet.run_engines, fleet.tools, fleet.images),
                                               cfg.api_key, early, run_dir.path.uri),
                            fleet_watch=EndpointsFileWatch(cfg) if cfg.endpoints_file else None,
                            unreachable=fleet.unreachable, refused=fleet.refused,
                            load=logged_first(builder.work_items),
                            start_concurrency=early.concurrency if early and early.concurrency else
                            start_concurrency(cfg), started_early=early.labels() if early else [],
                            asked_at=early.asked_at if early else None, probed=fleet.probed)
    if early is not None:
        early.keep_only(dispatcher.slots)  # an endpoint removed from the endpoints file since its actor started
    progress.thrown_away = dispatcher.waste.goodput
    # all_turns: the default export writes whole conversations, cut before a dropped turn (store/goodput.py)
    committer.on_committed = functools.partial(progress.committed, whole_conversations=cfg.mode == "all_turns")
    committer.on_failures_committed = progress.failures_committed
    committer.footer = functools.partial(part_footer, whole_conversations=cfg.mode == "all_turns")
    log.info("%s", dispatch_line(len(pending), "prompts" if cfg.samples_per_prompt == 1 else
                                 f"samples ({cfg.samples_per_prompt} per prompt)", list(dispatcher.slots),
                                 fleet.unreachable, fleet.refused))
    progress.begin()
    try:
        dispatcher.run()
    finally:
        dispatcher.shutdown()
        progress.endpoints = dispatcher.fleet_status()  # as the actors were ended: nothing in flight
        progress.stopped()
    if gate_stopped:
        raise gate_stopped[0]
    if not stop():
        gate.finish()  # a session smaller than the gate's sample: checked at its end
        progress.quality_gate = gate.verdict
    if dispatcher.refused:
        log.warning("endpoints held out by the preflight never passed it this session, so the run went on without "
                    "them: %s", "; ".join(f"{label}: {why}" for label, why in dispatcher.refused.items()))
    progress.extra = {"concurrency_sessions": progress.extra.get("concurrency_sessions", []),
                      "requeued": dispatcher.requeued, "actor_restarts": dispatcher.actor_restarts,
                      "hedged": len(dispatcher.hedged), "dropped_duplicates": committer.dropped_duplicates,
                      "fleet_changes": dispatcher.fleet_changes, "held_out": sorted(dispatcher.refused),
                      "prompt_groups_read": builder.reader.groups_read if builder.reader is not None else 0}
    return "interrupted" if stop() else "complete"


def dispatch_line(count: int, unit: str, endpoints: list[str], unreachable: Any, refused: Any) -> str:
    """The session's first dispatch line: how many endpoints take work now, and the ones the preflight holds out
    (unreachable, or refused under --start-with-passing) until they pass it."""
    held = [label for label in endpoints if label in unreachable or label in refused]
    if not held:
        return f"dispatch: {count} {unit} to {len(endpoints)} endpoints"
    why = ", ".join(f"{label} ({'unreachable' if label in unreachable else 'refused'})" for label in held)
    return (f"dispatch: {count} {unit} to {len(endpoints) - len(held)} of {len(endpoints)} endpoints; "
            f"{len(held)} held out by the preflight, joining once {'it passes' if len(held) == 1 else 'they pass'}: "
            f"{why}")
