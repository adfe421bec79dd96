"""Tool-calling sources (issue 22): every shape people download becomes OpenAI messages plus a `tools` list, or
is rejected with its own reason; made call ids follow the target's convention; nothing that shapes what the
model sees is dropped without a count; tool-free prompts keep the ids they had before tool calls existed."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import orjson
import pytest

from pipeline.prompts.adapters import carried_keys, to_conversation
from pipeline.prompts.errors import NoValidPrompts
from pipeline.prompts.prompt_set import build_prompt_set, prompt_id
from pipeline.prompts.records import RejectCode, Tally
from pipeline.prompts.sources import FORMATS, SourceSpec, load_source_spec

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "prompts_sources"
OLD_IDS = json.loads((Path(__file__).parent / "data" / "tool_free_prompt_ids.json").read_text())
SGLANG_CACHE = Path(os.environ.get("REGEN_SGLANG_CACHE", Path.home() / ".cache/regen/sglang"))

WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]


def build(tmp_path: Path, records: list[dict], fmt: str = "openai", mode: str = "last_turn", **spec_keys):
    data = tmp_path / f"records-{fmt}.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    spec = SourceSpec(name="s", kind="jsonl", path=str(data), format=fmt, id_field="id", **spec_keys)
    return build_prompt_set([(spec, None)], mode=mode)


def sample(name: str, mode: str = "last_turn"):
    return build_prompt_set([(load_source_spec(SAMPLES / f"{name}.yaml"), None)], mode=mode)


def openai_record(**changes) -> dict:
    """A weather conversation in today's OpenAI form; `changes` replace its parts."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    record = {"id": "r", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": -4}'},
        {"role": "assistant", "content": "It is -4 °C in Oslo."}]}
    record.update(changes)
    return record


# --- identity --------------------------------------------------------------------------------------
def test_tool_free_prompts_keep_the_ids_computed_by_the_code_before_tool_calls(tmp_path):
    # the ids were computed by build_prompt_set before this change (tests/data/tool_free_prompt_ids.json)
    for key, ids in OLD_IDS["samples"].items():
        name, mode = key.split()
        got = {p.origin.split(":")[-1]: p.prompt_id for p in sample(name.removesuffix(".yaml"), mode).prompts}
        assert got == ids, key
    for case in OLD_IDS["records"]:
        prompts = build(tmp_path, [case["record"]], case["format"], case["mode"]).prompts
        assert prompts[0].prompt_id == case["prompt_id"], case["record"]["id"]


def test_tools_calls_and_results_name_the_prompt():
    user = {"role": "user", "content": "Weather in Oslo?"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}
    result = {"role": "tool", "content": "-4", "tool_call_id": "c", "name": "get_weather"}
    base = prompt_id([user, call, result])
    assert prompt_id([user]) != prompt_id([user], tools=TOOLS)
    assert base != prompt_id([user, call, {**result, "content": "-5"}])
    assert base != prompt_id([user, call, result], tools=TOOLS)
    assert prompt_id([user], tools=None) == prompt_id([user], tools=[]) == prompt_id([user])
    # all_turns: the source's text is regenerated, its calls and cached results are not
    with_text = [user, {**call, "content": "Let me look."}, result]
    assert prompt_id(with_text, "all_turns") == prompt_id([user, call, result], "all_turns")
    assert prompt_id([user, call, result], "all_turns") != prompt_id([user], "all_turns")


# --- the shapes ------------------------------------------------------------------------------------
def test_openai_variants_normalise_to_one_prompt(tmp_path):
    base = openai_record()
    args_object = openai_record()
    args_object["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    tools_string = openai_record(tools=json.dumps(TOOLS))
    content_left_out = openai_record()
    content_left_out["messages"][1] = {k: v for k, v in base["messages"][1].items() if k != "content"}
    prompts = build(tmp_path, [base, args_object, tools_string, content_left_out]).prompts
    assert len(prompts) == 1, "the same conversation however it is spelled"
    p = prompts[0]
    assert p.tools == tuple(TOOLS) and p.reference == "It is -4 °C in Oslo."
    assert list(p.messages) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "content": '{"temp_c": -4}', "tool_call_id": "call_1", "name": "get_weather"}]


