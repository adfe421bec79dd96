"""Blame for crashes: which prompt made the server drop its connections, or killed the endpoint actor.

A server that crashes drops every request in flight on it, and an actor that dies loses all the work it held:
the prompt that caused it cannot be told from the ones beside it. So such a crash charges nobody. A prompt hit
by ISOLATE_AFTER crashes (a poison prompt is in every crash it causes; one server killed at random rarely hits a
prompt twice) becomes a suspect and runs again alone: on one endpoint chosen for it, healthy, or half-open when
no other work is queued (the suspect is then its probe), with nothing else in flight there (the endpoint takes no
new work until it has drained). A crash during a solo run is the prompt's own and is charged; after `max_connection_drops` charged crashes the prompt is a failure row. An innocent prompt
completes on its solo run; a poison prompt is terminal after at most max_connection_drops + ISOLATE_AFTER
crashes. Suspects stay suspects until they finish, and are never hedged (a copy elsewhere would not run alone).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ..core.work import WorkItem

ISOLATE_AFTER = 2  # crashes that hit a prompt among others before it runs alone


@dataclass
class Isolation:
    queue: deque[WorkItem] = field(default_factory=deque)  # suspects waiting for their solo run
    hits: Counter[str] = field(default_factory=Counter)  # crashes that hit the prompt among others
    suspects: set[str] = field(default_factory=set)
    drops: Counter[str] = field(default_factory=Counter)  # charged: the connection dropped during a solo run
    deaths: Counter[str] = field(default_factory=Counter)  # charged: the actor died during a solo run
    endpoint: str | None = None  # the endpoint that runs suspects, one at a time
    running: str | None = None  # the suspect running alone there

    def __len__(self) -> int:
        return len(self.queue)

    def hit(self, prompt_id: str) -> None:
        """A crash hit the prompt while others ran beside it."""
        self.hits[prompt_id] += 1
        if self.hits[prompt_id] >= ISOLATE_AFTER:
            self.suspects.add(prompt_id)

    def is_solo(self, label: str, prompt_id: str) -> bool:
        return self.endpoint == label and self.running == prompt_id

    def ended(self, label: str, prompt_id: str) -> bool:
        """A prompt's run at `label` came back (or was lost). True if it was a solo run."""
        if not self.is_solo(label, prompt_id):
            return False
        self.running = None
        return True

    def requeue(self, item: WorkItem) -> bool:
        """A suspect goes back to the isolation queue (True); anything else to the router (False)."""
        if item.prompt_id not in self.suspects:
            return False
        self.queue.append(item)
        return True

    def charged(self, prompt_id: str) -> int:
        return self.drops[prompt_id] + self.deaths[prompt_id]

    def finished(self, prompt_id: str) -> None:
        self.suspects.discard(prompt_id)

    def crash_message(self, prompt_id: str, endpoint: str, last: str) -> str:
        parts = []
        if self.drops[prompt_id]:
            parts.append(f"the server dropped the connection on this prompt {self.drops[prompt_id]} times")
        if self.deaths[prompt_id]:
            parts.append(f"the actor serving it died {self.deaths[prompt_id]} times")
        return f"{' and '.join(parts)}, each time with nothing else in flight (last at {endpoint}: {last})"
