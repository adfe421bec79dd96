"""Tool data whose prompt is one field (walk of issue 30): xlam-function-calling-60k's records hold the user's
request in `query`, the tool schemas in `tools` and the expected calls in `answers`, all as JSON strings. validate
names `tools_field: tools` as the way to send the schemas; the `prompt` (and `alpaca`, `question_answer`) formats
must then take it, or the hint is a dead end and such a set needs a conversion script."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline.cli import main as regen_main
from tests.helpers import one_source_config, staged_by_source_ref

TOOLS = [{"name": "peers", "description": "Retrieves a list of company peers given a stock symbol.",
          "parameters": {"symbol": {"description": "The stock symbol for the company.", "type": "str",
                                    "default": ""}}},
         {"name": "is_prime", "description": "Checks if a number is prime.",
          "parameters": {"num": {"description": "The number to be checked.", "type": "int"}}}]
XLAM = [{"id": i, "query": q, "answers": json.dumps([{"name": "peers", "arguments": {"symbol": "TSLA"}}]),
         "tools": json.dumps(TOOLS)}
        for i, q in enumerate(["I need to understand the peers of Tesla.", "Is 97 a prime number?", "And 91?"])]


def setup(tmp_path: Path, fmt: str = "prompt", field: str = "query", **spec_keys) -> str:
    data = tmp_path / "xlam.json"
    data.write_text(json.dumps(XLAM))
    return one_source_config(tmp_path, "xlam", {"kind": "json", "path": str(data), "format": fmt, "field": field,
                                                "id_field": "id", **spec_keys})


staged = staged_by_source_ref


def test_the_hint_of_validate_is_taken_by_a_prompt_source_whose_tools_are_a_column(tmp_path, capsys):
    assert regen_main(["validate", "--no-secrets", setup(tmp_path)]) == 0
    assert "`tools_field: tools`" in capsys.readouterr().out  # what validate tells the user to write
    assert regen_main(["validate", "--no-secrets", setup(tmp_path, tools_field="tools")]) == 0
    out = capsys.readouterr().out
    assert "looks like tool schemas" not in out
    rows, report = staged(setup(tmp_path, tools_field="tools"))
    assert len(rows) == 3
    for ref, row in rows.items():
        assert [m["role"] for m in row["messages"]] == ["user"]
        assert row["messages"][0]["content"] == XLAM[int(ref)]["query"]
        assert [t["function"] for t in json.loads(row["tools"])] == TOOLS  # wrapped, kept as given
    assert report.tool_counts["prompts_with_tools"] == 3
    assert report.uncarried == {"record.answers": 3} and not report.uncarried_tools


def test_question_answer_and_alpaca_take_a_tools_field_too(tmp_path):
    for fmt, field in (("question_answer", "query"), ("alpaca", "query")):
        rows, _ = staged(setup(tmp_path, fmt=fmt, field=field, tools_field="tools"))
        assert all(json.loads(r["tools"])[0]["function"]["name"] == "peers" for r in rows.values())


def test_without_tools_field_a_prompt_source_keeps_its_ids_and_sends_no_tools(tmp_path):
    rows, report = staged(setup(tmp_path, ignore_fields=["tools"]))
    assert not any(r["tools"] for r in rows.values()) and "prompts_with_tools" not in report.tool_counts


def test_xlam_schemas_that_list_their_arguments_without_properties_are_counted_and_validate_says_so(tmp_path,
                                                                                                     capsys):
    """xlam's `parameters` name the arguments at the top level (`{"symbol": {"type": "str", ...}}`), not under
    `properties` of an object schema: not JSON Schema, and SGLang refuses one whose argument is named like a
    JSON Schema keyword (`type`, `format`) with a 400. Counted per tool, and named by validate."""
    rows, report = staged(setup(tmp_path, tools_field="tools"))
    assert report.tool_counts["schemas_with_bare_properties"] == 6  # 2 tools in each of 3 records
    assert "schemas_with_types_not_json_schema" not in report.tool_counts  # the nested "str" is under no properties
    assert regen_main(["validate", "--no-secrets", setup(tmp_path, tools_field="tools")]) == 0
    out = capsys.readouterr().out
    assert "tool schemas that are not JSON Schema: schemas_with_bare_properties 6" in out
    from pipeline.prompts.schema_dialect import findings

    def tool(parameters):
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    assert findings(tool({"type": {"type": "str", "description": "giveaway type"}})) == {"schemas_with_bare_properties"}
    for fine in ({}, {"type": "object", "properties": {"a": {"type": "string"}}}, {"properties": {"a": {}}},
                 {"type": "object"}, {"anyOf": [{"type": "object"}]}, {"$ref": "#/$defs/x", "$defs": {"x": {}}}):
        assert "schemas_with_bare_properties" not in findings(tool(fine)), fine


def test_validate_names_the_fields_it_would_not_carry(tmp_path, capsys):
    """ToolACE's records keep their tools in a top-level `system` text beside ShareGPT `conversations`; format
    sharegpt does not read that `system`, so the run sends those prompts without their tools or system prompt.
    generate's report counted it ("fields not carried: record.system"), validate, where a newcomer looks first, said
    nothing: it names the fields not carried by the first records as generate will count them."""
    data = tmp_path / "toolace.jsonl"
    data.write_text("".join(json.dumps({
        "system": "Here is a list of functions in JSON format that you can invoke: [...]",
        "conversations": [{"from": "user", "value": f"latest market trends? ({i})"},
                          {"from": "assistant", "value": '[Market Trends API(trend_type="MARKET_INDEXES")]'}]})
        + "\n" for i in range(3)))
    spec = tmp_path / "toolace.yaml"
    spec.write_text(yaml.safe_dump({"name": "toolace", "kind": "jsonl", "path": str(data), "format": "sharegpt"}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "model": "m", "sources": [{"spec": str(spec)}],
                                      "endpoints": [{"url": "http://127.0.0.1:1"}]}))
    assert regen_main(["validate", "--no-secrets", str(config)]) == 0
    assert "  fields not carried: record.system 3 (`ignore_fields` for a top-level one that does not shape the prompt)" in \
        capsys.readouterr().out
    assert regen_main(["validate", "--no-secrets", setup(tmp_path, tools_field="tools")]) == 0
    assert "fields not carried: record.answers 3" in capsys.readouterr().out