def test_older_function_call_form_equals_the_tool_calls_form_with_made_ids(tmp_path):
    legacy = {"id": "l", "functions": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"role": "function", "name": "get_weather", "content": '{"temp_c": -4}'},
        {"role": "assistant", "content": "It is -4 °C in Oslo."}]}
    modern = openai_record()
    modern["messages"][1]["tool_calls"][0]["id"] = modern["messages"][2]["tool_call_id"] = "functions.get_weather:0"
    ps = build(tmp_path, [legacy, modern])
    assert len(ps.prompts) == 1 and ps.reports[0].duplicates == 1
    assert ps.reports[0].tool_counts["made_call_ids"] == 1


def test_hermes_and_function_call_turns_equal_their_openai_form(tmp_path):
    system = ("You are a function calling AI model. You are provided with function signatures within "
              "<tools></tools> XML tags.\n<tools> " + json.dumps(TOOLS) + " </tools>\nUse <tool_call> tags.")
    hermes = {"id": "h", "conversations": [
        {"from": "system", "value": system},
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "gpt", "value": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'},
        {"from": "tool", "value": '<tool_response>\n{"temp_c": -4}\n</tool_response>'},
        {"from": "gpt", "value": "It is -4 °C in Oslo."}]}
    literal = json.loads(json.dumps(hermes))  # hermes-function-calling-v1 writes Python dicts
    literal["id"] = "h2"
    literal["conversations"][2]["value"] = "<tool_call>\n{'arguments': {'city': 'Oslo'}, 'name': 'get_weather'}\n</tool_call>"
    factory = {"id": "f", "tools": json.dumps([WEATHER]), "conversations": [
        {"from": "system", "value": "You are a function calling AI model. You are provided with function "
                                    "signatures within <tools></tools> XML tags.\nUse <tool_call> tags."},
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": '{"temp_c": -4}'},
        {"from": "gpt", "value": "It is -4 °C in Oslo."}]}
    modern = openai_record()
    modern["messages"].insert(0, {"role": "system", "content": factory["conversations"][0]["value"]})
    modern["messages"][2]["tool_calls"][0]["id"] = modern["messages"][3]["tool_call_id"] = "functions.get_weather:0"
    expected = build(tmp_path, [modern]).prompts[0]
    ps = build(tmp_path, [hermes, literal, factory], fmt="sharegpt")
    assert [p.prompt_id for p in ps.prompts] == [expected.prompt_id], "the <tools> block moves to `tools`"
    assert ps.reports[0].duplicates == 2
    assert ps.reports[0].tool_counts["hermes_tools_blocks_moved"] == 2


