"""all_turns with tools, without Ray or HTTP: the splice of the source's cached tool results into the target's own
calls, the ways a conversation ends early, the reasoning sent back, the records of a conversation, their flags and
seeds, and the identity of the new setting. Conversations are shaped as OpenAI tool-calling data is."""
from __future__ import annotations

from dataclasses import dataclass

import orjson
import pyarrow as pa
import pytest

from pipeline.core.config import Endpoint, RunConfig, SourceRef
from pipeline.core.identity import check_identity, current_identity
from pipeline.core.work import DONE, Completion, Outcome
from pipeline.prompts.conversation import AllTurns, histories
from pipeline.prompts.tool_calls import message_from_row
from pipeline.store import schema
from pipeline.store.quality import quality_flags

from tests.helpers import handed_out

SYSTEM = {"role": "system", "content": "You are a travel agent."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def user(text):
    return {"role": "user", "content": text}


def source_calls(*names, first_id=0):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{first_id + i}", "type": "function",
         "function": {"name": name, "arguments": orjson.dumps({"city": "Paris"}).decode()}}
        for i, name in enumerate(names)]}


def result(name, text, call_id):
    return {"role": "tool", "content": text, "tool_call_id": call_id, "name": name}


def answer(text="Done.", *, calls=(), reasoning=None, finish=None, first_index=0):
    """What the target returned: Kimi-style call ids (functions.NAME:IDX) that differ from the source's."""
    tool_calls = [{"id": f"functions.{name}:{first_index + i}", "type": "function",
                   "function": {"name": name, "arguments": '{"city": "Paris"}'}} for i, name in enumerate(calls)]
    return Completion(content="" if calls else text, reasoning_content=reasoning,
                      finish_reason=finish or ("tool_calls" if calls else "stop"), prompt_tokens=10,
                      completion_tokens=5, cached_tokens=None, reasoning_tokens=None, model="m", weight_version=None,
                      latency_s=0.1, request_id="r", tool_calls=tool_calls or None)


# A real-shaped agent conversation: two sequential calls, an answer, then a second user turn answered plainly.
WEATHER = [SYSTEM, user("Weather and local time in Paris?"),
           source_calls("get_weather"), result("get_weather", "18C, clear", "call_0"),
           source_calls("get_time", first_id=1), result("get_time", "14:05", "call_1"),
           {"role": "assistant", "content": "18C and clear; it is 14:05."},
           user("Thanks! Pack an umbrella?"), {"role": "assistant", "content": "No."}]


def run(messages, answers, policy="current_turn"):
    """Drive the conversation as the worker does; returns the requests sent and the end reason."""
    conversation, sent, answers = AllTurns(messages, policy), [], list(answers)
    while (history := conversation.next_history()) is not None:
        sent.append(history)
        conversation.add(answers.pop(0))
    assert not answers, "the conversation asked for fewer answers than given"
    return sent, conversation.end


def test_following_target_gets_the_cached_results_under_its_own_call_ids():
    answers = [answer(calls=["get_weather"]), answer(calls=["get_time"], first_index=1),
               answer("18C, 14:05."), answer("No umbrella.")]
    sent, end = run(WEATHER, answers)
    assert end is None and len(sent) == 4
    assert sent[0] == [SYSTEM, user("Weather and local time in Paris?")]
    assert sent[1][2:] == [
        {"role": "assistant", "content": "", "tool_calls": answers[0].tool_calls},
        {"role": "tool", "content": "18C, clear", "tool_call_id": "functions.get_weather:0", "name": "get_weather"}]
    assert sent[2][-1] == {"role": "tool", "content": "14:05", "tool_call_id": "functions.get_time:1",
                           "name": "get_time"}
    # the second user turn sees the target's whole first turn: its calls, the spliced results, its answer
    assert sent[3][:-1] == sent[2] + [{"role": "assistant", "content": "18C, 14:05."}]
    assert sent[3][-1] == user("Thanks! Pack an umbrella?")
    assert "call_0" not in orjson.dumps(sent).decode()  # the source's own ids never reach the target


def test_parallel_calls_are_spliced_in_order_and_a_reordered_call_ends_the_conversation():
    parallel = [user("Weather and time?"), source_calls("get_weather", "get_time"),
                result("get_weather", "18C", "call_0"), result("get_time", "14:05", "call_1"),
                {"role": "assistant", "content": "18C at 14:05."}]
    sent, end = run(parallel, [answer(calls=["get_weather", "get_time"]), answer("18C at 14:05.")])
    assert end is None
    assert [(m["tool_call_id"], m["content"]) for m in sent[1] if m["role"] == "tool"] == [
        ("functions.get_weather:0", "18C"), ("functions.get_time:1", "14:05")]
    sent, end = run(parallel, [answer(calls=["get_time", "get_weather"])])
    assert len(sent) == 1 and end == ("other_tool: step 0 called get_time, get_weather, the cached result answers "
                                      "get_weather, get_time")


def test_another_tool_ends_the_conversation_where_it_was_called():
    sent, end = run(WEATHER, [answer(calls=["get_weather"]), answer(calls=["get_weather"], first_index=1)])
    assert len(sent) == 2
    assert end == "other_tool: step 1 called get_weather, the cached result answers get_time"


