"""The units of work that pass between the driver and the endpoint actors. Pure data."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    model: str
    weight_version: str | None
    latency_s: float
    request_id: str
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    hidden_part: str | None = None  # the hidden part holding this turn's states (hidden/ of the run)
    hidden_row: int | None = None

@dataclass(frozen=True)
class WorkItem:
    prompt_id: str
    messages_json: bytes  # orjson of the conversation; decoded only by the endpoint worker
    seed: int | None
    affinity: int = 0  # prefix-affinity key (routing.py); 0: none


# What became of one work item at one endpoint.
DONE, RETRY, RETURNED, TERMINAL, ENDPOINT_FATAL = "done", "retryable", "returned", "terminal", "endpoint_fatal"


@dataclass
class Outcome:
    prompt_id: str
    kind: str
    endpoint: str
    attempts: int  # attempts that count against the prompt (an unreachable endpoint does not count)
    completions: list[Completion] = field(default_factory=list)  # one per regenerated turn
    message: str = ""
    status: int | None = None


@dataclass
class Exchange:
    outcomes: list[Outcome]
    demand: int  # how many more items this endpoint can take now
    state: str  # healthy | open | probing | fatal
    in_flight: int
    stats: dict = field(default_factory=dict)
