"""A source's `limit`: the N prompts of lowest rank, chosen in one pass with memory bounded by N small entries.

The rank of a prompt is sha256(f"{seed}:{prompt_id}") (the same order as before: its hex digest compared as a
string), so the choice depends on content alone. A bounded heap keeps (rank, where the prompt waits) for the
N best so far; the prompts themselves wait in a local spill file, so memory holds no prompt's text.
"""
from __future__ import annotations

import hashlib
import heapq
import tempfile
from typing import Any, Iterator


def rank(seed: int, pid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{pid}".encode()).digest(), "big")


class BoundedSelection:
    """Offer (rank, prompt) pairs; `selected()` gives the `limit` of lowest rank, lowest first."""

    def __init__(self, limit: int, encode, decode):
        self.limit, self.encode, self.decode = limit, encode, decode
        self.heap: list[tuple[int, int, int]] = []  # (-rank, offset, length) of the best `limit` so far
        self.spill = tempfile.TemporaryFile(prefix="regen-selection-")
        self.spilled = 0

    def offer(self, prompt_rank: int, prompt: Any) -> None:
        if len(self.heap) >= self.limit and -self.heap[0][0] <= prompt_rank:
            return  # worse than every prompt kept: never selected
        blob = self.encode(prompt)
        offset = self.spill.seek(0, 2)
        self.spill.write(blob)
        self.spilled += 1
        entry = (-prompt_rank, offset, len(blob))
        if len(self.heap) < self.limit:
            heapq.heappush(self.heap, entry)
        else:
            heapq.heapreplace(self.heap, entry)

    def __len__(self) -> int:
        return len(self.heap)

    def selected(self) -> Iterator[Any]:
        for _, offset, length in sorted(self.heap, reverse=True):
            self.spill.seek(offset)
            yield self.decode(self.spill.read(length))

    def close(self) -> None:
        self.spill.close()
