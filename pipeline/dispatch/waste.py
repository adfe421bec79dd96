"""Tokens the dispatch throws away (store/goodput.py names the purposes): late copies of finished prompts,
turns generated before a failure, and hedged copies still running when the run ends (estimated: their actor is
ended, they report nothing)."""
from __future__ import annotations

import time
from typing import Collection, Iterable

from ..core.work import DONE, Outcome
from ..store.goodput import DUPLICATE, FAILED, HEDGE_CANCELLED, RETRY, Goodput


def tokens_of(outcome: Outcome) -> int:
    if outcome.kind == DONE:
        return sum(c.completion_tokens for c in outcome.completions)
    return outcome.discarded_tokens


class ThrownAway:
    def __init__(self) -> None:
        self.goodput = Goodput()
        self.mean_tokens: float | None = None  # moving average of a finished prompt's completion tokens

    def done(self, outcome: Outcome) -> None:
        tokens = tokens_of(outcome)
        self.mean_tokens = tokens if self.mean_tokens is None else 0.9 * self.mean_tokens + 0.1 * tokens

    def late(self, outcome: Outcome) -> None:
        """An answer (or a failure) for a prompt already finished elsewhere: a hedged or re-sent copy."""
        self.goodput.add(DUPLICATE, tokens_of(outcome))

    def failed(self, outcome: Outcome, terminal: bool) -> None:
        if outcome.discarded_tokens:
            self.goodput.add(FAILED if terminal else RETRY, outcome.discarded_tokens)

    def cancelled(self, running: Iterable[tuple[str, float]], unfinished: Collection[str],
                  mean_latency: float | None) -> None:
        """Copies (prompt id, sent at) still running for prompts finished elsewhere, as their actors are ended:
        each is estimated at the mean tokens of a prompt times the share of the mean latency it ran."""
        if not self.mean_tokens:
            return
        now = time.monotonic()
        for prompt_id, sent_at in running:
            if prompt_id not in unfinished:
                ran = min(1.0, (now - sent_at) / mean_latency) if mean_latency else 1.0
                self.goodput.add(HEDGE_CANCELLED, round(self.mean_tokens * ran))
