"""A benchmark's tool data without a conversion script (issue 30): BFCL's records as `bfcl-eval` ships them
(tests/data/bfcl), read with `field: question.0` and `tools_field: function`; a column of tool schemas that is not
carried is warned of by validate and refused by generate; schemas that are not JSON Schema are counted, and mapped
only when the spec names their dialect."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main as regen_main
from tests.helpers import one_source_config, staged_by_source_ref
from pipeline.core.config import load_config
from pipeline.prompts.adapters import at_path
from pipeline.prompts.errors import SourceError
from pipeline.prompts.schema_dialect import looks_like_tools
from pipeline.store.promptset import stage_prompt_set

BFCL = Path(__file__).resolve().parent / "data" / "bfcl" / "bfcl_sample.jsonl"
RECORDS = [json.loads(line) for line in BFCL.read_text().splitlines()]


def setup(tmp_path: Path, **spec_keys) -> str:
    return one_source_config(tmp_path, "bfcl", {"kind": "jsonl", "path": str(BFCL), "format": "openai",
                                                "id_field": "id", "field": "question.0", **spec_keys})


staged = staged_by_source_ref


def test_a_column_of_tool_schemas_not_carried_is_warned_by_validate_and_refused_by_generate(tmp_path, capsys):
    config = setup(tmp_path)
    assert regen_main(["validate", "--no-secrets", config]) == 0
    out = capsys.readouterr().out
    assert "first 7 records: 7 valid" in out
    assert "warning: the field 'function' of 6 records looks like tool schemas" in out
    assert "`tools_field: function`" in out and "`ignore_fields: [function]`" in out
    with pytest.raises(SourceError) as refused:
        stage_prompt_set(load_config(config))
    assert "'function' of 6 records looks like tool schemas" in str(refused.value)
    # told otherwise: run without them, and the field is neither counted nor refused
    rows, report = staged(setup(tmp_path, ignore_fields=["function"]))
    assert len(rows) == 7 and not any(r["tools"] for r in rows.values())
    assert "record.function" not in report.uncarried and not report.uncarried_tools
    assert report.uncarried["record.initial_config"] == 1  # multi_turn's other fields are still counted


def test_tools_field_sends_bfcl_schemas_as_given_and_counts_what_is_not_json_schema(tmp_path, capsys):
    rows, report = staged(setup(tmp_path, tools_field="function"))
    assert len(rows) == 7 and sum(1 for r in rows.values() if r["tools"]) == 6
    [tool] = json.loads(rows["simple_python_1"]["tools"])
    assert tool["function"]["name"] == "math.factorial" and tool["function"]["parameters"]["type"] == "dict"
    counts = report.tool_counts
    assert counts["schemas_with_types_not_json_schema"] == 8 and counts["tool_names_not_openai"] == 6
    assert counts["schemas_with_optional_keys"] == 3 and "schemas_mapped_from_bfcl" not in counts
    assert [m["content"] for m in rows["multi_turn_base_0"]["messages"]] == [RECORDS[-1]["question"][0][0]["content"]]
    assert regen_main(["validate", "--no-secrets", setup(tmp_path, tools_field="function")]) == 0
    assert "tool schemas that are not JSON Schema" in capsys.readouterr().out


def test_schema_dialect_bfcl_maps_the_schemas_as_bfcl_does_and_counts_them(tmp_path):
    rows, report = staged(setup(tmp_path, tools_field="function", schema_dialect="bfcl"))
    [tool] = json.loads(rows["simple_python_1"]["tools"])
    assert tool["function"]["name"] == "math_factorial" and tool["function"]["parameters"]["type"] == "object"
    [gps] = json.loads(rows["simple_python_83"]["tools"])
    coord = gps["function"]["parameters"]["properties"]["coord1"]
    assert coord["type"] == "array" and coord["items"]["type"] == "number"
    [dividend] = json.loads(rows["simple_python_128"]["tools"])
    assert "optional" not in dividend["function"]["parameters"]
    assert report.tool_counts["schemas_mapped_from_bfcl"] == 8


def test_the_tools_field_may_be_a_json_string(tmp_path):
    data = tmp_path / "strings.jsonl"
    data.write_text("".join(json.dumps({**r, "function": json.dumps(r["function"])}) + "\n"
                            for r in RECORDS if "function" in r))
    config = setup(tmp_path, tools_field="function")
    spec_file = tmp_path / "bfcl.yaml"
    spec_file.write_text(yaml.safe_dump({**yaml.safe_load(spec_file.read_text()), "path": str(data)}))
    rows, _ = staged(config)
    assert len(rows) == 6 and all(r["tools"] for r in rows.values())


def test_what_looks_like_tool_schemas():
    bare = {"name": "f", "parameters": {"type": "object"}}
    assert looks_like_tools([bare]) and looks_like_tools(json.dumps([bare]))
    assert looks_like_tools([{"type": "function", "function": bare}])
    assert not looks_like_tools([bare, {"name": "g"}])  # every item
    assert not looks_like_tools([]) and not looks_like_tools("[not json") and not looks_like_tools({"name": "f"})
    assert not looks_like_tools([{"name": "f", "parameters": "x"}]) and not looks_like_tools("plain text")


def test_field_paths_index_into_lists():
    record = {"question": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]}
    assert at_path(record, "question.1")["question.1"] == [{"role": "user", "content": "b"}]
    assert "question.2" not in at_path(record, "question.2") and "q.0" not in at_path(record, "q.0")