def test_parallel_calls_keep_their_order_and_results_follow_it(tmp_path):
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for k, c in enumerate(("Oslo", "Rome"))]
    record = openai_record()
    record["messages"][1:3] = [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "Rome 19"},  # out of order: matched by id
        {"role": "tool", "tool_call_id": "c0", "content": "Oslo -4"}]
    ps = build(tmp_path, [record])
    results = [m for m in ps.prompts[0].messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [("c0", "Oslo -4"), ("c1", "Rome 19")]
    assert ps.reports[0].tool_counts["tool_results_reordered"] == 1


def test_made_ids_are_the_ids_sglangs_kimi_k2_detector_parses():
    """`functions.NAME:IDX`, IDX counting the conversation's calls from 0, read back by SGLang's own regex."""
    sources = sorted(SGLANG_CACHE.glob("*/sglang/srt/function_call/kimik2_detector.py"))
    patterns = [m.group(1) for f in sources
                if (m := re.search(r'tool_call_id_regex = re\.compile\(\s*r"(.+?)"\s*\)', f.read_text()))]
    if not patterns:
        why = f"no SGLang wheel with KimiK2Detector.tool_call_id_regex under {SGLANG_CACHE} (make sglang-wheels)"
        if os.environ.get("REGEN_ALLOW_MISSING_WHEELS") == "1":
            pytest.skip(why)
        pytest.fail(why)
    prompts = sample("sample_tools_sharegpt", "all_turns").prompts
    multistep = next(p for p in prompts if p.source_ref == "lf-multiturn")
    calls = [c for m in multistep.messages for c in m.get("tool_calls") or ()]
    for pattern in patterns:
        parsed = [re.match(pattern, c["id"]) for c in calls]
        assert [(m.group("name"), int(m.group("index"))) for m in parsed] == [("search", 0), ("create_event", 1)]


# --- what last_turn sends -----------------------------------------------------------------------
def test_a_source_ending_on_a_tool_result_is_sent_whole_and_the_target_answers_it():
    ps = sample("sample_tools")
    ends = next(p for p in ps.prompts if p.source_ref == "oa-ends-on-result")
    assert ends.messages[-1]["role"] == "tool" and ends.reference is None and ends.reference_tool_calls is None
    assert ps.reports[0].tool_counts["ends_on_tool_result"] == 2


def test_a_final_call_step_is_the_reference(tmp_path):
    ps = sample("sample_tools")
    p = next(p for p in ps.prompts if p.source_ref == "oa-reference-is-call")
    assert [m["role"] for m in p.messages] == ["user"] and p.reference is None
    assert json.loads(p.reference_tool_calls)[0]["function"] == {
        "name": "create_event", "arguments": '{"title":"Dentist","start":"2026-04-03T10:30:00","duration_minutes":30}'}


def test_a_call_to_a_tool_without_a_schema_is_kept_and_counted():
    ps = sample("sample_tools")
    kept = {p.source_ref for p in ps.prompts}
    assert {"oa-call-without-schema", "oa-no-tools-column"} <= kept
    assert ps.reports[0].tool_counts["calls_without_schema"] == 2
    no_column = next(p for p in ps.prompts if p.source_ref == "oa-no-tools-column")
    assert no_column.tools is None, "no tools list is made up"


# --- rejects -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("sample_tools", {
        "oa-reject-result-without-call": RejectCode.TOOL_RESULT_WITHOUT_CALL,
        "oa-reject-arguments-not-json": RejectCode.ARGUMENTS_NOT_JSON,
        "oa-reject-result-id-mismatch": RejectCode.TOOL_RESULT_MISMATCH,
        "oa-reject-missing-result": RejectCode.MISSING_TOOL_RESULT,
        "oa-reject-arguments-not-object": RejectCode.ARGUMENTS_NOT_OBJECT}),
    ("sample_tools_sharegpt", {
        "hermes-reject-call-not-json": RejectCode.ARGUMENTS_NOT_JSON,
        "hermes-reject-result-without-call": RejectCode.TOOL_RESULT_WITHOUT_CALL,
        "lf-reject-observation-first": RejectCode.TOOL_RESULT_WITHOUT_CALL,
        "lf-reject-call-without-name": RejectCode.BAD_TOOL_CALL}),
])
def test_the_samples_rejects_are_exactly_the_broken_records_each_with_its_code(name, expected):
    ps = sample(name)
    got = {json.loads(r.raw)["id"]: r.code for r in ps.rejects}
    assert got == {k: v.value for k, v in expected.items()}
    assert all(r.reason and "0x" not in r.reason for r in ps.rejects), "reasons are stable sentences"


@pytest.mark.parametrize("messages, code", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}, {"id": "a", "function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], RejectCode.DUPLICATE_CALL_ID),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "name": "g", "content": "1"}], RejectCode.TOOL_RESULT_MISMATCH),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"arguments": "{}"}}]}], RejectCode.BAD_TOOL_CALL),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}, {"id": "b", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "1"}], RejectCode.MISSING_TOOL_RESULT),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "1"},
      {"role": "user", "content": "and?"}], RejectCode.NOT_ALTERNATING),
])
def test_broken_tool_conversations_are_rejected_with_their_own_code(tmp_path, messages, code):
    ok = {"id": "ok", "messages": [{"role": "user", "content": "fine"}]}
    ps = build(tmp_path, [ok, {"id": "bad", "messages": messages}])
    assert [r.code for r in ps.rejects] == [code.value] and len(ps.prompts) == 1


