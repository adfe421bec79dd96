"""Which endpoint gets which prompt. Pure: no Ray, no HTTP.

Prefix affinity: SGLang's prefix cache saves prefill when requests sharing a prefix (a system prompt, a
template) land on the same server. Each prompt has an affinity key, a hash of its first N characters
(core/work.py), and rendezvous hashing maps the key to a home endpoint, so the mapping moves little when endpoints
come and go.
Each endpoint has its own queue of homed prompts.

The load-balance bound is the pull-model form of SGLang router's rule "when an endpoint is behind by more than
an absolute and a relative threshold, new work goes to the least loaded". Load is an endpoint's backlog (its
homed queue; in-flight work is capped by its concurrency anyway). When an endpoint asks for work and the longest
queue exceeds its own by more than `balance_abs` prompts and `balance_rel` times, it takes from that queue first.
Below the thresholds it takes its own, and with its own queue empty it steals from the longest: nobody idles
while work is queued anywhere, and affinity holds wherever it costs nothing.

Retries and returned work go to a shared queue, served first, and avoid the endpoint that just failed them
while another endpoint is healthy.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ..core.work import WorkItem


HOMING_CHUNK = 1 << 16  # keys scored at once (a chunk x endpoints matrix of uint64)


def _salt(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def homes(keys: list[int], labels: list[str]) -> list[str]:
    """Rendezvous (highest random weight) hashing of affinity keys over the endpoints: each key's home is the
    label with the highest mix64(key ^ salt(label)). Vectorised: a million keys are homed in about a second."""
    if not labels:
        return []
    salts = np.array([_salt(label) for label in labels], dtype=np.uint64)
    out: list[str] = []
    for start in range(0, len(keys), HOMING_CHUNK):
        chunk = np.array(keys[start:start + HOMING_CHUNK], dtype=np.uint64)
        best = _mix64(chunk[:, None] ^ salts[None, :]).argmax(axis=1)
        out += [labels[i] for i in best.tolist()]
    return out


def home_of(key: int, labels: Iterable[str]) -> str | None:
    """The home endpoint of one affinity key (`homes`)."""
    found = homes([key], list(labels))
    return found[0] if found else None


@dataclass
class Router:
    affinity: bool = True
    balance_abs: int = 32  # SGLang router's balance_abs_threshold, counted in queued prompts
    balance_rel: float = 1.5  # and its balance_rel_threshold
    shared: deque[WorkItem] = field(default_factory=deque)  # retries first, and everything without affinity
    homed: dict[str, deque[WorkItem]] = field(default_factory=dict)
    avoid: dict[str, str] = field(default_factory=dict)  # prompt_id -> the endpoint it last failed at

    def set_endpoints(self, labels: list[str]) -> None:
        """Endpoints joined or left: queues of departed endpoints are re-homed."""
        orphans = [item for label, q in self.homed.items() if label not in labels for item in q]
        self.homed = {label: self.homed.get(label, deque()) for label in labels}
        self.add(orphans)

    def add(self, items: Iterable[WorkItem]) -> None:
        """Queue items (WorkItems, or anything with a prompt_id and an affinity: run.py queues light pending
        prompts) at their homes; without affinity, in the shared queue."""
        labels = list(self.homed)
        items = list(items)
        for start in range(0, len(items), HOMING_CHUNK):
            chunk = items[start:start + HOMING_CHUNK]
            found = homes([item.affinity for item in chunk], labels) if self.affinity else []
            for item, home in zip(chunk, found or [None] * len(chunk)):
                (self.homed[home] if home and item.affinity else self.shared).append(item)

    def requeue(self, item: WorkItem, failed_at: str | None) -> None:
        if failed_at:
            self.avoid[item.prompt_id] = failed_at
        self.shared.appendleft(item)

    def forget(self, prompt_id: str) -> None:
        self.avoid.pop(prompt_id, None)

    def __len__(self) -> int:
        return len(self.shared) + sum(len(q) for q in self.homed.values())

    def take(self, label: str, n: int, is_open: callable, others_healthy: bool) -> list[WorkItem]:
        """Up to n items for `label`: shared retries, then its own queue, then stolen from the longest queue.
        `is_open(prompt_id)` says whether the prompt still needs doing (finished ones are dropped)."""
        batch: list[WorkItem] = []
        skipped: list[WorkItem] = []
        budget = 4 * n + 16  # bounded scan of retries that must avoid this endpoint
        while self.shared and len(batch) < n and budget > 0:
            budget -= 1
            item = self.shared.popleft()
            if not is_open(item.prompt_id):
                continue
            if others_healthy and self.avoid.get(item.prompt_id) == label:
                skipped.append(item)
            else:
                batch.append(item)
        self.shared.extendleft(reversed(skipped))
        own = self.homed.get(label)
        while len(batch) < n:
            behind = self._behind(len(own or ()))
            if behind is None:
                break
            item = behind.pop()  # from the tail: the endpoint behind keeps the work it is about to take
            if is_open(item.prompt_id):
                batch.append(item)
        while own and len(batch) < n:
            item = own.popleft()
            if is_open(item.prompt_id):
                batch.append(item)
        while len(batch) < n:
            victim = max((q for q in self.homed.values() if q), key=len, default=None)
            if victim is None:
                break
            item = victim.pop()
            if is_open(item.prompt_id):
                batch.append(item)
        return batch

    def _behind(self, own_load: int) -> deque[WorkItem] | None:
        """The longest queue, if it exceeds `own_load` by both thresholds."""
        longest = max(self.homed.values(), key=len, default=None)
        if longest and len(longest) - own_load > self.balance_abs and len(longest) > self.balance_rel * own_load:
            return longest
        return None
