"""Source specs, readers (JSONL, Parquet, local HF datasets) and format adapters."""
from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ConfigError
from pipeline.prompts.sources import (
    InvalidRecord, RawRecord, Reject, RejectCode, SourceSpec, load_source_spec, read_records, source_ref,
    to_messages,
)

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "prompts_sources"


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def spec(fmt: str, **kw) -> SourceSpec:
    return SourceSpec(name="t", kind="jsonl", path="x.jsonl", format=fmt, **kw)


# --- spec files ----------------------------------------------------------------------------------
def test_spec_loads_with_defaults_and_resolves_paths_against_its_own_directory(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"prompt": "Hello?"}])
    f = write_yaml(tmp_path / "src.yaml", "name: mine\nkind: jsonl\npath: data/a.jsonl\nformat: prompt\nlimit: 5\n")
    s = load_source_spec(f)
    assert (s.name, s.kind, s.format, s.split, s.subset, s.field, s.id_field, s.limit) == (
        "mine", "jsonl", "prompt", "train", None, None, None, 5)
    assert s.spec_file == f.resolve()
    monkeypatch.chdir("/")  # the working directory must not matter
    records = list(read_records(s))
    assert [r.origin for r in records] == ["data/a.jsonl:1"]


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    f = write_yaml(tmp_path / "typo.yaml", "name: a\nkind: jsonl\npath: a.jsonl\nformat: prompt\nlimt: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_source_spec(f)
    assert "'limt'" in str(exc.value) and str(f) in str(exc.value)


@pytest.mark.parametrize("line, key", [
    ("limit: ten", "limit"),
    ("limit: true", "limit"),
    ("limit: 0", "limit"),
    ("split: [train]", "split"),
    ("kind: csv", "kind"),
    ("format: chatml", "format"),
])
def test_mistyped_value_names_the_key_and_the_file(tmp_path, line, key):
    base = {"name": "name: a", "kind": "kind: jsonl", "path": "path: a.jsonl", "format": "format: prompt"}
    base[line.split(":")[0]] = line
    f = write_yaml(tmp_path / "bad.yaml", "\n".join(base.values()) + "\n")
    with pytest.raises(ConfigError) as exc:
        load_source_spec(f)
    assert f"'{key}'" in str(exc.value) and str(f) in str(exc.value)


def test_missing_required_key_names_the_key_and_the_file(tmp_path):
    f = write_yaml(tmp_path / "nofmt.yaml", "name: a\nkind: jsonl\npath: a.jsonl\n")
    with pytest.raises(ConfigError) as exc:
        load_source_spec(f)
    assert "'format'" in str(exc.value) and str(f) in str(exc.value)


def test_subset_is_refused_outside_hf(tmp_path):
    f = write_yaml(tmp_path / "s.yaml", "name: a\nkind: jsonl\npath: a.jsonl\nformat: prompt\nsubset: en\n")
    with pytest.raises(ConfigError, match="subset"):
        load_source_spec(f)


def test_production_examples_are_valid_specs():
    sg = load_source_spec(SOURCES / "sharegpt.yaml")
    uc = load_source_spec(SOURCES / "ultrachat.yaml")
    assert (sg.kind, sg.path, sg.format) == ("hf", "Aeala/ShareGPT_Vicuna_unfiltered", "sharegpt")
    assert (uc.kind, uc.path, uc.split, uc.format, uc.field, uc.id_field) == (
        "hf", "HuggingFaceH4/ultrachat_200k", "train_sft", "openai", "messages", "prompt_id")


# --- readers -------------------------------------------------------------------------------------
def test_jsonl_bad_line_is_rejected_with_file_and_line_and_reading_goes_on(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"prompt": "one"}\n{"prompt": \n\n{"prompt": "three"}\n')
    out = list(read_records(SourceSpec("s", "jsonl", str(f), "prompt")))
    assert [type(r) for r in out] == [RawRecord, Reject, RawRecord]
    assert out[1].origin.endswith("a.jsonl:2") and out[1].code == RejectCode.BAD_JSON.value
    assert out[1].raw == '{"prompt": ' and "JSON" in out[1].reason
    assert out[2].origin.endswith("a.jsonl:4") and out[2].data == {"prompt": "three"}


def test_glob_reads_every_matching_file_in_name_order(tmp_path):
    write_jsonl(tmp_path / "part-b.jsonl", [{"prompt": "b1"}])
    write_jsonl(tmp_path / "part-a.jsonl", [{"prompt": "a1"}, {"prompt": "a2"}])
    f = write_yaml(tmp_path / "g.yaml", "name: g\nkind: jsonl\npath: part-*.jsonl\nformat: prompt\n")
    out = list(read_records(load_source_spec(f)))
    assert [r.origin for r in out] == ["part-a.jsonl:1", "part-a.jsonl:2", "part-b.jsonl:1"]


@pytest.mark.parametrize("path", ["missing.jsonl", "nothing-*.jsonl"])
def test_missing_file_or_empty_glob_names_source_and_path(tmp_path, path):
    f = write_yaml(tmp_path / "m.yaml", f"name: lost\nkind: jsonl\npath: {path}\nformat: prompt\n")
    with pytest.raises(ConfigError) as exc:
        list(read_records(load_source_spec(f)))
    assert "'lost'" in str(exc.value) and path in str(exc.value)


def test_parquet_is_read_in_batches_with_row_origins(tmp_path):
    n = 2500  # more than one reader batch
    table = pa.table({"prompt": [f"Question number {i}?" for i in range(n)], "qid": list(range(n))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=700)
    s = SourceSpec("pq", "parquet", "p.parquet", "prompt", id_field="qid", spec_file=tmp_path / "pq.yaml")
    out = list(read_records(s))
    assert len(out) == n
    assert out[0].origin == "p.parquet#0" and out[-1].origin == f"p.parquet#{n - 1}"
    assert out[1234].data == {"prompt": "Question number 1234?", "qid": 1234}
    assert source_ref(s, out[1234].data) == "1234"


def test_hf_save_to_disk_dataset_is_read_by_split(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"Tell me about topic {i}."}], "prompt_id": f"u{i}"}
            for i in range(3)]
    datasets.DatasetDict({"train_sft": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "uc"))
    f = write_yaml(tmp_path / "uc.yaml",
                   "name: uc\nkind: hf\npath: uc\nsplit: train_sft\nformat: openai\nid_field: prompt_id\n")
    s = load_source_spec(f)
    out = list(read_records(s))
    assert [r.origin for r in out] == [f"uc[train_sft]#{i}" for i in range(3)]
    assert to_messages(s, out[2].data) == [{"role": "user", "content": "Tell me about topic 2."}]
    assert source_ref(s, out[2].data) == "u2"
    bad = SourceSpec("uc", "hf", "uc", "openai", split="test", spec_file=f)
    with pytest.raises(ConfigError, match="test"):
        list(read_records(bad))