def test_bad_tools_lists_are_rejected(tmp_path):
    ok = {"id": "ok", "messages": [{"role": "user", "content": "fine"}]}
    broken = [{"id": "a", "tools": "[{not json", "messages": [{"role": "user", "content": "q"}]},
              {"id": "b", "tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "q"}]},
              {"id": "c", "tools": [{"type": "code_interpreter"}], "messages": [{"role": "user", "content": "q"}]}]
    ps = build(tmp_path, [ok] + broken)
    assert [r.code for r in ps.rejects] == [RejectCode.BAD_TOOLS.value] * 3


def test_the_no_valid_prompt_hint_names_the_top_reason(tmp_path):
    records = [openai_record(id=f"r{i}") for i in range(3)]
    for r in records:
        r["messages"][2]["tool_call_id"] = "nobody"
    with pytest.raises(NoValidPrompts) as exc:
        build(tmp_path, records)
    text = str(exc.value)
    assert "tool_result_mismatch 3" in text and "do not line up with their results" in text
    assert "check the spec's kind, format and field" not in text


# --- nothing dropped silently ----------------------------------------------------------------------
EXTRA_MESSAGE_KEY = {"sharegpt": ("from", "value"), "openai": ("role", "content")}


def every_shape() -> list[tuple[str, dict]]:
    """One record of every adapter and every tool-calling shape, from the project's samples and the plain ones."""
    shapes = [("alpaca", {"id": "a", "instruction": "Name a colour.", "input": "", "output": "Red."}),
              ("prompt", {"id": "p", "prompt": "Name a colour.", "system": "Be brief."}),
              ("question_answer", {"id": "q", "question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}),
              ("input_output", {"id": "n", "input": [{"role": "user", "content": "Name a colour."}], "output": "Red.",
                                "system_prompt": "detailed thinking off"})]
    for name, fmt in (("sample_sharegpt", "sharegpt"), ("sample_messages", "openai"),
                      ("sample_tools", "openai"), ("sample_tools_sharegpt", "sharegpt")):
        path = load_source_spec(SAMPLES / f"{name}.yaml").local_path()
        for line in path.read_text().splitlines()[:30]:
            record = json.loads(line)
            if "reject" not in record["id"]:
                shapes.append((fmt, record))
    assert {fmt for fmt, _ in shapes} == set(FORMATS), "every adapter is covered"
    return shapes


@pytest.mark.parametrize("fmt, record", every_shape(), ids=lambda v: v if isinstance(v, str) else v["id"])
def test_every_adapter_counts_a_field_it_does_not_carry(tmp_path, fmt, record):
    spec = SourceSpec(name="s", kind="jsonl", path="unused", format=fmt, id_field="id")
    record = {**json.loads(json.dumps(record)), "chat_template_kwargs": {"enable_thinking": True}}
    conversation = record.get(spec.conversation_field)
    if isinstance(conversation, list):
        conversation[0]["x_annotation"] = "not carried"
    tally = Tally()
    to_conversation(spec, record, tally)
    assert tally.uncarried.get("record.chat_template_kwargs") == 1
    if isinstance(conversation, list):
        assert tally.uncarried.get("message.x_annotation") == 1
    # the rule itself: every non-empty top-level key is carried or counted
    left = {k for k, v in record.items() if v not in (None, "", [], {})} - carried_keys(spec)
    assert left == {k.removeprefix("record.") for k in tally.uncarried if k.startswith("record.")}


def raw_calls_and_results(record: dict) -> tuple[int, int]:
    """Calls and results in a record as the source wrote them, counted without regen's readers."""
    calls = results = 0
    for m in record.get("messages") or record.get("conversations"):
        role, text = m.get("role", m.get("from")), m.get("content", m.get("value"))
        calls += len(m.get("tool_calls") or []) + ("function_call" in m)
        if role in ("function_call",):
            value = json.loads(text)
            calls += len(value) if isinstance(value, list) else 1
        elif role in ("gpt", "assistant") and isinstance(text, str):
            calls += text.count("<tool_call>")
        if role in ("tool", "function", "observation"):
            n = text.count("<tool_response>") if "<tool_response>" in text else 1
            if role == "observation" and text.startswith("[") and calls > 1:
                n = len(json.loads(text))
            results += n
    return calls, results


@pytest.mark.parametrize("name", ["sample_tools", "sample_tools_sharegpt"])
def test_no_call_result_or_tools_list_is_lost(name):
    """Every kept record's calls, results and tool schemas are in its prompt (all_turns keeps all the steps)."""
    spec = load_source_spec(SAMPLES / f"{name}.yaml")
    lines = {json.loads(line)["id"]: line for line in spec.local_path().read_text().splitlines()}
    ps = sample(name, "all_turns")
    assert ps.prompts
    for p in ps.prompts:
        record = json.loads(lines[p.source_ref])
        calls = sum(len(m.get("tool_calls") or ()) for m in p.messages)
        results = sum(m["role"] == "tool" for m in p.messages)
        assert (calls, results) == raw_calls_and_results(record), p.source_ref
        names = sorted(t["function"]["name"] for t in p.tools or ())
        assert names == declared_tools(lines[p.source_ref]), p.source_ref


def declared_tools(line: str) -> list[str]:
    """The names of the tool schemas a raw record declares (a tools/functions column, or a Hermes <tools> block)."""
    record = json.loads(line)
    for key in ("tools", "functions"):
        value = record.get(key)
        if value:
            value = json.loads(value) if isinstance(value, str) else value
            return sorted(t.get("function", t)["name"] for t in value)
    system = (record.get("conversations") or [{}])[0].get("value") or ""
    block = system.split("<tools>")[-1].split("</tools>")[0] if "</tools> XML" in system and system.count("<tools>") > 1 else ""
    return sorted(re.findall(r"""['"]function['"]: \{['"]name['"]: ['"](\w+)['"]""", block))


def test_status_and_card_lines_show_the_tool_counts_and_the_fields_not_carried():
    from pipeline.prompts.report import report_lines, report_table

    ps = sample("sample_tools")
    report = ps.reports[0].as_dict()
    line = report_lines([report])[0]
    assert "; tool calls: tool_calls 20, tool_results 19, prompts_with_tools 15" in line
    assert ps.reports[0].tool_counts["made_call_ids"] == 2 and "; fields not carried: message.reasoning_content 1" in line
    row = report_table([report])[2]
    assert row.endswith("| message.reasoning_content 1 |") and "calls_without_schema 2" in row


def test_a_parquet_source_holds_tools_and_arguments_as_structs_without_the_other_rows_keys(tmp_path):
    """Arrow unifies a struct's keys across rows: each row's tool schema and arguments come back as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    calc = {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}

    def record(i: int, tool: dict, args: dict) -> dict:
        name = tool["name"]
        return {"id": f"r{i}", "tools": [{"type": "function", "function": tool}], "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "content": "42", "tool_call_id": f"c{i}"},
            {"role": "assistant", "content": "42."}]}

    rows = [record(0, WEATHER, {"city": "Oslo"}), record(1, calc, {"expression": "6*7"})]
    path = tmp_path / "tools.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert pq.read_table(path).to_pylist()[0]["tools"][0]["function"]["parameters"]["properties"]["expression"] is None
    spec = SourceSpec(name="p", kind="parquet", path=str(path), format="openai", id_field="id")
    ps = build_prompt_set([(spec, None)])
    by_ref = {p.source_ref: p for p in ps.prompts}
    assert by_ref["r0"].tools == tuple(TOOLS) and by_ref["r1"].tools == ({"type": "function", "function": calc},)
    assert by_ref["r1"].messages[1]["tool_calls"][0]["function"]["arguments"] == '{"expression":"6*7"}'
    assert ps.reports[0].tool_counts["arrow_nulls_removed"] > 0
