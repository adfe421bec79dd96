"""The order of a conversation's tool-calling steps and the match of each tool result to its call (normalise.py
calls them when a conversation has tool keys). Pure: no I/O.

A result is matched to an open call of the step before it by `tool_call_id`, else by `name` (the first open call
to that tool), else by position (docs/sources-tool-calls.md). A result whose id names one call and whose name names
another tool, or a second result for a call that has one, contradicts its calls: `tool_result_contradiction`.
"""
from __future__ import annotations

from typing import Any

from .records import InvalidRecord, RejectCode, Tally
from .tool_calls import made_call_id, tool_names


def check_steps(body: list[tuple[int, dict]], tally: Tally) -> list[tuple[int, dict]]:
    """The order of turns and steps (from the first user turn on); makes missing call ids and matches each
    result to its call (filling its id and name), putting the results of a step in the calls' order."""
    out: list[tuple[int, dict]] = []
    state = "start"  # start | user | text | results (a step's calls all answered)
    pending: list[dict] = []  # the current step's calls
    answers: dict[int, tuple[int, dict]] = {}  # index in pending -> (message number, result)
    call_index = 0

    def close_step(i: int) -> None:
        nonlocal pending, answers
        missing = [c for k, c in enumerate(pending) if k not in answers]
        if missing:
            raise InvalidRecord(RejectCode.MISSING_TOOL_RESULT,
                                f"the call to {missing[0]['function']['name']} ({missing[0]['id']}) has no result "
                                f"before message {i}")
        order = [answers[k][0] for k in range(len(pending))]
        if order != sorted(order):
            tally.tool("tool_results_reordered")
        out.extend(answers[k] for k in range(len(pending)))
        pending, answers = [], {}

    for i, m in body:
        role = m["role"]
        if role == "tool":
            if not pending:
                raise InvalidRecord(RejectCode.TOOL_RESULT_WITHOUT_CALL,
                                    f"message {i} is a tool result with no call before it")
            k = _match(i, m, pending, answers)
            call = pending[k]
            answers[k] = (i, {"role": "tool", "content": m["content"], "tool_call_id": call["id"],
                              "name": call["function"]["name"]})
            if len(answers) == len(pending):
                close_step(i)
                state = "results"
            continue
        if pending:
            close_step(i)
        expected = "user" if state in ("start", "text") else "assistant"
        if role != expected:
            after = " after the tool results" if state == "results" else ""
            raise InvalidRecord(RejectCode.NOT_ALTERNATING,
                                f"roles do not alternate: message {i} is {role} where {expected}{after} was expected")
        if role == "assistant" and m.get("tool_calls"):
            ids = set()
            for call in m["tool_calls"]:
                if call["id"] is None:
                    call["id"] = made_call_id(call["function"]["name"], call_index)
                    tally.tool("made_call_ids")
                if call["id"] in ids:
                    raise InvalidRecord(RejectCode.DUPLICATE_CALL_ID,
                                        f"message {i}: two calls share the id {call['id']!r}")
                ids.add(call["id"])
                call_index += 1
            pending = m["tool_calls"]
        state = "user" if role == "user" else ("calls" if pending else "text")
        out.append((i, m))
    if pending and answers:
        close_step(body[-1][0] + 1)
    return out


def _match(i: int, result: dict, pending: list[dict], answers: dict) -> int:
    """Which of the step's unanswered calls a result answers: by its id, else by its tool's name, else the
    next in order. An id and a name that name different calls, or a second result for one call, are a
    contradiction: the record says two things about which call the result answers."""
    open_calls = [k for k in range(len(pending)) if k not in answers]
    call_id, name = result.get("tool_call_id"), result.get("name")
    if call_id is not None:
        for k, call in enumerate(pending):
            if call["id"] != call_id:
                continue
            called = call["function"]["name"]
            if name is not None and name != called:
                other = " (the tool of another call of this step)" if any(
                    c["function"]["name"] == name for c in pending) else ""
                raise InvalidRecord(RejectCode.TOOL_RESULT_CONTRADICTION,
                                    f"message {i} answers call {call_id!r}, a call to {called}, but names the tool "
                                    f"{name!r}{other}")
            if k in answers:
                raise InvalidRecord(RejectCode.TOOL_RESULT_CONTRADICTION,
                                    f"message {i} answers call {call_id!r}, which message {answers[k][0]} answers "
                                    "already")
            return k
    if not open_calls:
        raise InvalidRecord(RejectCode.TOOL_RESULT_WITHOUT_CALL,
                            f"message {i} is a tool result, but every call before it has its result")
    if call_id is not None:
        raise InvalidRecord(RejectCode.TOOL_RESULT_MISMATCH,
                            f"message {i} answers call id {call_id!r}, which no open call has")
    if name is not None:
        for k in open_calls:
            if pending[k]["function"]["name"] == name:
                return k
        raise InvalidRecord(RejectCode.TOOL_RESULT_MISMATCH,
                            f"message {i} is the result of {name!r}, which no open call names")
    return open_calls[0]


def count_tools(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...] | None, tally: Tally) -> None:
    names = tool_names(tools)
    if tools:
        tally.tool("prompts_with_tools")
    for m in messages:
        for call in m.get("tool_calls") or ():
            tally.tool("tool_calls")
            if call["function"]["name"] not in names:
                tally.tool("calls_without_schema")
        if m["role"] == "tool":
            tally.tool("tool_results")