def test_hf_local_directory_of_json_files_is_read_through_load_dataset(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "sg").mkdir()
    conv = [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."}]
    write_jsonl(tmp_path / "sg" / "train.jsonl", [{"id": "a", "conversations": conv}])
    s = SourceSpec("sg", "hf", str(tmp_path / "sg"), "sharegpt", id_field="id")
    out = list(read_records(s))
    assert len(out) == 1 and out[0].origin.endswith("sg[train]#0")
    assert to_messages(s, out[0].data) == [{"role": "human", "content": "Hi!"}, {"role": "gpt", "content": "Hello."}]


# --- format adapters -----------------------------------------------------------------------------
def test_sharegpt_adapter_and_field_override():
    conv = [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"}]
    assert to_messages(spec("sharegpt"), {"conversations": conv}) == [
        {"role": "system", "content": "Be kind."}, {"role": "human", "content": "Hi"}]
    assert to_messages(spec("sharegpt", field="items"), {"items": conv})[1] == {"role": "human", "content": "Hi"}
    with pytest.raises(InvalidRecord) as exc:
        to_messages(spec("sharegpt", field="items"), {"conversations": conv})
    assert exc.value.code is RejectCode.MISSING_FIELD and "'items'" in exc.value.reason


def test_openai_adapter():
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert to_messages(spec("openai"), {"messages": msgs, "other": 1}) == msgs


def test_alpaca_adapter_joins_input_and_keeps_output_as_assistant_turn():
    rec = {"instruction": "Translate to French.", "input": "Good night", "output": "Bonne nuit"}
    assert to_messages(spec("alpaca"), rec) == [
        {"role": "user", "content": "Translate to French.\n\nGood night"},
        {"role": "assistant", "content": "Bonne nuit"}]
    assert to_messages(spec("alpaca"), {"instruction": "Name a fruit.", "input": "  ", "output": ""}) == [
        {"role": "user", "content": "Name a fruit."}]
    with pytest.raises(InvalidRecord) as exc:
        to_messages(spec("alpaca"), {"instruction": "Sum these.", "input": [1, 2]})
    assert exc.value.code is RejectCode.NON_STRING_CONTENT and "'input'" in exc.value.reason


def test_prompt_adapter_with_optional_system():
    assert to_messages(spec("prompt"), {"prompt": "Why?"}) == [{"role": "user", "content": "Why?"}]
    assert to_messages(spec("prompt", field="text"), {"text": "Why?", "system": "Be brief."}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]


@pytest.mark.parametrize("fmt, data, code", [
    ("openai", ["not", "a", "dict"], RejectCode.NOT_OBJECT),
    ("openai", {"conversations": []}, RejectCode.MISSING_FIELD),
    ("openai", {"messages": "hello"}, RejectCode.BAD_CONVERSATION),
    ("openai", {"messages": ["hello"]}, RejectCode.BAD_MESSAGE),
    ("sharegpt", {"conversations": [{"value": "who am I?"}]}, RejectCode.BAD_MESSAGE),
    ("prompt", {"text": "wrong field"}, RejectCode.MISSING_FIELD),
])
def test_structural_defects_raise_invalid_record(fmt, data, code):
    with pytest.raises(InvalidRecord) as exc:
        to_messages(spec(fmt), data)
    assert exc.value.code is code and exc.value.reason


def test_source_ref_is_only_the_id_field():
    assert source_ref(spec("prompt", id_field="uid"), {"prompt": "x", "uid": 7}) == "7"
    assert source_ref(spec("prompt", id_field="uid"), {"prompt": "x"}) is None
    assert source_ref(spec("prompt"), {"prompt": "x", "uid": 7}) is None
