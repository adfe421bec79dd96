"""Tool-call data exactly as the target would see it (issue 29), without a server: each of the review's repros and
code findings, as a test that failed on the code before it.

1. all_turns spliced a cached result into a call with other arguments, and recorded nothing;
2. tool results were stripped and NFC-normalised (normalise.py, and the Hermes <tool_response> reader);
3. a result whose tool_call_id and name disagree was re-labelled silently;
4. (the emulator's answer to a cut call: test_tool_fidelity_runs.py and the SGLang conformance);
5. a tool result of content parts: sent and hashed as its parts, unchanged;
6. Hermes text after a <tool_call> moved before it, uncounted;
and the code findings: target-written arguments that are not a JSON object, and the export manifest's advice for
SpecForge's parsers on a tool run.
"""
from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from pipeline.core.config import Endpoint, RunConfig, SourceRef
from pipeline.core.identity import check_identity, current_identity
from pipeline.core.work import DONE, Completion, Outcome
from pipeline.prompts.adapters import to_conversation
from pipeline.prompts.conversation import AllTurns, replay
from pipeline.prompts.normalise import normalise_record, prompt_id
from pipeline.prompts.records import InvalidRecord, RejectCode, Tally
from pipeline.prompts.sources import SourceSpec
from pipeline.store.quality import quality_flags
from pipeline.store.tool_counts import ToolCounts
from tests.helpers import handed_out

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def user(text):
    return {"role": "user", "content": text}