def test_an_answer_where_the_source_called_ends_the_conversation_and_later_user_turns_are_not_sent():
    sent, end = run(WEATHER, [answer("I cannot check the weather.")])
    assert len(sent) == 1 and end == "answered: step 0 answered where the source called get_weather"
    sent, end = run(WEATHER, [answer("It is", finish="length")])
    assert end == "truncated: step 0 was cut at max_tokens where the source called get_weather"


def test_a_call_with_no_cached_result_left_is_never_answered_with_an_invented_one():
    sent, end = run(WEATHER, [answer(calls=["get_weather"]), answer(calls=["get_time"], first_index=1),
                              answer(calls=["get_time"], first_index=2)])
    assert len(sent) == 3 and end == "no_result: step 2 called get_time, the source has no result for it"


def test_a_source_ending_on_a_tool_result_lets_the_target_write_the_next_step():
    ends_on_result = [user("Weather?"), source_calls("get_weather"), result("get_weather", "18C", "call_0")]
    sent, end = run(ends_on_result, [answer(calls=["get_weather"]), answer("18C.")])
    assert end is None and sent[1][-1]["role"] == "tool"
    last_turn, end = histories("last_turn", ends_on_result, [answer("18C.")])
    assert last_turn == [ends_on_result] and end is None  # last_turn: one request, the conversation as normalised


def test_reasoning_goes_back_with_the_current_turns_tool_steps_only_by_default():
    answers = [answer(calls=["get_weather"], reasoning="Need the weather."),
               answer(calls=["get_time"], reasoning="Now the time.", first_index=1),
               answer("18C, 14:05.", reasoning="Both known."), answer("No.")]
    reasoning = {policy: [[m.get("reasoning_content") for m in h if m["role"] == "assistant"]
                          for h in run(WEATHER, answers, policy)[0]]
                 for policy in ("current_turn", "every_turn", "none")}
    assert reasoning["current_turn"] == [[], ["Need the weather."], ["Need the weather.", "Now the time."],
                                         [None, None, None]]
    assert reasoning["every_turn"][3] == ["Need the weather.", "Now the time.", None]  # never a plain answer's
    assert reasoning["none"] == [[], [None], [None, None], [None, None, None]]


# --- records ---------------------------------------------------------------------------------------------------
def config(mode="all_turns", **extra):
    return RunConfig(run_name="t", model="m", mode=mode, sources=[SourceRef(spec="s.yaml")],
                     endpoints=[Endpoint(url="http://127.0.0.1:1")], sampling={"temperature": 0.7}, **extra)


def builder(folder, prompts, cfg):
    """A prompt set as the run stores it (messages as structs, tool_calls as JSON text; tools as JSON text), read
    back by position and handed out as the dispatcher does."""
    rows = [{"prompt_id": pid, "source": "agent", "reference": None, "tools": tools and orjson.dumps(tools).decode(),
             "messages": [{**m, "tool_calls": orjson.dumps(m["tool_calls"]).decode() if m.get("tool_calls") else None}
                          for m in messages]} for pid, messages, tools in prompts]
    return handed_out(pa.Table.from_pylist(rows), cfg, folder, fingerprint="fp")[0]


def test_records_of_a_tool_conversation_one_row_per_generation_with_calls_seeds_and_end(tmp_path):
    answers = [answer(calls=["get_weather"]), answer("I will not look up the time.")]
    rows = builder(tmp_path, [("a1b2c3d4e5", WEATHER, TOOLS)], config()).records(
        Outcome("a1b2c3d4e5", DONE, "e0", 1, answers, conversation_end="answered: step 1 answered where the source "
                                                                        "called get_time"), 1)
    assert [r["turn_index"] for r in rows] == [0, 1] and {r["n_turns"] for r in rows} == {2}
    base = int("a1b2c3d4", 16) & 0x7FFFFFFF
    assert [r["seed"] for r in rows] == [base, base + 1]  # generation k uses seed + k
    assert orjson.loads(rows[0]["tool_calls"]) == answers[0].tool_calls and "tool_calls" not in rows[1]
    assert rows[0]["flags"] == [] and rows[0]["finish_reason"] == "tool_calls"  # a pure call is not empty
    assert orjson.loads(rows[0]["tools"]) == TOOLS == orjson.loads(rows[1]["tools"])
    assert "conversation_end" not in rows[0] and rows[1]["conversation_end"].startswith("answered: step 1")
    # what was sent, in the records' message form: the call as JSON text, the result under the target's id
    assert rows[1]["messages"][2:] == [
        {"role": "assistant", "content": "", "parts": None, "tool_calls": rows[0]["tool_calls"], "tool_call_id": None,
         "name": None},
        {"role": "tool", "content": "18C, clear", "parts": None, "tool_calls": None,
         "tool_call_id": "functions.get_weather:0", "name": "get_weather"}]


