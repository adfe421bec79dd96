"""Review of issue 29's change (tool-call fidelity), the exports, BFCL and the preflight's prompt-set reading: each
finding fixed here, as a test that failed on the code before its fix."""
from __future__ import annotations

import orjson

from pipeline.prompts.adapters import to_conversation
from pipeline.prompts.normalise import normalise_record
from pipeline.prompts.records import Tally
from pipeline.prompts.sources import SourceSpec

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def hermes(tool_turn: str) -> tuple[list[dict], Tally]:
    spec = SourceSpec(name="h", kind="jsonl", path="unused", format="sharegpt")
    tally = Tally()
    messages, _ = to_conversation(spec, {"conversations": [
        {"from": "system", "value": "<tools> [" + orjson.dumps(WEATHER).decode() + "] </tools>"},
        {"from": "human", "value": "Weather?"},
        {"from": "gpt", "value": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"from": "tool", "value": tool_turn}, {"from": "gpt", "value": "Warm."}]}, tally)
    return messages, tally


def test_hermes_text_outside_the_tool_response_blocks_is_counted_where_it_is_not_sent():
    messages, tally = hermes("Result follows: <tool_response>\n31C\n</tool_response>\nEnd of results.")
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["31C"]
    assert tally.tools.get("hermes_text_outside_response") == 1
    _, clean = hermes("<tool_response>\n31C\n</tool_response>\n")  # the layout's own newline: nothing lost
    assert "hermes_text_outside_response" not in clean.tools


def test_a_result_naming_its_call_with_the_whitespace_the_call_name_had_is_not_a_contradiction():
    tally = Tally()
    done = normalise_record([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather ", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather ", "content": "x"},
        {"role": "assistant", "content": "ok"}], None, "last_turn", tally)  # accepted before issue 29
    assert done.messages[-1] == {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "get_weather"}


def test_a_result_with_a_blank_name_beside_its_call_id_is_matched_by_the_id():
    done = normalise_record([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "", "content": "x"},
        {"role": "assistant", "content": "ok"}], None, "last_turn", Tally())  # accepted before issue 29
    assert done.messages[-1] == {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "get_weather"}
