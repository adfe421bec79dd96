"""What the dispatch tells the run's log about its endpoints: every change of state, with its reason."""
from __future__ import annotations

import logging

log = logging.getLogger("regen.dispatch")


def log_change(label: str, old: str, old_stats: dict, new: str, stats: dict) -> None:
    """One endpoint's answer, against the state the driver knew (its reason: the worker's last error)."""
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