def test_tool_free_all_turns_records_are_what_regen_wrote_before_tools(tmp_path):
    plain = [SYSTEM, user("Hi"), {"role": "assistant", "content": "src"}, user("Bye"),
             {"role": "assistant", "content": "src2"}]
    rows = builder(tmp_path, [("0123abcd99", plain, None)], config()).records(
        Outcome("0123abcd99", DONE, "e0", 1, [answer("Hello."), answer("Goodbye.")]), 1)
    # the histories regen sent before tool calls existed (turn_history: system, then user/own-answer pairs)
    before = [[SYSTEM, user("Hi")], [SYSTEM, user("Hi"), {"role": "assistant", "content": "Hello."}, user("Bye")]]
    assert [[message_from_row(m) for m in r["messages"]] for r in rows] == before
    assert [r["seed"] for r in rows] == [0x0123abcd, 0x0123abcd + 1]
    assert all(not {"tools", "tool_calls", "conversation_end", "sample_index"} & set(r) for r in rows)
    # a run of an older schema (resumed) writes exactly the Parquet it wrote before
    old = schema.records_schema(4)
    assert pa.Table.from_pylist(rows, schema=old).equals(
        pa.Table.from_pylist([{**r, "messages": b} for r, b in zip(rows, before)], schema=old))


def test_quality_flags_a_pure_tool_call_is_not_empty_but_an_empty_answer_still_is():
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert quality_flags("", None, "tool_calls", tool_calls=call) == []
    assert quality_flags("", None, "stop") == ["empty"]
    assert quality_flags("", None, "length", 5, 5, tool_calls=call) == ["truncated"]


# --- identity --------------------------------------------------------------------------------------------------
def test_the_reasoning_setting_keeps_todays_fingerprints_and_its_change_is_drift_both_ways():
    default, none = config(), config(tool_reasoning_history="none")
    # the keys regen's generation identity had before tool calls: the default adds none, so fingerprints stay
    assert set(default.generation_identity()) == {"model", "mode", "sampling", "explicit_sampling", "stream",
                                                  "chat_template_kwargs", "hidden_states", "return_token_ids"}
    assert default.fingerprint() != none.fingerprint()
    identity = {name: current_identity(cfg.generation_identity(), {})
                for name, cfg in (("default", default), ("none", none))}
    tool_choice = current_identity(config(tool_choice="required").generation_identity(), {})
    check = check_identity({"identity_version": 2, **identity["default"]}, tool_choice, refresh_prompts=True)
    assert [line.split(":")[0] for line in check.drift] == ["generation.tool_choice"]
    for stored, cfg in (("default", "none"), ("none", "default")):
        check = check_identity({"identity_version": 2, **identity[stored]}, identity[cfg], refresh_prompts=True)
        assert [line.split(":")[0] for line in check.drift] == ["generation.tool_reasoning_history"]
        assert check_identity({"identity_version": 2, **identity[cfg]}, identity[cfg], refresh_prompts=True).resumable


def test_an_unknown_reasoning_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_reasoning_history"):
        config(tool_reasoning_history="all")
    with pytest.raises(ValueError, match="tool_reasoning_history"):
        AllTurns(WEATHER, "sometimes")


# --- exports of tool conversations (pure) ----------------------------------------------------------------------
def test_the_per_turn_export_puts_back_the_reasoning_the_run_sent_with_earlier_tool_steps(tmp_path):
    from pipeline.export.formats import specforge_per_turn_row

    answers = [answer(calls=["get_weather"], reasoning="Need the weather."),
               answer(calls=["get_time"], reasoning="Now the time.", first_index=1), answer("18C, 14:05.")]
    rows = builder(tmp_path, [("a1b2c3d4e5", WEATHER, TOOLS)], config()).records(
        Outcome("a1b2c3d4e5", DONE, "e0", 1, answers), 1)
    by_turn = {r["turn_index"]: r["reasoning_content"] for r in rows}
    sent, _ = histories("all_turns", WEATHER, answers)
    row = specforge_per_turn_row(rows[2], by_turn.get, "current_turn")
    assert row["conversations"][:-1] == [{**m, "content": m["content"] or ""} for m in sent[2]]
    assert [m.get("reasoning_content") for m in row["conversations"] if m["role"] == "assistant"] == [
        "Need the weather.", "Now the time.", None]  # what the run sent back, then the reply (it had none)
    assert orjson.loads(row["tools"]) == TOOLS


@pytest.mark.parametrize("conversation, problem", [
    ([user("q"), {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
      {"role": "tool", "content": "r", "tool_call_id": "c"}, {"role": "assistant", "content": "a"}], None),
    ([user("q"), {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}], "expected role"),
    ([user("q"), {"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"},
      {"role": "assistant", "content": "b"}], "expected role"),
    ([user("q"), {"role": "assistant", "content": ""}], "content must be a non-empty string"),
    ([user("q"), {"role": "assistant", "content": "", "tool_calls": []}], "tool_calls must be a non-empty list"),
])
def test_the_specforge_validator_takes_tool_steps_and_refuses_a_result_without_a_call(conversation, problem):
    from pipeline.export.formats import validate_specforge_row

    problems = validate_specforge_row({"id": "x", "conversations": conversation})
    assert (problem is None and not problems) or any(problem in p for p in problems), problems
