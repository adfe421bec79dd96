"""Progress: the tqdm bar on a terminal, plain progress lines in the log (and on a console that is not a
terminal), and status.json, rewritten atomically. Rates are recent (a sliding window) and overall."""
from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from ..core.work import record_unit
from .goodput import DUPLICATE, Goodput, summary_line
from .prompt_reader import PendingScan
from .rundir import RunDir, now_utc

log = logging.getLogger("regen.progress")

RECENT_WINDOW_S = 300.0  # "recent" rates: the last five minutes
STATE_MARKS = {"healthy": "+", "probing": "?", "open": "x", "fatal": "!"}


def duration(seconds: float | None) -> str:
    """1h02m, 4m05s, 12s; "unknown" for None."""
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def row_has_images(row: dict[str, Any]) -> bool:
    """A record row (message_row messages) whose messages hold an image part."""
    return any(part.get("type") == "image" for m in row.get("messages") or () for part in m.get("parts") or ())


def image_counts(scan: PendingScan, retry_failures: bool) -> dict[str, int] | None:
    """status.json's count of the prompts (samples) with images, from the scan (the set's `images` column)."""
    if not scan.image_total:
        return None
    failed = 0 if retry_failures else scan.image_total - scan.image_done - scan.image_waiting
    return {"total": scan.image_total, "done": scan.image_done, "failed": failed}


