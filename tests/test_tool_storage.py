"""Tool calls in storage (issue 22): the prompt set carries tools and the messages' tool fields, an older prompt set
still reads, records schema 5 stores them (schemas 1-4 keep role and content), and a run of an older schema
refuses prompts with tools before it writes anything."""
from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.core.config import RunConfig, load_config
from pipeline.core.errors import ConfigError
from pipeline.core.work import Completion, DONE, Outcome, affinity_key
from pipeline.prompts.prompt_set import build_prompt_set
from pipeline.prompts.sources import load_source_spec
from pipeline.prompts.tool_calls import message_from_row
from pipeline.run import GenerateOptions, materialise
from pipeline.store import schema
from pipeline.store.committer import Committer
from pipeline.store.promptset import StagedPromptSet
from pipeline.store.prompt_reader import PromptSetReader
from pipeline.store.records import RecordBuilder
from pipeline.store.rundir import RunDir
from pipeline.store.storage import Location
from tests.helpers import handed_out
from tests.helpers import open_run_as_generate as open_run

SAMPLES = Path(__file__).resolve().parent.parent / "prompts_sources"
DEAD_ENDPOINT = [{"url": "http://127.0.0.1:9", "concurrency": 1}]  # never contacted: nothing here dispatches


def config(**overrides) -> RunConfig:
    return RunConfig.model_validate({"run_name": "t", "model": "m", "sources": [{"spec": "unused.yaml"}],
                                     "endpoints": DEAD_ENDPOINT, **overrides})


def committed_prompt_set(tmp_path: Path, *names: str) -> tuple[list, pa.Table]:
    """The samples' prompts, staged and committed into a run directory as a run does, and read back."""
    prompts = [p for name in names
               for p in build_prompt_set([(load_source_spec(SAMPLES / f"{name}.yaml"), None)]).prompts]
    staged = StagedPromptSet()
    for p in prompts:
        staged.add_prompt(p)
    run = RunDir(tmp_path / "run")
    run.create()
    staged.commit(run)
    return prompts, run.load_prompt_set()


def test_the_prompt_set_carries_tools_and_sends_what_was_normalised(tmp_path):
    prompts, table = committed_prompt_set(tmp_path, "sample_tools", "sample_messages")
    assert table.schema.equals(schema.PROMPTS)
    _, items = handed_out(table, config(), tmp_path)
    with_tools = 0
    for p in prompts:
        item = items[p.prompt_id]
        assert orjson.loads(item.messages_json) == list(p.messages), p.source_ref
        if p.tools is None:
            assert item.tools_json is None
        else:
            with_tools += 1
            assert orjson.loads(item.tools_json) == list(p.tools)
            # the keys in the source's order: a schema's properties are rendered in the order they are sent
            assert item.tools_json == orjson.dumps(list(p.tools)), "JSON as written"
    assert with_tools == 15
    plain = next(p for p in prompts if p.source == "sample_messages")
    assert all(set(m) == {"role", "content"} for m in orjson.loads(items[plain.prompt_id].messages_json))
    refs = dict(zip(table.column("source_ref").to_pylist(), table.column("reference_tool_calls").to_pylist()))
    assert orjson.loads(refs["oa-reference-is-call"])[0]["function"]["name"] == "create_event"


def test_a_prompt_with_tools_is_routed_by_its_tools_and_carries_them_in_flight_without_the_set_held(tmp_path):
    prompts = build_prompt_set([(load_source_spec(SAMPLES / "sample_tools.yaml"), None)]).prompts
    staged = StagedPromptSet(affinity_chars=256)
    for p in prompts:
        staged.add_prompt(p)
    run = RunDir(tmp_path / "run")
    run.create()
    staged.commit(run)
    reader = run.prompt_set_reader(1)
    stored = {p.prompt_id: p.affinity for p in reader.pending(set(), set(), True, 256).pending}
    builder = RecordBuilder(reader, config(prefix_affinity_chars=256))
    items = {item.prompt_id: item for item in builder.work_items(reader.pending(set(), set(), True, 256).pending)}
    older = tmp_path / "older" / "prompts-000001.parquet"  # a set staged before the route_key column: keys computed
    older.parent.mkdir()
    pq.write_table(run.load_prompt_set().drop_columns(["route_key"]).replace_schema_metadata(None), older)
    computed = {p.prompt_id: p.affinity
                for p in PromptSetReader(Location.at(older)).pending(set(), set(), True, 256).pending}
    for p in prompts:
        tools = None if p.tools is None else orjson.dumps(list(p.tools))
        item = items[p.prompt_id]
        assert item.tools_json == tools, p.source_ref
        assert stored[p.prompt_id] == computed[p.prompt_id] == item.affinity, p.source_ref
        assert item.affinity == affinity_key(orjson.loads(item.messages_json), 256, tools), p.source_ref
    assert set(builder.in_flight) == set(items), "each row stays with its in-flight prompt until its record is built"
    assert any(p.tools for p in prompts) and len(set(stored.values())) > 1


