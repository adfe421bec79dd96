"""What is sent for each regenerated turn. Pure: shared by the endpoint worker and the record builder.

`last_turn`: one request, the conversation as normalised (it ends with a user turn).
`all_turns`: the source's assistant turns are dropped; user turn k is sent with the target's own earlier
replies as history, as SpecForge's regenerator does. Reasoning is never sent back in history.
"""
from __future__ import annotations

from typing import Sequence


def user_turns(messages: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    """The leading system message (if any) and the user turns' contents."""
    system = [dict(m) for m in messages[:1] if m["role"] == "system"]
    return system, [m["content"] for m in messages if m["role"] == "user"]


def turn_history(system: list[dict[str, str]], users: list[str], replies: Sequence[str], k: int) -> list[dict[str, str]]:
    """Messages sent to regenerate assistant turn k (replies[:k] are the target's earlier answers)."""
    history = list(system)
    for i in range(k):
        history += [{"role": "user", "content": users[i]}, {"role": "assistant", "content": replies[i]}]
    history.append({"role": "user", "content": users[k]})
    return history


def histories(mode: str, messages: Sequence[dict[str, str]], replies: Sequence[str]) -> list[list[dict[str, str]]]:
    """Every request of a finished prompt, in order (one per regenerated turn)."""
    if mode != "all_turns":
        return [list(messages)]
    system, users = user_turns(messages)
    return [turn_history(system, users, replies, k) for k in range(len(users))]


def seed_for(prompt_id: str, temperature: float) -> int | None:
    """At temperature > 0 the seed is derived from the prompt, so a rerun sends the same seed (SGLang reproduces
    the record from it only when launched with --enable-deterministic-inference).
    Turn k of an all_turns conversation uses seed + k."""
    return int(prompt_id[:8], 16) & 0x7FFFFFFF if temperature > 0 else None
