"""What the dispatch tells the run's log about its endpoints: every change of state, with its reason."""
from __future__ import annotations

import logging

from ..store.status import capped, count

log = logging.getLogger("regen.dispatch")


def log_change(label: str, old: str, old_stats: dict, new: str, stats: dict) -> None:
    """One endpoint's answer, against the state the driver knew (its reason: the worker's last error)."""
    log_concurrency(label, old_stats, stats)
    why = stats.get("last_error") or "no error recorded"
    refused = stats.get("errors", {}).get("readmission_refused", 0)
    if refused > old_stats.get("errors", {}).get("readmission_refused", 0) and why != old_stats.get("last_error"):
        log.warning("endpoint %s answers again but is refused: %s", label, why)
    if new == old or new == "fatal":  # fatal: the dispatcher says why it leaves the fleet
        return
    if old == "restarting":
        log.info("endpoint %s: its new actor runs (%s)", label, new)
    elif new == "open":
        log.warning("endpoint %s: circuit opened (%s); its work goes back to the queue, it is probed until it "
                    "answers", label, why)
    elif new == "probing":
        log.info("endpoint %s: circuit half-open: it answers and passed the readmission preflight; one request "
                 "decides", label)
    elif new == "healthy":
        log.info("endpoint %s: circuit closed: healthy, it takes work", label)


def log_concurrency(label: str, old_stats: dict, stats: dict) -> None:
    """`concurrency: auto`: what an unset concurrency became, an auto one bounded by `concurrency_cap` below the
    server's batch, an error of the actor's poll, a move of a fifth or more since the last logged value, or another
    reason. The driver logs it: the actor's log reaches no file."""
    limit, before = stats.get("concurrency"), old_stats.get("concurrency")
    if limit is None:
        return
    error = stats.get("concurrency_poll_error")
    if error and error != old_stats.get("concurrency_poll_error"):
        log.warning("endpoint %s: the poll of its concurrency failed (it goes on): %s", label, error)
    mode, reason = stats.get("concurrency_mode"), stats.get("concurrency_reason")
    if stats.get("concurrency_unset") and mode != old_stats.get("concurrency_mode") and mode in ("auto", "pinned"):
        _SHOWN[label] = (limit, reason)
        if mode == "auto":
            log.info("endpoint %s: concurrency auto (not set, and the server batches up to %s%s)", label,
                     stats.get("server_batch"), capped(stats))
        else:
            log.info("endpoint %s: concurrency %s (not set, and the server reports no batch limit; `concurrency: "
                     "auto` would drive it from the time per token)", label, limit)
        return
    if (mode == "auto" and not stats.get("concurrency_unset") and capped(stats)
            and stats.get("server_batch") != old_stats.get("server_batch")):  # its batch read (again): the cap bounds
        log.info("endpoint %s: concurrency auto (the server batches up to %s%s)", label, stats.get("server_batch"),
                 capped(stats))
    if before is None or (limit == before and reason == old_stats.get("concurrency_reason")):
        return
    shown = _SHOWN.get(label)
    if shown is not None and abs(limit - shown[0]) < 0.2 * shown[0] and reason == shown[1]:
        return
    _SHOWN[label] = (limit, reason)
    if reason == "concurrency_cap":  # the server would take more
        reason = f"capped by concurrency_cap {stats.get('concurrency_cap', limit)}"
    log.info("endpoint %s: concurrency %s -> %s (%s; the server runs %s, %s waiting, batches up to %s)", label,
             before, limit, reason, count(stats.get("server_running")), count(stats.get("server_waiting")),
             stats.get("server_batch"))


_SHOWN: dict[str, tuple[int, str | None]] = {}  # per endpoint: the concurrency last logged and why