def calls(*pairs, first=0):
    """The source's step: (name, arguments) pairs, ids call_<k>."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{first + k}", "type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
        for k, (name, args) in enumerate(pairs)]}


def result(text, call_id, name="get_weather"):
    return {"role": "tool", "content": text, "tool_call_id": call_id, "name": name}


def answer(*pairs, text="Done.", finish=None, first=0):
    """The target's answer: Kimi-style ids; arguments as the target wrote them (a dict is dumped with spaces)."""
    tool_calls = [{"id": f"functions.{name}:{first + k}", "type": "function",
                   "function": {"name": name, "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()}}
                  for k, (name, args) in enumerate(pairs)] or None
    return Completion(content="" if tool_calls else text, reasoning_content=None,
                      finish_reason=finish or ("tool_calls" if tool_calls else "stop"), prompt_tokens=10,
                      completion_tokens=5, cached_tokens=None, reasoning_tokens=None, model="m", weight_version=None,
                      latency_s=0.1, request_id="r", tool_calls=tool_calls)


PARIS = [user("Weather in Paris?"), calls(("get_weather", {"city": "Paris"})), result("Paris: 18C, clear", "call_0"),
         {"role": "assistant", "content": "18C."}]


def config(**extra):
    return RunConfig(run_name="t", model="m", mode="all_turns", sources=[SourceRef(spec="s.yaml")],
                     endpoints=[Endpoint(url="http://127.0.0.1:1")], sampling={"temperature": 0.7}, **extra)


def records(tmp_path, messages, answers, **cfg):
    """The records the run commits for one conversation, and its outcome's end as the worker found it."""
    rows = [{"prompt_id": "a1b2c3d4e5", "source": "agent", "reference": None, "tools": orjson.dumps([WEATHER]).decode(),
             "messages": [{**m, "tool_calls": orjson.dumps(m["tool_calls"]).decode() if m.get("tool_calls") else None}
                          for m in messages]}]
    builder = handed_out(pa.Table.from_pylist(rows), config(**cfg), tmp_path, fingerprint="fp")[0]
    conversation = AllTurns(messages, result_match=cfg.get("tool_result_match", "name"))
    for a in answers:
        conversation.next_history()
        conversation.add(a)
    return builder.records(Outcome("a1b2c3d4e5", DONE, "e0", 1, list(answers),
                                   conversation_end=conversation.end), 1), builder


# --- 1. splices ------------------------------------------------------------------------------------------------
def test_a_cached_result_for_other_arguments_is_flagged_under_name_and_ends_the_conversation_under_arguments(tmp_path):
    alpha = [answer(("get_weather", {"city": "alpha"})), answer(text="It is 18C in alpha.")]
    rows, builder = records(tmp_path, PARIS, alpha)  # name: today's rule, the default
    assert [r["flags"] for r in rows] == [[], ["spliced_other_arguments"]]
    assert rows[1]["messages"][-1]["content"] == "Paris: 18C, clear" and "conversation_end" not in rows[1]
    counts = ToolCounts()
    for row in rows:
        counts.add(row)
    assert counts.as_dict()["spliced_other_arguments"] == {"conversations": 1, "records": 1}
    assert "in 1 conversations (1 records' histories hold one)" in counts.summary()
    assert builder.tool_notes.line().startswith("this session: 1 of the target's calls (in 1 steps) were answered")
    rows, _ = records(tmp_path, PARIS, alpha[:1], tool_result_match="arguments")
    assert len(rows) == 1 and rows[0]["flags"] == []
    assert rows[0]["conversation_end"] == ('other_arguments: step 0 called get_weather {"city":"alpha"}, the cached '
                                           'result answers get_weather {"city":"Paris"}')
    # the same arguments written with other spaces or key order are the same arguments
    rows, _ = records(tmp_path, PARIS, [answer(("get_weather", '{ "city" : "Paris" }')), answer()],
                      tool_result_match="arguments")
    assert [r["flags"] for r in rows] == [[], []] and "conversation_end" not in rows[-1]


def test_parallel_calls_of_one_tool_get_their_own_results_never_each_others():
    both = [user("Paris and Berlin?"), calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Berlin"})),
            result("Paris 18C", "call_0"), result("Berlin 9C", "call_1"), {"role": "assistant", "content": "."}]
    swapped = answer(("get_weather", {"city": "Berlin"}), ("get_weather", {"city": "Paris"}))
    for rule in ("name", "arguments"):
        done = replay("all_turns", both, [swapped, answer()], result_match=rule)
        assert [(m["tool_call_id"], m["content"]) for m in done.sent[1] if m["role"] == "tool"] == [
            ("functions.get_weather:0", "Berlin 9C"), ("functions.get_weather:1", "Paris 18C")]
        assert done.end is None and not done.spliced_other_arguments
    # one call exact, one not: the exact one keeps its own result, the other takes what is left (flagged)
    done = replay("all_turns", both, [answer(("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})),
                                      answer()])
    assert [m["content"] for m in done.sent[1] if m["role"] == "tool"] == ["Berlin 9C", "Paris 18C"]
    assert done.spliced_other_arguments == ((0, 1),) and done.holds_other_arguments(1)


def test_the_result_match_setting_keeps_todays_fingerprint_and_its_change_is_drift():
    default, strict = config(), config(tool_result_match="arguments")
    assert "tool_result_match" not in default.generation_identity()
    assert strict.generation_identity()["tool_result_match"] == "arguments"
    stored = current_identity(default.generation_identity(), {})
    check = check_identity({"identity_version": 2, **stored}, current_identity(strict.generation_identity(), {}),
                           refresh_prompts=True)
    assert [line.split(":")[0] for line in check.drift] == ["generation.tool_result_match"]
    with pytest.raises(ValueError, match="tool_result_match"):
        AllTurns(PARIS, result_match="exact")


# --- code finding: arguments the target wrote that are not a JSON object --------------------------------------
@pytest.mark.parametrize("arguments", ['{"city": "Par', '["Paris"]', '"Paris"'])
def test_target_arguments_that_are_not_an_object_are_flagged_counted_and_never_sent_back(tmp_path, arguments):
    rows, _ = records(tmp_path, PARIS, [answer(("get_weather", arguments))])
    assert len(rows) == 1 and "arguments_not_object" in rows[0]["flags"]
    assert rows[0]["conversation_end"].startswith(f"arguments_not_object: step 0 called get_weather {arguments}")
    counts = ToolCounts()
    counts.add(rows[0])
    assert counts.as_dict()["arguments_not_object"] == 1 and counts.cut_short == {"arguments_not_object": 1}


def test_a_call_cut_at_max_tokens_is_never_sent_back_even_with_arguments_the_server_completed():
    """SGLang streams a call cut at its `{` with the arguments `{}` (`_check_for_unstreamed_tool_args`)."""
    done = replay("all_turns", PARIS, [answer(("get_weather", {}), finish="length")])
    assert done.end == "truncated: step 0 was cut at max_tokens in its calls to get_weather" and len(done.sent) == 1


def test_a_length_answer_with_no_call_and_no_content_is_a_cut_call_where_tools_were_sent():
    """SGLang drops a call cut at max_tokens from an unstreamed answer: content is the text before the section."""
    assert quality_flags("", "I should call get_weather.", "length", 40, 40, None, True, 12) == [
        "truncated", "truncated_call"]  # the thinking ended (12 of 40 tokens): not truncated_thinking
    assert quality_flags("", None, "length", 40, 40, None, True, None) == ["truncated", "empty", "truncated_call"]
    assert quality_flags("", "Thinking", "length", 40, 40, None, True, 40) == ["truncated", "truncated_thinking"]
    assert quality_flags("", "Thinking", "length", 40, 40, None, False, 12) == ["truncated", "truncated_thinking"]
    call = [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    assert quality_flags("", "Thinking", "length", 40, 40, call, True, 12) == ["truncated"]  # streamed, args whole


# --- 2. tool results byte for byte; every change to another message counted -------------------------------------
def normalised(messages, tools=None, mode="last_turn"):
    tally = Tally()
    return normalise_record(messages, tools, mode, tally), tally


def test_tool_results_are_sent_as_written_and_every_change_to_another_message_is_counted():
    code, decomposed = "    def f(x):\n        return x\n\n", "cafe\u0301 | 18 °C  \n"
    messages = [user("  Show f.\n"), calls(("get_weather", {"city": "Paris"})), result(code, "call_0"),
                {"role": "assistant", "content": "Done. "}, user("Caf\u00e9?"), calls(("get_weather", {}), first=1),
                result(decomposed, "call_1"), {"role": "assistant", "content": "ok"}]
    done, tally = normalised(messages)
    results = [m["content"] for m in done.messages if m["role"] == "tool"]
    assert results == [code, decomposed], "a tool result is what the tool returned"
    assert done.messages[0]["content"] == "Show f." and done.messages[3]["content"] == "Done."
    assert tally.changed == {"whitespace_stripped": 2}  # the user turn and the answer: the target reads them
    nfd, tally = normalised([user("cafe\u0301 ")])
    assert nfd.messages[0]["content"] == "caf\u00e9" and tally.changed == {"whitespace_stripped": 1, "unicode_nfc": 1}
    assert prompt_id(done.messages) != prompt_id(normalised([*messages[:2], result(code.strip(), "call_0"),
                                                             *messages[3:]])[0].messages)


def test_a_hermes_tool_response_keeps_its_text_but_the_layouts_own_newlines():
    spec = SourceSpec(name="h", kind="jsonl", path="unused", format="sharegpt")
    record = {"conversations": [
        {"from": "system", "value": "<tools> [" + orjson.dumps(WEATHER["function"]).decode() + "] </tools>"},
        {"from": "human", "value": "Code?"},
        {"from": "gpt", "value": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"from": "tool", "value": "<tool_response>\n  indented\n\n</tool_response>"},
        {"from": "gpt", "value": "Done."}]}
    messages, tools = to_conversation(spec, record, Tally())
    done, _ = normalised(messages, tools)
    assert [m["content"] for m in done.messages if m["role"] == "tool"] == ["  indented\n"]


# --- 3. contradictions -----------------------------------------------------------------------------------------
def test_a_result_whose_id_and_name_name_different_calls_is_rejected_as_a_contradiction():
    step = calls(("get_weather", {"city": "Paris"}), ("get_time", {}))
    swapped = [user("Weather and time?"), step, result("12:00", "call_0", "get_time"),
               result("rain", "call_1", "get_weather")]
    with pytest.raises(InvalidRecord) as error:
        normalised(swapped)
    assert error.value.code is RejectCode.TOOL_RESULT_CONTRADICTION
    assert "call 'call_0', a call to get_weather, but names the tool 'get_time'" in error.value.reason
    twice = [user("Weather?"), calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})),
             result("rain", "call_0"), result("sun", "call_0")]
    with pytest.raises(InvalidRecord) as error:
        normalised(twice)
    assert error.value.code is RejectCode.TOOL_RESULT_CONTRADICTION and "answers already" in error.value.reason


# --- 5. content parts -------------------------------------------------------------------------------------------
def test_a_tool_result_of_content_parts_is_kept_as_its_parts_and_hashed_as_parts():
    parts = [{"type": "text", "text": "  31 degrees "}, {"type": "text", "text": ""}]
    done, tally = normalised([user("Temperature?"), calls(("get_weather", {"city": "Paris"})),
                              {"role": "tool", "tool_call_id": "call_0", "content": parts}])
    assert done.messages[-1]["content"] == parts and "structured_results_as_json" not in tally.tools
    as_text = normalised([user("Temperature?"), calls(("get_weather", {"city": "Paris"})),
                          {"role": "tool", "tool_call_id": "call_0", "content": orjson.dumps(parts).decode()}])[0]
    assert prompt_id(done.messages) != prompt_id(as_text.messages)
    spliced = replay("all_turns", done.messages, [answer(("get_weather", {"city": "Paris"})), answer()])
    assert spliced.sent[1][-1]["content"] == parts  # spliced into the target's history as the same parts


# --- 6. Hermes text after a call ---------------------------------------------------------------------------------
def test_hermes_text_after_a_call_is_counted_where_it_moves_before_the_call():
    spec = SourceSpec(name="h", kind="jsonl", path="unused", format="sharegpt")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for text, moved in ((f"Sure.\n{call}\nOne moment.", 1), (f"Sure.\n{call}", 0)):
        tally = Tally()
        messages, _ = to_conversation(spec, {"conversations": [
            {"from": "system", "value": "<tools> [" + orjson.dumps(WEATHER["function"]).decode() + "] </tools>"},
            {"from": "human", "value": "Weather?"}, {"from": "gpt", "value": text}]}, tally)
        assert tally.tools.get("hermes_text_after_call", 0) == moved
        assert messages[2]["content"] == ("Sure.\n\nOne moment." if moved else "Sure.")


# --- code finding: the manifest's advice for SpecForge's parsers -------------------------------------------------
def test_the_export_manifest_says_what_specforges_parsers_and_the_servers_parser_do_to_a_tool_run():
    from pipeline.export.templates import template_advice

    advice = template_advice("moonshotai/Kimi-K2.5")["tool_calls"]
    for words in ("GeneralParser", "tool_call_id", "## Return of ID", "kimi-k2-thinking", "with {}",
                  "arguments_not_object", "truncated_call", "specforge-tokens"):
        assert words in advice, words
