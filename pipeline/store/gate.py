"""The early quality alarm: after the first N records of a session, the shares cut at max_tokens, cut inside the
thinking, empty or repeating are checked against thresholds (config `quality_gate*`). Pure: the run logs the
findings and, with `quality_gate: stop`, stops (exit code `quality_gate`, core/exits.py). A share that passes a
threshold costs the run that share of its tokens for as long as it goes on: the point is to say so in minutes,
not after 55 hours."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..core.errors import QualityGateStopped
from .quality import EMPTY, REPETITION, TRUNCATED_THINKING, cut_at_max_tokens


log = logging.getLogger("regen.quality")


@dataclass(frozen=True)
class Finding:
    measure: str  # truncated | truncated_thinking | empty | repetition
    records: int
    share: float
    threshold: float
    token_share: float  # the share of the sample's generated tokens these records hold
    advice: str  # the setting to change and what it will cost

    def message(self, sample: int) -> str:
        return (f"{self.records} of the first {sample} records ({100 * self.share:.1f}%, over the "
                f"{100 * self.threshold:.0f}% threshold) are {DESCRIBED[self.measure]}, holding "
                f"{100 * self.token_share:.1f}% of the tokens generated; {self.advice}")


DESCRIBED = {"truncated": "cut at max_tokens", TRUNCATED_THINKING: "cut inside the thinking",
             EMPTY: "empty", REPETITION: "repeating (a repetition loop)"}


SMALLEST_SAMPLE = 20  # fewer records say too little for a share against a threshold


def _percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0


@dataclass
class GateSample:
    """The records of the session so far, up to the gate's N: the counts the gate checks."""

    size: int  # N: the gate checks once this many records are seen
    records: int = 0
    tokens: int = 0
    hits: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in DESCRIBED})  # measure -> tokens
    uncut_lengths: list[int] = field(default_factory=list)
    checked: bool = False

    def add(self, rows: Iterable[dict[str, Any]]) -> bool:
        """Count rows while the sample is short of its size; True once it is full and not yet checked."""
        for row in rows:
            if self.records >= self.size:
                break
            tokens = row.get("completion_tokens") or 0
            flags = row.get("flags") or []
            self.records += 1
            self.tokens += tokens
            if cut_at_max_tokens(row):
                self.hits["truncated"].append(tokens)
            else:
                self.uncut_lengths.append(tokens)
            for measure in (TRUNCATED_THINKING, EMPTY, REPETITION):
                if measure in flags:
                    self.hits[measure].append(tokens)
        return self.records >= self.size and not self.checked

    def check(self, thresholds: dict[str, float], max_tokens: int) -> list[Finding]:
        self.checked = True
        findings = []
        for measure, hits in self.hits.items():
            share = len(hits) / self.records if self.records else 0.0
            if share > thresholds[measure]:
                findings.append(Finding(measure, len(hits), share, thresholds[measure],
                                        sum(hits) / self.tokens if self.tokens else 0.0,
                                        self._advice(measure, len(hits), max_tokens)))
        return findings

    def _advice(self, measure: str, hits: int, max_tokens: int) -> str:
        if measure in ("truncated", TRUNCATED_THINKING):
            raised = 2 * max_tokens
            extra = hits * (raised - max_tokens) / self.tokens if self.tokens else 0.0
            lengths = (f"the {len(self.uncut_lengths)} answers that finished used p50 "
                       f"{_percentile(self.uncut_lengths, 0.5)} / p95 {_percentile(self.uncut_lengths, 0.95)} "
                       f"tokens of max_tokens {max_tokens}; ") if self.uncut_lengths else ""
            thinking = (" (or turn the thinking down: `thinking: false` or the model's reasoning-effort "
                        "chat_template_kwargs)") if measure == TRUNCATED_THINKING else ""
            return (f"raise sampling.max_tokens{thinking}: {lengths}sampling.max_tokens {raised} would cost up to "
                    f"{100 * extra:.0f}% more tokens (if every cut answer ran to the new limit), and the default "
                    "export drops every cut record today")
        if measure == EMPTY:
            return ("look at a few records (regen export): an empty answer usually means the chat template, "
                    "`chat_template_kwargs` or the server's reasoning parser; these records are dropped by the export")
        return ("set sampling.repetition_penalty (e.g. 1.05) or raise sampling.temperature: the loops run to "
                "max_tokens, so each costs a full max_tokens of generation")


class QualityGate:
    """The run's gate: fed every committed prompt's records, it checks once its sample is full. `off`: nothing;
    `warn`: a loud warning (console and log); `stop`: the warning, then QualityGateStopped."""

    def __init__(self, action: str, size: int, thresholds: dict[str, float], max_tokens: int) -> None:
        self.action, self.thresholds, self.max_tokens = action, thresholds, max_tokens
        self.sample = GateSample(size)
        self.verdict: dict[str, Any] = {}  # for status.json: what was checked and what crossed

    def observe(self, rows: list[dict[str, Any]]) -> None:
        if self.action == "off" or not self.sample.add(rows):
            return
        self._check(ended=False)

    def finish(self) -> None:
        """The session's dispatch ran out of work before the sample was full (a run, or what was left of one,
        smaller than quality_gate_records): check what there is, if enough to say anything. Warns only: there
        is nothing left to stop."""
        if self.action == "off" or self.sample.checked or not self.sample.records:
            return
        smallest = min(SMALLEST_SAMPLE, self.sample.size)  # a quality_gate_records under 20 is the user's call
        if self.sample.records < smallest:
            log.info("quality gate: this session made %d records, too few to check (fewer than %d)",
                     self.sample.records, smallest)
            return
        log.info("quality gate: this session made %d records, fewer than quality_gate_records=%d: checking them",
                 self.sample.records, self.sample.size)
        self._check(ended=True)

    def _check(self, ended: bool) -> None:
        findings = self.sample.check(self.thresholds, self.max_tokens)
        n = self.sample.records
        self.verdict = {"action": self.action, "records": n, "passed": not findings,
                        "findings": [{"measure": f.measure, "records": f.records, "share": round(f.share, 4),
                                      "threshold": f.threshold, "message": f.message(n)} for f in findings]}
        if not findings:
            log.info("quality gate: the first %d records pass (cut at max_tokens, cut in the thinking, empty, "
                     "repeating: each under its threshold)", n)
            return
        for finding in findings:
            log.warning("QUALITY GATE: %s", finding.message(n))
        if ended:
            log.warning("QUALITY GATE: found at the end of the session's dispatch, with nothing left to stop: "
                        "change the setting before the next run")
            return
        if self.action == "stop":
            raise QualityGateStopped(
                "the quality gate stopped the run (quality_gate: stop): "
                + "; ".join(f"{f.records}/{n} {DESCRIBED[f.measure]}" for f in findings)
                + ". Change the setting named above (a change of sampling needs --new-run), or set "
                  "`quality_gate: warn` to resume this run as it is; committed records are kept")
        log.warning("QUALITY GATE: the run goes on (quality_gate: warn); `quality_gate: stop` stops it here")
