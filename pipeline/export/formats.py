"""Training-row builders and the SpecForge validator. Pure: records in (dicts with the RECORDS
columns), rows out. What each library reads: docs/exports-and-training.md.

Only target-written text may become trainable:
- SpecForge conversations train on every assistant message, so a conversation row holds only
  target-written assistant messages, except a per-turn row, which is trained with
  `train_only_last_turn: true` (its history may be source-written in last_turn mode).
- Token rows carry a loss mask of 1 exactly over the tokens the target generated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import orjson

from ..core.work import record_unit
from ..store.quality import cut_at_max_tokens

Record = Mapping[str, Any]

SPECFORGE_ROLES = ("system", "user", "assistant", "tool")


def turn_id(prompt_id: str, turn_index: int) -> str:
    """SpecForge's per-turn id (scripts/expand_reasoning_conversations.py). `prompt_id`: the unit's id
    (core/work.py unit_id), so sample j > 0 of a prompt is `<prompt_id>#s<j>#turn<k>`."""
    return f"{prompt_id}#turn{turn_index}"


def conversation_id(record: Record) -> str:
    """The id of the conversation a record belongs to: its prompt's id, `<prompt_id>#s<j>` for sample j > 0 of a
    run with samples_per_prompt (sample 0's ids are what a run of one sample writes)."""
    return record_unit(record)


def speculators_id(prompt_id: str, turn_index: int) -> str:
    return f"{prompt_id}_gen{turn_index}"


def _calls(text: str | list | None) -> list[dict[str, Any]] | None:
    """Tool calls as SpecForge reads them: OpenAI objects, `arguments` the JSON text the target wrote (its parser
    parses it; records hold the list as JSON text)."""
    return orjson.loads(text) if isinstance(text, str) else text


def reply_message(record: Record) -> dict[str, Any]:
    """The regenerated assistant step, with its reasoning when the target produced any, and its tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": record["content"] or ""}
    if record.get("reasoning_content"):
        message["reasoning_content"] = record["reasoning_content"]
    if record.get("tool_calls"):
        message["tool_calls"] = _calls(record["tool_calls"])
    return message


def _sent_message(m: Mapping[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m["role"], "content": m["content"] or ""}
    if m.get("tool_calls"):
        message["tool_calls"] = _calls(m["tool_calls"])
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            message[key] = m[key]
    return message


def history(record: Record, reasoning_of: Callable[[int], str | None] | None = None,
            reasoning_history: str = "none") -> list[dict[str, Any]]:
    """The messages as sent, with their tool fields. Reasoning is never sent back with a plain answer; with a
    tool-calling step it was (the run's `tool_reasoning_history`) and the record holds it once, in the row of that
    step: `reasoning_of(j)` gives generation j's (all_turns: the j-th assistant message of a history)."""
    messages = [_sent_message(m) for m in record["messages"] or []]
    if reasoning_of is None or reasoning_history == "none":
        return messages
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    step = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if message.get("tool_calls") and (reasoning_history == "every_turn" or i > last_user):
            reasoning = reasoning_of(step)
            if reasoning:
                message["reasoning_content"] = reasoning
        step += 1
    return messages


def tools_field(record: Record) -> dict[str, str]:
    """SpecForge's `tools` column (a JSON string of the list, which its preprocessing parses), when the row has any."""
    return {"tools": record["tools"]} if record.get("tools") else {}


# --- SpecForge conversations ---------------------------------------------------------------------
def specforge_per_turn_row(record: Record, reasoning_of: Callable[[int], str | None] | None = None,
                           reasoning_history: str = "none") -> dict[str, Any]:
    """One assistant step as the last message of its own row; train with `train_only_last_turn: true`."""
    return {
        "id": turn_id(conversation_id(record), record["turn_index"]),
        "conversations": history(record, reasoning_of, reasoning_history) + [reply_message(record)],
        **tools_field(record),
        "source_id": record["prompt_id"],
        "source_ref": record.get("source_ref"),  # the source's own id of the prompt (null: none known)
        "assistant_turn_index": record["turn_index"],
    }


class HistoryMismatch(ValueError):
    """An all_turns history holds an assistant message that is not the target's reply for that turn."""


def specforge_conversation_row(turns: Sequence[Record]) -> dict[str, Any]:
    """A whole all_turns conversation from its rows, ordered by turn_index 0..k with none missing.

    The last row's history already holds the target's earlier steps (and the tool results spliced after its
    calls); each step is checked against the row of that generation, and gets that row's reasoning_content."""
    last = turns[-1]
    conversation = []
    assistant_index = 0
    for message in history(last):
        if message["role"] == "assistant":
            earlier = turns[assistant_index]
            if message["content"] != (earlier["content"] or "") or \
                    message.get("tool_calls") != _calls(earlier.get("tool_calls")):
                raise HistoryMismatch(f"{last['prompt_id']}: assistant turn {assistant_index} differs from its row")
            message = reply_message(earlier)
            assistant_index += 1
        conversation.append(message)
    if assistant_index != len(turns) - 1:
        raise HistoryMismatch(f"{last['prompt_id']}: history has {assistant_index} assistant turns, "
                              f"expected {len(turns) - 1}")
    conversation.append(reply_message(last))
    return {"id": conversation_id(last), "conversations": conversation, **tools_field(last)}


def validate_specforge_row(row: Any) -> list[str]:
    """Problems with a SpecForge conversations row (empty list: valid).

    Rules (SpecForge specforge/data/prompt_builder.py and parse.py, conversations format): `id` a string;
    `conversations` a list of {"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?,
    "name"?}; an optional leading system message, then user/assistant alternation starting with user, where
    an assistant step with `tool_calls` is followed by its `tool` results and then another assistant step
    (parse.py truncates a conversation at a tool message that follows no assistant or tool message); every
    content a non-empty string, except an assistant step that calls tools; reasoning_content, where present,
    a string. A training row also needs an assistant message to train on, so it must end with one."""
    if not isinstance(row, Mapping):
        return ["row is not an object"]
    problems = []
    if not isinstance(row.get("id"), str) or not row.get("id"):
        problems.append("id must be a non-empty string")
    conversation = row.get("conversations")
    if not isinstance(conversation, list) or not conversation:
        return problems + ["conversations must be a non-empty list"]
    expected: tuple[str, ...] = ("user",)
    for position, message in enumerate(conversation):
        where = f"conversations[{position}]"
        if not isinstance(message, Mapping):
            problems.append(f"{where} is not an object")
            continue
        role, content = message.get("role"), message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if role not in SPECFORGE_ROLES:
            problems.append(f"{where}: role {role!r} is not one of {SPECFORGE_ROLES}")
        elif role == "system":
            if position != 0:
                problems.append(f"{where}: a system message may only come first")
        elif role not in expected:
            problems.append(f"{where}: expected role {' or '.join(map(repr, expected))}, got {role!r} "
                            "(roles must alternate; tool results follow an assistant step's calls)")
        elif role == "user":
            expected = ("assistant",)
        elif role == "assistant":
            expected = ("tool",) if calls else ("user",)
        else:
            expected = ("tool", "assistant")
        if calls is not None and (not isinstance(calls, list) or not calls):
            problems.append(f"{where}: tool_calls must be a non-empty list")
        if not isinstance(content, str) or (not content.strip() and not calls):
            problems.append(f"{where}: content must be a non-empty string")
        if "reasoning_content" in message and not isinstance(message["reasoning_content"], str):
            problems.append(f"{where}: reasoning_content must be a string")
    last = conversation[-1]
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        problems.append("the conversation must end with an assistant message")
    return problems


# --- pre-tokenized rows --------------------------------------------------------------------------
def has_token_ids(record: Record) -> bool:
    return record.get("prompt_token_ids") is not None and bool(record.get("output_token_ids"))


def is_truncated(record: Record) -> bool:
    return cut_at_max_tokens(record)


def tokens_and_mask(record: Record) -> tuple[list[int], list[int]]:
    """input_ids = prompt + generated tokens; loss mask 0 over the prompt, 1 over the generated tokens, except the
    last position of a record cut at max_tokens (where a renderer would put an end-of-turn never generated)."""
    prompt, output = list(record["prompt_token_ids"]), list(record["output_token_ids"])
    mask = [0] * len(prompt) + [1] * len(output)
    if is_truncated(record) and mask:
        mask[-1] = 0
    return prompt + output, mask


def specforge_tokens_row(record: Record) -> dict[str, Any]:
    input_ids, loss_mask = tokens_and_mask(record)
    return {"id": turn_id(conversation_id(record), record["turn_index"]), "input_ids": input_ids,
            "loss_mask": loss_mask, "source_ref": record.get("source_ref")}


def speculators_row(record: Record, sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    input_ids, loss_mask = tokens_and_mask(record)
    return {
        # speculators' primary_id names a conversation (its resume keys on it): each sample is one of its own
        "id": speculators_id(conversation_id(record), record["turn_index"]),
        "primary_id": conversation_id(record),
        "source_ref": record.get("source_ref"),
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "text": record["content"] or "",
        "metadata": {
            "idx": record["turn_index"],
            "finish_reason": record["finish_reason"],
            "usage": {"prompt_tokens": record.get("prompt_tokens"),
                      "completion_tokens": record.get("completion_tokens")},
            "endpoint": record.get("endpoint"),
            "sampling_params": dict(sampling_params),
        },
    }


# Why the record filter drops a record (export/jsonl.py lists the other reasons a record is not exported).
SOURCE_NOT_SELECTED = "source_not_selected"
TRUNCATED = "truncated"
FLAGGED = "flagged"


@dataclass(frozen=True)
class Filters:
    drop_truncated: bool = False
    drop_flagged: bool = False
    sources: frozenset[str] | None = None

    def reason_to_drop(self, record: dict[str, Any]) -> str | None:
        if self.sources is not None and record.get("source") not in self.sources:
            return SOURCE_NOT_SELECTED
        if self.drop_truncated and cut_at_max_tokens(record):
            return TRUNCATED
        if self.drop_flagged and record.get("flags"):
            return FLAGGED
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"drop_truncated": self.drop_truncated, "drop_flagged": self.drop_flagged,
                "sources": sorted(self.sources) if self.sources is not None else None}
