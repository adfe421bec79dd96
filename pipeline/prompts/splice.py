"""Which cached tool result of the source answers which call of the target (all_turns). Pure: no I/O.

A step of the source called tools and has one cached result per call; the target, at that step, made its own calls.
The results answer them when the target called the same tools in the same order (`other_tool` otherwise: the rule
of every setting). Within that, each call takes, in the target's order:
1. the unused result of a source call with the same name and the same canonical arguments (JSON of an object, keys
   sorted, no spaces), so that two parallel calls of one tool whose arguments the target wrote in another order are
   never answered with each other's results;
2. else the unused result whose source call had the target call's id (Kimi's ids `functions.NAME:IDX` are the ids
   regen makes for a source without ids, so they agree when the target follows the source);
3. else the next unused result of a call to that tool, in the source's order.
A call answered at 2 or 3 got a result for other arguments: `tool_result_match: name` splices it and flags it,
`arguments` ends the conversation there.
Arguments the target wrote that are not a JSON object (not JSON, or JSON of another type: a cut call streamed, a
string) are never sent back: the conversation ends at that step (`arguments_not_object`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import orjson

from .tool_calls import canonical_json

RESULT_MATCH = ("name", "arguments")
DEFAULT_RESULT_MATCH = "name"


@dataclass(frozen=True)
class Cached:
    """A cached tool result of the source with the call it answered."""

    content: Any  # the result as the source holds it (a string, or a list of content parts)
    name: str | None
    call_id: str | None  # the source call's id
    arguments: str | None  # the source call's arguments, canonical JSON (None: unknown)


def object_arguments(arguments: Any) -> str | None:
    """A call's arguments as canonical JSON when they are a JSON object (text or an object); None otherwise."""
    if isinstance(arguments, dict):
        return canonical_json(arguments)
    if not isinstance(arguments, str):
        return None
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return canonical_json(value) if isinstance(value, dict) else None


def not_objects(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls whose arguments are not a JSON object."""
    return [c for c in calls if object_arguments((c.get("function") or {}).get("arguments")) is None]


def _name(call: dict[str, Any]) -> Any:
    return (call.get("function") or {}).get("name")


@dataclass(frozen=True)
class Pairing:
    answers: list[int]  # answers[i]: the index of the cached result that answers the target's call i
    other_arguments: list[int]  # the target's calls answered by a result for other arguments


def pair(calls: Sequence[dict[str, Any]], cached: Sequence[Cached]) -> Pairing | None:
    """The cached result of each of the target's calls (see the module doc); None when the calls name other tools,
    in another order, or another number of them."""
    if [_name(c) for c in calls] != [r.name for r in cached]:
        return None
    answers: list[int | None] = [None] * len(calls)
    used: set[int] = set()
    wanted = [object_arguments((c.get("function") or {}).get("arguments")) for c in calls]

    def take(i: int, fits) -> None:
        if answers[i] is None:
            j = next((j for j, r in enumerate(cached) if j not in used and r.name == _name(calls[i]) and fits(j)),
                     None)
            if j is not None:
                answers[i] = j
                used.add(j)

    for i in range(len(calls)):
        take(i, lambda j: wanted[i] is not None and cached[j].arguments == wanted[i])
    exact = {i for i, j in enumerate(answers) if j is not None}
    for i in range(len(calls)):
        take(i, lambda j: calls[i].get("id") not in (None, "") and cached[j].call_id == calls[i].get("id"))
    for i in range(len(calls)):
        take(i, lambda j: True)
    return Pairing([j for j in answers if j is not None], [i for i in range(len(calls)) if i not in exact])


def describe(call: dict[str, Any]) -> str:
    """`name {arguments}` of a call, its arguments cut at 80 characters."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    text = arguments if isinstance(arguments, str) else canonical_json(arguments)
    return f"{function.get('name')} {text[:80]}"
