"""The units of work that pass between the driver and the endpoint actors. Pure data, plus the routing key a
work item carries (`affinity_key`, computed where records are built and read by dispatch/routing.py).

The unit of work is a sample: with `samples_per_prompt: k` each prompt is k units, `unit_id(prompt_id, j)`. Sample 0
is the prompt's own id (a run of k = 1 is what it always was); sample j > 0 is `<prompt_id>#s<j>`. Work items,
outcomes, the router, hedging and the ledger speak of units; records keep the prompt's id and say j in
`sample_index` (store/records.py)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def affinity_key(messages: list[dict], prefix_chars: int, tools_json: bytes | None = None) -> int:
    """A hash of the first `prefix_chars` characters of the conversation as sent (0: no affinity). The tools come
    first, as the chat templates render them (before or inside the system turn): prompts that share a tools list
    share a cached prefix. A tool-free prompt keeps the key it always had; a message's call and result fields enter
    only where present."""
    if prefix_chars <= 0:
        return 0
    text = "\x1f".join(f"{m['role']}\x1e{_text(m['content'])}" + _tool_fields(m) for m in messages)
    if tools_json is not None:
        text = f"tools\x1e{tools_json.decode()}\x1f{text}"
    text = text[:prefix_chars]
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _text(content: str | list | None) -> str:
    """A content's text for the key: a string as it is; parts as core/images.py content_text, an image as its
    sha256 (the image is in the prefix the server caches)."""
    if type(content) is not list:
        return content or ""
    return "\n".join(p["text"] if p["type"] == "text" else f"<image {p.get('sha256')}>" for p in content)


SAMPLE_SEP = "#s"


def unit_id(prompt_id: str, sample_index: int | None) -> str:
    """The id of sample `sample_index` of a prompt: the prompt's id for sample 0 (or None: a record of a run of one
    sample), `<prompt_id>#s<j>` for j > 0."""
    return prompt_id if not sample_index else f"{prompt_id}{SAMPLE_SEP}{sample_index}"


def split_unit(unit: str) -> tuple[str, int]:
    """The inverse of unit_id: (prompt_id, sample_index). A prompt id is hex, so it never holds the separator."""
    base, sep, j = unit.rpartition(SAMPLE_SEP)
    if sep and j.isdigit() and base:
        return base, int(j)
    return unit, 0


def record_unit(row: dict) -> str:
    """The unit a committed row belongs to (a record: its prompt_id and sample_index; a failure row: its prompt_id,
    which is the unit's id)."""
    return unit_id(row["prompt_id"], row.get("sample_index"))


def _tool_fields(message: dict) -> str:
    extra = [f"\x1d{key}\x1e{message[key]}" for key in ("tool_calls", "tool_call_id", "name") if message.get(key)]
    return "".join(extra)


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
    weight_versions: list[str] | None = None  # the distinct versions the server's spans name (two: mixed weights)
    deterministic: bool | None = None  # the server runs --enable-deterministic-inference (None: unknown)
    engine: str | None = None  # the endpoint's engine as the preflight identified it (sglang, vllm, llamacpp)
    engine_version: str | None = None
    # The target's tool calls as OpenAI objects ({"id", "type": "function", "function": {"name", "arguments"}},
    # `arguments` a JSON string); None: the answer called no tool.
    tool_calls: list[dict] | None = None

@dataclass(frozen=True)
class WorkItem:
    prompt_id: str
    messages_json: bytes  # orjson of the conversation; decoded only by the endpoint worker
    seed: int | None
    affinity: int = 0  # prefix-affinity key (affinity_key; dispatch/routing.py); 0: none
    tools_json: bytes | None = None  # canonical JSON of the prompt's OpenAI `tools` list; None: the prompt has none


# What became of one work item at one endpoint. DROPPED: the connection was lost mid-request (counted per prompt).
DONE, RETRY, RETURNED, TERMINAL, ENDPOINT_FATAL = "done", "retryable", "returned", "terminal", "endpoint_fatal"
DROPPED = "dropped"


@dataclass
class Outcome:
    prompt_id: str
    kind: str
    endpoint: str
    attempts: int  # attempts that count against the prompt (an unreachable endpoint does not count)
    completions: list[Completion] = field(default_factory=list)  # one per regenerated turn
    message: str = ""
    status: int | None = None
    # all_turns with tools: why the conversation ended before the source's last step (e.g. the target called
    # another tool than the cached result answers), and at which step; None: it ran to its end.
    conversation_end: str | None = None
    # A failure: completion tokens of the turns generated before it, thrown away (the prompt is run again whole)
    discarded_tokens: int = 0


@dataclass
class Exchange:
    outcomes: list[Outcome]
    demand: int  # how many more items this endpoint can take now
    state: str  # healthy | open | probing | fatal
    in_flight: int
    stats: dict = field(default_factory=dict)