def test_a_prompt_set_written_before_tool_calls_still_reads(tmp_path):
    old_message = pa.struct([("role", pa.string()), ("content", pa.string())])
    old_schema = pa.schema([("prompt_id", pa.string()), ("source", pa.string()), ("origin", pa.string()),
                            ("source_ref", pa.string()), ("messages", pa.list_(old_message)),
                            ("reference", pa.string())])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    path = tmp_path / "prompts-000001.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt_id": "p" * 32, "source": "s", "origin": "f.jsonl:1",
                                          "source_ref": None, "messages": messages, "reference": None}],
                                        schema=old_schema), path)
    item = handed_out(pq.read_table(path), config(), tmp_path / "read")[1]["p" * 32]
    assert orjson.loads(item.messages_json) == messages and item.tools_json is None


def outcome_for(prompt_id: str) -> Outcome:
    call = [{"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    completion = Completion(content="", reasoning_content=None, finish_reason="tool_calls", prompt_tokens=40,
                            completion_tokens=12, cached_tokens=None, reasoning_tokens=None, model="m",
                            weight_version=None, latency_s=0.1, request_id="r", tool_calls=call)
    return Outcome(prompt_id, DONE, "e", 1, [completion])


def test_records_schema_5_stores_the_tools_and_the_messages_tool_fields(tmp_path):
    prompts, table = committed_prompt_set(tmp_path, "sample_tools")
    p = next(p for p in prompts if p.source_ref == "oa-weather-parallel")
    rows = handed_out(table, config(), tmp_path)[0].records(outcome_for(p.prompt_id), attempts=1)
    run = RunDir(tmp_path / "records")
    run.create()
    committer = Committer(run, done=set(), flush_records=100, flush_interval_s=60,
                          records_schema=schema.records_schema(5))
    committer.add_records(rows)
    committer.flush()
    stored = run.read_table(run.data).to_pylist()[0]
    assert orjson.loads(stored["tools"]) == list(p.tools)
    assert [message_from_row(m) for m in stored["messages"]] == list(p.messages), "what was sent, tool fields too"
    assert [m["role"] for m in p.messages] == ["user", "assistant", "tool", "tool"]
    assert stored["messages"][0] == {"role": "user", "content": p.messages[0]["content"], "tool_calls": None,
                                     "tool_call_id": None, "name": None}
    assert orjson.loads(stored["messages"][1]["tool_calls"]) == p.messages[1]["tool_calls"]
    assert {"tool_calls", "sample_index", "conversation_end"} <= set(stored)


def test_records_schemas_before_5_keep_messages_of_role_and_content_only():
    for version in (None, 1, 2, 3, 4):
        records = schema.records_schema(version)
        assert records.field("messages").type == pa.list_(pa.struct([("role", pa.string()),
                                                                     ("content", pa.string())]))
        assert not {"tools", "tool_calls", "sample_index", "conversation_end"} & set(records.names)
    assert schema.records_schema(5).field("messages").type.value_type.names == [
        "role", "content", "tool_calls", "tool_call_id", "name"]


def run_with(tmp_path: Path, spec: str, schema_version: int) -> tuple[RunConfig, RunDir]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"run_name": "t", "output_dir": str(tmp_path / "out"), "model": "m",
                                    "sources": [{"spec": str(SAMPLES / f"{spec}.yaml")}],
                                    "endpoints": DEAD_ENDPOINT}))
    cfg = load_config(path)
    run_dir = RunDir(Path(cfg.output_dir) / cfg.run_name)
    open_run(cfg, GenerateOptions(str(path)), run_dir)
    run_dir.write_manifest({**run_dir.read_manifest(), "schema_version": schema_version})  # as older regen made it
    return cfg, run_dir


def test_a_run_of_an_older_schema_refuses_prompts_with_tools_and_writes_nothing(tmp_path):
    cfg, run_dir = run_with(tmp_path, "sample_tools", 4)
    with pytest.raises(ConfigError) as exc:
        materialise(cfg, run_dir, refresh=False)
    text = str(exc.value)
    # 15 prompts with a tools list and one whose calls have no schema
    assert "16 prompts" in text and "records schema 4" in text and "--new-run" in text
    assert run_dir.load_prompt_set() is None and not run_dir.prompt_set_versions()


def test_a_run_of_an_older_schema_takes_a_tool_free_prompt_set(tmp_path):
    cfg, run_dir = run_with(tmp_path, "sample_messages", 4)
    prompts = materialise(cfg, run_dir, refresh=False)
    assert prompts.num_rows > 0 and run_dir.read_manifest()["schema_version"] == 4