@dataclass
class Progress:
    run_dir: RunDir
    total: int
    already_done: int
    failed_before: int
    rejects: int
    status_interval_s: float = 2.0
    log_interval_s: float = 60.0
    done: int = 0  # this session's outcomes (the rates, the bar): a finished sample may still be in the buffer
    failed: int = 0
    completion_tokens: int = 0
    committed_done: int = 0  # this session's units committed (status.json's and /metrics' done): the ledger's
    committed_failed: int = 0
    endpoints: dict[str, dict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    goodput_before: Goodput = field(default_factory=Goodput)  # earlier sessions' (their status.json)
    goodput: Goodput = field(default_factory=Goodput)  # this session's committed records (store/goodput.py)
    thrown_away: Goodput = field(default_factory=Goodput)  # this session's, counted by the dispatch
    quality_gate: dict[str, Any] = field(default_factory=dict)  # the gate's verdict (store/gate.py)
    # samples_per_prompt: with k > 1 total, done, failed and pending count samples (prompts x k), and say so
    samples_per_prompt: int = 1
    # prompts (samples) with images: {"total", "done"} from the ledger at the start (PendingScan), done counted on
    # as records commit; None: the set has none
    image_prompts: dict[str, int] | None = None
    terminal: bool | None = None  # None: whether stderr is a terminal

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self._last_status = 0.0
        self._counted_unwritten = False  # a commit counted, not yet in status.json
        self._last_log = self.started
        self.samples: deque[tuple[float, int, int]] = deque([(self.started, 0, 0)])  # (time, finished, tokens)
        self.by_endpoint: dict[str, dict[str, int]] = {}  # this session's outcomes per endpoint
        if self.terminal is None:
            self.terminal = sys.stderr.isatty()
        # A bar redraws itself with carriage returns: only a terminal shows it; nohup and pipes get log lines.
        self.bar = tqdm(total=self.total, initial=self.already_done + self.failed_before,
                        unit="prompt" if self.samples_per_prompt == 1 else "sample",
                        dynamic_ncols=True, file=sys.stderr, mininterval=0.5, smoothing=0.05) if self.terminal else None

    def begin(self) -> None:
        """The dispatch starts: the session's clock and its rate window start here, not while Ray started."""
        self.started = self._last_log = time.monotonic()
        self.samples = deque([(self.started, self.done + self.failed, self.completion_tokens)])

    def record(self, ok: bool, completion_tokens: int, endpoint: str | None = None) -> None:
        if ok:
            self.done += 1
            self.completion_tokens += completion_tokens
        else:
            self.failed += 1
        if endpoint is not None:
            counts = self.by_endpoint.setdefault(endpoint, {"done": 0, "failed": 0, "completion_tokens": 0})
            counts["done" if ok else "failed"] += 1
            counts["completion_tokens"] += completion_tokens
        if self.bar is not None:
            self.bar.update(1)

    def committed(self, rows: list[dict[str, Any]], whole_conversations: bool) -> None:
        """A records part was committed: its records are counted, and status.json, which carries the counts to the
        next session, is rewritten at the next `write_counted` (right after the commit), so a SIGKILL loses none."""
        self.goodput.add_records(rows, whole_conversations)
        self.committed_done += len({record_unit(row) for row in rows})
        if self.image_prompts is not None:
            self.image_prompts["done"] += len({record_unit(row) for row in rows if row_has_images(row)})
        self._counted_unwritten = True

    def failures_committed(self, rows: list[dict[str, Any]]) -> None:
        """A failures part was committed: its units count as failed from now on."""
        self.committed_failed += len({record_unit(row) for row in rows})
        self._counted_unwritten = True

    def write_counted(self) -> None:
        if self._counted_unwritten:
            self.write("running")

    def goodput_total(self) -> Goodput:
        return self.goodput_before + self.goodput + self.thrown_away

    # --- rates --------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.started)

    def tok_s(self) -> float:
        return self.completion_tokens / self.elapsed()

    def _sample(self, now: float) -> None:
        self.samples.append((now, self.done + self.failed, self.completion_tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RECENT_WINDOW_S:
            self.samples.popleft()

    def rates(self) -> dict[str, dict[str, float]]:
        now = time.monotonic()
        then, finished, tokens = self.samples[0]
        window = max(1e-9, now - then)
        recent_prompts = self.done + self.failed - finished
        return {
            "recent": {"window_s": round(window, 1), "prompts_s": round(recent_prompts / window, 3),
                       "tok_s": round((self.completion_tokens - tokens) / window, 1)},
            "overall": {"window_s": round(self.elapsed(), 1),
                        "prompts_s": round((self.done + self.failed) / self.elapsed(), 3),
                        "tok_s": round(self.tok_s(), 1)},
        }

    def pending(self) -> int:
        """Units without a committed record or failure (a finished one still in the buffer is pending)."""
        return max(0, self.total - self.already_done - self.committed_done - self.failed_before
                   - self.committed_failed)

    def buffered(self) -> int:
        """Finished this session, not committed yet (a SIGKILL loses these; dropped duplicates are not counted)."""
        return max(0, self.done + self.failed - self.committed_done - self.committed_failed
                   - self.goodput.items[DUPLICATE])

    def eta_s(self, rates: dict[str, dict[str, float]] | None = None) -> float | None:
        """Seconds until nothing is pending at the recent rate (the overall one while there is no recent)."""
        rates = rates or self.rates()
        rate = rates["recent"]["prompts_s"] or rates["overall"]["prompts_s"]
        if not self.pending():
            return 0.0
        return round(self.pending() / rate, 1) if rate > 0 else None

    # --- the periodic work --------------------------------------------------------------------------
    def tick(self, endpoints: dict[str, dict]) -> None:
        self.endpoints = endpoints
        now = time.monotonic()
        if now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self._sample(now)
            self.log_line()
        if now - self._last_status < self.status_interval_s:
            return
        self._last_status = now
        if now - self.samples[-1][0] >= 1.0:
            self._sample(now)
        if self.bar is not None:
            states = "".join(STATE_MARKS.get(e.get("state"), ".") for e in endpoints.values())
            self.bar.set_postfix_str(f"{self.tok_s():.0f} tok/s, failed {self.failed_before + self.failed}, "
                                     f"fleet [{states}]")
        self.write("running")

    def log_line(self) -> None:
        """One plain line of progress: on a terminal into the log only (the bar shows it), else to both."""
        rates = self.rates()
        recent, overall = rates["recent"], rates["overall"]
        done, failed = self.already_done + self.committed_done, self.failed_before + self.committed_failed
        share = f" ({100 * (done + failed) / self.total:.1f}%)" if self.total else ""
        fleet = ", ".join(f"{label} {e.get('state', '?')}" for label, e in self.endpoints.items())
        counted = "" if self.samples_per_prompt == 1 else f" samples ({self.samples_per_prompt} per prompt)"
        unit = "prompts" if self.samples_per_prompt == 1 else "samples"  # the rates count what the totals count
        log.info("progress: %d/%d%s done%s, %d failed, %d pending; recent %.2f %s/s %.0f tok/s (last %s), "
                 "overall %.2f %s/s %.0f tok/s; ETA %s; fleet: %s; %s", done, self.total, counted, share, failed,
                 self.pending(), recent["prompts_s"], unit, recent["tok_s"], duration(recent["window_s"]),
                 overall["prompts_s"], unit, overall["tok_s"], duration(self.eta_s(rates)), fleet or "none",
                 summary_line(self.goodput_total().as_dict()),
                 extra={"file_only": self.bar is not None})

    def status(self, state: str) -> dict[str, Any]:
        """done, failed and pending count the ledger (committed units); `buffered` what finished and waits for its
        commit; this_session's done and failed are committed too, its `finished` every outcome."""
        done = self.already_done + self.committed_done
        failed = self.failed_before + self.committed_failed
        rates = self.rates()
        return {
            "state": state,
            "updated_at": now_utc().isoformat(timespec="seconds"),
            "total": self.total,
            "samples_per_prompt": self.samples_per_prompt,
            "done": done,
            "failed": failed,
            "pending": self.pending(),
            "buffered": self.buffered(),
            "rejects": self.rejects,
            "rates": rates,
            "eta_s": self.eta_s(rates) if state == "running" else None,
            "this_session": {
                "done": self.committed_done,
                "failed": self.committed_failed,
                "finished": self.done + self.failed,
                "completion_tokens": self.completion_tokens,
                "elapsed_s": round(self.elapsed(), 1),
                "tok_s": round(self.tok_s(), 1),
            },
            "endpoints": {label: self._endpoint(label, stats) for label, stats in self.endpoints.items()},
            "goodput": self.goodput_total().as_dict(),
            **({"quality_gate": self.quality_gate} if self.quality_gate else {}),
            **({"image_prompts": {**self.image_prompts,
                                  "pending": max(0, self.image_prompts["total"] - self.image_prompts["done"]
                                                 - self.image_prompts.get("failed", 0))}}
               if self.image_prompts is not None else {}),
            **self.extra,
        }

    def _endpoint(self, label: str, stats: dict) -> dict:
        """The actor's figures, with this session's throughput counted by the driver (an actor's restart
        resets its own)."""
        counts = self.by_endpoint.get(label, {"done": 0, "failed": 0, "completion_tokens": 0})
        return {**stats, "session_done": counts["done"], "session_failed": counts["failed"],
                "session_prompts_s": round(counts["done"] / self.elapsed(), 3),
                "session_tok_s": round(counts["completion_tokens"] / self.elapsed(), 1)}

    def stopped(self) -> None:
        """The actors are gone: nothing is in flight any more."""
        self.endpoints = {label: {**stats, "in_flight": 0} for label, stats in self.endpoints.items()}

    def write(self, state: str) -> None:
        self._counted_unwritten = False
        self.run_dir.write_status(self.status(state))

    def write_keeping_last_session(self, state: str) -> None:
        """A session that sent nothing (the run was complete) keeps the figures of the last one that did: its
        rates and each endpoint's throughput stay what `regen status` shows. The counts are this session's (the
        ledger's, and the goodput summed from the parts' footers): a last session killed after its last commit
        wrote counts that miss that commit."""
        last = self.run_dir.read_status()
        status = self.status(state)
        if last and not self.done + self.failed and last.get("this_session", {}).get("elapsed_s"):
            counts = ("state", "total", "done", "failed", "pending", "buffered", "rejects", "eta_s", "image_prompts",
                      "goodput")
            status = {**{k: v for k, v in last.items() if k != "metrics_url"},
                      **{k: status[k] for k in counts if k in status},
                      "endpoints": {label: {**stats, "in_flight": 0}
                                    for label, stats in (last.get("endpoints") or {}).items()}}
        self.run_dir.write_status(status)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def records_of(mode: str, samples_per_prompt: int, run_dir: Any, units: int) -> str:
    """The end line's count: all_turns stores a record per regenerated turn, `N records (M prompts)` as the card
    says it; else `N records`."""
    what = "prompts" if samples_per_prompt == 1 else "samples"
    return f"{run_dir.record_rows()} records ({units} {what})" if mode == "all_turns" else f"{units} records"


def held_out(extra: dict) -> str:
    """The end line's word on endpoints the preflight refused and that never passed it (--start-with-passing)."""
    held = extra.get("held_out")
    return f"; {', '.join(held)} refused by the preflight throughout (held out: no work)" if held else ""
