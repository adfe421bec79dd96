"""What is sent for each regenerated turn. Pure: shared by the endpoint worker and the record builder.

`last_turn`: one request, the conversation as normalised (it ends with a user turn, or with tool results: then the
target writes the next assistant step).
`all_turns`: the source's assistant turns are dropped; the target answers each user turn with the target's own
earlier steps as history, as SpecForge's regenerator does. With tools, each step of the target is one generation
(one record): when the target calls the tool(s) that the source's next cached result(s) answer (by name, in order;
parallel calls matched call by call, splice.py), those results are spliced in under the target's own call ids and
the target writes the next step. `tool_result_match` says whether the arguments must match too: under `name` a
result spliced into a call with other arguments is counted (`Replay.spliced_other_arguments`), under `arguments` it
ends the conversation. When the target calls another tool, answers where the source called one, calls where the
source has no result left, or writes arguments that are not a JSON object, the cached results no longer apply: the
conversation ends there (`AllTurns.end` says why and at which step). A tool result is never invented.
(speculators' regeneration moves on to the next user turn after such an answer; regen stops, so that no later turn
follows a history the target did not write.)

Reasoning is never sent back for a plain answer. For the target's tool-calling steps, `tool_reasoning_history`
says which go back with their `reasoning_content` (docs/tool-calls.md):
    current_turn  the steps since the last user turn (default: DeepSeek's and Moonshot's API rule for thinking
                  with tools; Kimi-K2's template renders reasoning only after the last plain answer: unverified
                  here, the template is on the Hugging Face hub)
    every_turn    every tool-calling step of the conversation (DeepSeek V4's API rule)
    none          none (a plain answer's rule, applied to tool steps too)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import orjson

from ..core.work import unit_id
from .splice import DEFAULT_RESULT_MATCH, RESULT_MATCH, Cached, describe, not_objects, object_arguments, pair
from .tool_calls import canonical_json

REASONING_HISTORY = ("current_turn", "every_turn", "none")
DEFAULT_REASONING_HISTORY = "current_turn"

# Why an all_turns conversation with tools ended before the source's last step (`conversation_end` prefix).
END_OTHER_TOOL = "other_tool"  # the target called other tools than the cached results answer
END_ANSWERED = "answered"  # the target answered where the source called a tool
END_TRUNCATED = "truncated"  # the target was cut at max_tokens where the source called a tool, or in its own calls
END_NO_RESULT = "no_result"  # the target called a tool where the source has no result left
END_OTHER_ARGUMENTS = "other_arguments"  # tool_result_match arguments: the cached result answers other arguments
END_ARGUMENTS_NOT_OBJECT = "arguments_not_object"  # the target's arguments are not a JSON object: never sent back
END_REASONS = (END_OTHER_TOOL, END_ANSWERED, END_TRUNCATED, END_NO_RESULT, END_OTHER_ARGUMENTS,
               END_ARGUMENTS_NOT_OBJECT)
_OPTIONAL_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


class Generated(Protocol):
    """What the conversation needs of one answer (core/work.py Completion has it)."""

    content: str
    reasoning_content: str | None
    finish_reason: str
    tool_calls: list[dict] | None


# --- message forms ---------------------------------------------------------------------------------------------
def normalised(message: dict[str, Any]) -> dict[str, Any]:
    """A message as sent: role and content, plus only the tool keys it has (a `tool_calls` held as JSON text, as the
    records' MESSAGE struct keeps it, becomes the list again). A tool-free message stays exactly {role, content}."""
    out = {"role": message["role"], "content": message.get("content")}
    for key in _OPTIONAL_KEYS:
        value = message.get(key)
        if value is not None:
            out[key] = orjson.loads(value) if key == "tool_calls" and isinstance(value, str) else value
    return out


def call_of(call: dict[str, Any]) -> dict[str, Any]:
    """One of the target's calls in OpenAI form, without the stream's `index` or other extras; `arguments` stays the
    target's own text (sent back as it was written)."""
    function = call.get("function") or {}
    return {"id": call.get("id"), "type": call.get("type") or "function",
            "function": {"name": function.get("name"), "arguments": function.get("arguments")}}


def calls_json(calls: list[dict] | None) -> str | None:
    """The records' `tool_calls` column: canonical JSON of the target's calls, None when it called none."""
    return canonical_json([call_of(c) for c in calls]) if calls else None


def _names(items: Sequence[Any]) -> str:
    """The tools named by calls (OpenAI form) or cached results."""
    names = [item.name if isinstance(item, Cached) else (item.get("function") or {}).get("name") for item in items]
    return ", ".join(str(name) for name in names)


# --- the source's conversation -------------------------------------------------------------------------------
@dataclass
class _UserTurn:
    content: Any
    # The cached results of each of the source's tool-calling steps after this user message, in order: results[j]
    # answers the source's step j (one result per call, with the call it answered).
    results: list[list[Cached]] = field(default_factory=list)


def _split(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[_UserTurn]]:
    """The leading system message (if any) and the user turns with their cached tool results."""
    system = [{"role": "system", "content": m["content"]} for m in messages[:1] if m["role"] == "system"]
    turns: list[_UserTurn] = []
    calls: list[dict[str, Any]] = []  # the calls of the previous assistant step (none: it called no tool)
    for message in messages:
        role = message["role"]
        if role == "user":
            turns.append(_UserTurn(message["content"]))
            calls = []
        elif not turns:
            continue
        elif role == "assistant":
            calls = list(message.get("tool_calls") or [])
            if calls:
                turns[-1].results.append([])
        elif role == "tool" and calls:
            result = normalised(message)
            step = turns[-1].results[-1]
            # normalise gave each result its call's id; a result without one answers the calls in order
            call = next((c for c in calls if c.get("id") == result.get("tool_call_id")), None) or (
                calls[len(step)] if len(step) < len(calls) else {})
            step.append(Cached(result["content"], result.get("name"), call.get("id"),
                               object_arguments((call.get("function") or {}).get("arguments"))))
    for turn in turns:  # a call the source has no result for (it ends the conversation) leaves nothing to splice
        turn.results = [results for results in turn.results if results]
    return system, turns


def user_turns(messages: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    """The leading system message (if any) and the user turns' contents."""
    system, turns = _split(messages)
    return system, [turn.content for turn in turns]


# --- all_turns, step by step ---------------------------------------------------------------------------------
class AllTurns:
    """One prompt's all_turns conversation: `next_history()` is the next request (None: finished), `add()` takes
    what the target generated for it. Pure and deterministic, so the record builder replays what the worker sent."""

    def __init__(self, messages: Sequence[dict[str, Any]], reasoning_history: str = DEFAULT_REASONING_HISTORY,
                 result_match: str = DEFAULT_RESULT_MATCH):
        if reasoning_history not in REASONING_HISTORY:
            raise ValueError(f"tool_reasoning_history {reasoning_history!r} is not one of {REASONING_HISTORY}")
        if result_match not in RESULT_MATCH:
            raise ValueError(f"tool_result_match {result_match!r} is not one of {RESULT_MATCH}")
        self.reasoning_history, self.result_match = reasoning_history, result_match
        # (generation, calls) of each step whose calls got a cached result for other arguments (result_match name)
        self.spliced_other_arguments: list[tuple[int, int]] = []
        self.system, self.turns = _split([normalised(m) for m in messages])
        self.sent: list[tuple[int, dict[str, Any]]] = []  # (user turn, message) of the conversation so far
        self.turn = 0  # the user turn being answered
        self.step = 0  # the target's step within it
        self.generations = 0
        self.end: str | None = None  # why the conversation stopped before the source's end (None: it did not)
        self.finished = not self.turns
        self._asked = -1  # the last user turn whose message is in `sent`

    def next_history(self) -> list[dict[str, Any]] | None:
        if self.finished:
            return None
        if self._asked != self.turn:
            self._asked = self.turn
            self.sent.append((self.turn, {"role": "user", "content": self.turns[self.turn].content}))
        return [*self.system, *(self._as_sent(turn, m) for turn, m in self.sent)]

    def _as_sent(self, turn: int, message: dict[str, Any]) -> dict[str, Any]:
        if "reasoning_content" not in message:
            return message
        keep = self.reasoning_history == "every_turn" or (
            self.reasoning_history == "current_turn" and turn == self.turn)
        return message if keep else {k: v for k, v in message.items() if k != "reasoning_content"}

    def add(self, answer: Generated) -> None:
        """The target's answer to the last `next_history()`."""
        if self.finished:
            raise ValueError("the conversation has ended: no answer was asked for")
        k, self.generations = self.generations, self.generations + 1
        results = self.turns[self.turn].results
        cached = results[self.step] if self.step < len(results) else None
        calls = [call_of(c) for c in answer.tool_calls or []]
        if not calls:
            if cached is not None:
                why = END_TRUNCATED if answer.finish_reason == "length" else END_ANSWERED
                verb = "was cut at max_tokens" if why == END_TRUNCATED else "answered"
                return self._stop(f"{why}: step {k} {verb} where the source called {_names(cached)}")
            self.sent.append((self.turn, {"role": "assistant", "content": answer.content}))
            self.turn, self.step = self.turn + 1, 0
            self.finished = self.turn == len(self.turns)
            return
        odd = not_objects(calls)
        if odd:
            return self._stop(f"{END_ARGUMENTS_NOT_OBJECT}: step {k} called {describe(odd[0])}, arguments that are "
                              "not a JSON object (never sent back)")
        if answer.finish_reason == "length":  # a stream's cut call may come with arguments the server completed
            return self._stop(f"{END_TRUNCATED}: step {k} was cut at max_tokens in its calls to {_names(calls)}")
        if cached is None:
            return self._stop(f"{END_NO_RESULT}: step {k} called {_names(calls)}, the source has no result for it")
        pairing = pair(calls, cached)
        if pairing is None:
            return self._stop(f"{END_OTHER_TOOL}: step {k} called {_names(calls)}, "
                              f"the cached result answers {_names(cached)}")
        if pairing.other_arguments and self.result_match == "arguments":
            i = pairing.other_arguments[0]
            source = cached[pairing.answers[i]]
            return self._stop(f"{END_OTHER_ARGUMENTS}: step {k} called {describe(calls[i])}, the cached result "
                              f"answers {source.name} {source.arguments}")
        if pairing.other_arguments:
            self.spliced_other_arguments.append((k, len(pairing.other_arguments)))
        step = {"role": "assistant", "content": answer.content, "tool_calls": calls}
        if answer.reasoning_content:
            step["reasoning_content"] = answer.reasoning_content
        self.sent.append((self.turn, step))
        for call, j in zip(calls, pairing.answers):
            self.sent.append((self.turn, {"role": "tool", "content": cached[j].content, "tool_call_id": call["id"],
                                          "name": cached[j].name}))
        self.step += 1

    def _stop(self, why: str) -> None:
        self.end, self.finished = why, True


@dataclass(frozen=True)
class Replay:
    """A finished prompt's conversation replayed from its answers: every request in order (one per generation),
    why an all_turns conversation ended early (None: it did not), and (generation, calls) of each step whose calls
    got a cached result for other arguments."""

    sent: list[list[dict[str, Any]]]
    end: str | None = None
    spliced_other_arguments: tuple[tuple[int, int], ...] = ()

    def holds_other_arguments(self, generation: int) -> bool:
        """The request of this generation holds a cached result spliced into a call with other arguments."""
        return any(k < generation for k, _ in self.spliced_other_arguments)


def replay(mode: str, messages: Sequence[dict[str, Any]], answers: Sequence[Generated],
           reasoning_history: str = DEFAULT_REASONING_HISTORY, result_match: str = DEFAULT_RESULT_MATCH) -> Replay:
    """Replays the conversation the worker ran from its answers (the worker and the record builder share AllTurns)."""
    if mode != "all_turns":
        return Replay([[normalised(m) for m in messages]])
    conversation = AllTurns(messages, reasoning_history, result_match)
    sent = []
    for answer in answers:
        history = conversation.next_history()
        if history is None:
            raise ValueError(f"{len(answers)} answers for a conversation of {len(sent)} steps")
        sent.append(history)
        conversation.add(answer)
    return Replay(sent, conversation.end, tuple(conversation.spliced_other_arguments))


def histories(mode: str, messages: Sequence[dict[str, Any]], answers: Sequence[Generated],
              reasoning_history: str = DEFAULT_REASONING_HISTORY,
              result_match: str = DEFAULT_RESULT_MATCH) -> tuple[list[list[dict[str, Any]]], str | None]:
    """Every request of a finished prompt, in order, and why an all_turns conversation ended early (`replay`)."""
    done = replay(mode, messages, answers, reasoning_history, result_match)
    return done.sent, done.end


def seed_for(prompt_id: str, temperature: float) -> int | None:
    """At temperature > 0 the seed is derived from the prompt, so a rerun sends the same seed (SGLang reproduces
    the record from it only when launched with --enable-deterministic-inference).
    Generation k of an all_turns conversation (its turn_index: each tool-calling step counts) uses seed + k."""
    return int(prompt_id[:8], 16) & 0x7FFFFFFF if temperature > 0 else None


def sample_seed(prompt_id: str, sample_index: int | None, temperature: float) -> int | None:
    """The seed of sample `sample_index` of a prompt (samples_per_prompt). Sample 0 keeps `seed_for`; sample j > 0
    takes 31 bits of a blake2b hash of its unit id (`<prompt_id>#s<j>`), never seed + j: generation k of an
    all_turns conversation already uses its sample's seed + k."""
    if not sample_index:
        return seed_for(prompt_id, temperature)
    if temperature <= 0:
        return None
    digest = hashlib.blake2b(unit_id(prompt_id, sample_index).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF
