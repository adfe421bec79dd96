"""The dataset card's lines on each endpoint's concurrency, from status.json: a set number, `auto` or an unset one
and which it became, across the run's sessions."""
from __future__ import annotations

from ..store.rundir import RunDir
from ..store.status import capped, not_auto


def concurrency_lines(run_dir: RunDir) -> list[str]:
    """Each endpoint's concurrency (status.json): a set number, `auto` or an unset one and which it became; for auto
    the value the last session ended at, and what the earlier sessions ended at (`concurrency_sessions`: a resume
    starts auto again from 8, so the last session alone would understate a run whose earlier sessions held more)."""
    status = run_dir.read_status() or {}
    endpoints = status.get("endpoints") or {}
    earlier = [s.get("endpoints") or {} for s in status.get("concurrency_sessions") or [] if isinstance(s, dict)]
    lines = []
    for label in sorted({*endpoints, *(name for session in earlier for name in session)}):
        history = [e[label] for e in earlier if isinstance(e.get(label), dict) and _has_concurrency(e[label])]
        last = endpoints.get(label)
        if isinstance(last, dict) and _has_concurrency(last):
            lines.append(concurrency_line(label, last, history))
        elif history:  # removed or renamed since, or its actor reported no figure in the last session
            absent = "no figure from the last session" if label in endpoints else "not in the last session"
            lines.append(concurrency_line(label, history[-1], history[:-1], in_last=False, absent=absent))
    return [*lines, ""] if lines else []


def _has_concurrency(stats: dict) -> bool:
    return stats.get("concurrency") is not None


def concurrency_line(label: str, stats: dict, earlier: list[dict] | None = None, in_last: bool = True,
                     absent: str = "not in the last session") -> str:
    """`earlier`: the endpoint's stats at the end of the earlier sessions, oldest first; `in_last`: `stats` are of
    the run's last session, else of the last session the endpoint took part in."""
    absent = "" if in_last else f"; {absent}"
    before = ""
    if earlier:
        before = f"; earlier sessions ended at {', '.join(_ended_at(s) for s in earlier)}"
        highest = max([s.get("concurrency_highest") or s["concurrency"] for s in [*earlier, stats]
                       if s.get("concurrency_mode", "auto") == "auto"], default=None)
        if highest is not None and highest > (stats.get("concurrency_highest") or stats["concurrency"]):
            before += f" (the run's highest {highest})"
    fixed = not_auto(stats, ended=True)
    if fixed is not None:
        return f"- {label}: {fixed}{before}{absent}"
    batch = stats.get("server_batch")
    server = f"the server batches up to {batch}{capped(stats)}" if batch else ""
    if stats.get("concurrency_unset"):
        why = f" (not set, and {server})" if batch else " (not set)"
    else:
        why = f" ({server})" if batch else ""
    highest = stats.get("concurrency_highest")
    return (f"- {label}: concurrency auto{why}: {stats['concurrency']} at the end of "
            f"{'the' if in_last else 'its'} last session"
            + (f" (its highest {highest})" if highest and highest > stats["concurrency"] else "") + before + absent)


def _ended_at(stats: dict) -> str:
    mode = stats.get("concurrency_mode", "auto")
    return {"fixed": f"{stats['concurrency']} (set)", "pinned": f"{stats['concurrency']} (not set, no batch)",
            "deciding": f"{stats['concurrency']} (undecided)"}.get(mode, str(stats["concurrency"]))
