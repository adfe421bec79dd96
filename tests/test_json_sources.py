"""The datasets people download (issue 17): JSON arrays streamed, truncated dumps, JSON named as JSON Lines,
objects holding the records, local Hugging Face files and folders. Generated files only; exact counts."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.prompts import jsonarray
from pipeline.prompts.errors import SourceError, TruncatedSource
from pipeline.prompts.prompt_set import build_prompt_set
from pipeline.prompts.sources import ReadStats, SourceSpec, load_source_spec, read_records


def conv(i: int, turns: int = 2) -> list[dict]:
    out = []
    for t in range(turns):
        out += [{"from": "human", "value": f"Question {i}.{t}: why is the sky blue, \"really\"? {{[]}}"},
                {"from": "gpt", "value": f"Answer {i}.{t}: Rayleigh scattering \u00e9\u4e16."}]
    return out


# 6 records: 4 distinct valid, 1 duplicate of the first, 1 whose roles do not alternate
ROWS = [{"id": f"r{i}", "conversations": conv(i)} for i in range(4)]
ROWS += [{"id": "dup", "conversations": conv(0)},
         {"id": "bad", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}]


def record_ends(text: bytes) -> list[int]:
    """An independent oracle: the byte just after each record of a JSON array, from the stdlib's raw_decode."""
    s = text.decode("utf-8")
    decoder, i, ends = json.JSONDecoder(), s.index("[") + 1, []
    while True:
        while s[i] in " \n\r\t,":
            i += 1
        if s[i] == "]":
            return ends
        _, i = decoder.raw_decode(s, i)
        ends.append(len(s[:i].encode("utf-8")))


def spec_for(path: Path, kind: str = "json", **kw) -> SourceSpec:
    return SourceSpec(name="sg", kind=kind, path=str(path), format="sharegpt", id_field="id", **kw)


def counts(ps) -> tuple:
    (r,) = ps.reports
    return (r.read, r.valid, r.rejected, r.rejected_by_reason, r.selected, r.duplicates)


EXPECTED = (6, 5, 1, {"roles_not_alternating": 1}, 4, 1)


@pytest.mark.parametrize("layout", ["pretty", "one_line", "bom"])
def test_a_json_array_is_streamed_with_exact_counts(tmp_path, layout):
    text = json.dumps(ROWS, indent=2, ensure_ascii=False).encode() if layout == "pretty" else orjson.dumps(ROWS)
    if layout == "bom":
        text = b"\xef\xbb\xbf" + text
    f = tmp_path / "sharegpt.json"
    f.write_bytes(text)
    ps = build_prompt_set([(spec_for(f), None)])
    assert counts(ps) == EXPECTED
    assert [p.source_ref for p in ps.prompts] == ["r0", "r1", "r2", "r3"], "file order without a limit"
    assert ps.prompts[1].origin.endswith("sharegpt.json#1") and ps.prompts[1].reference.startswith("Answer 1.1")
    assert ps.reports[0].containers == {str(f): "JSON array"}
    (reject,) = ps.rejects
    assert reject.origin.endswith("sharegpt.json#5") and reject.code == "roles_not_alternating"


def test_the_c_backend_parses_and_a_missing_one_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    assert jsonarray.backend().backend_name == "yajl2_c"
    f = tmp_path / "a.json"
    f.write_bytes(orjson.dumps(ROWS))
    real = jsonarray.ijson.get_backend

    def no_c(name):
        if name == "yajl2_c":
            raise ImportError("no module named ijson.backends._yajl2")
        return real(name)

    monkeypatch.setattr(jsonarray.ijson, "get_backend", no_c)
    jsonarray.backend.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="regen"):
            assert counts(build_prompt_set([(spec_for(f), None)])) == EXPECTED
        assert jsonarray.backend().backend_name == "python"
        assert any("yajl2_c is not available" in r.getMessage() for r in caplog.records)
    finally:
        jsonarray.backend.cache_clear()


@pytest.mark.parametrize("layout", ["pretty", "one_line"])
def test_a_truncated_array_names_the_file_and_the_last_complete_record(tmp_path, layout):
    text = json.dumps(ROWS, indent=2).encode() if layout == "pretty" else orjson.dumps(ROWS)
    ends = record_ends(text)
    cut_at = ends[3] + 40  # inside record #4
    f = tmp_path / "dump.json"
    f.write_bytes(text[:cut_at])
    with pytest.raises(TruncatedSource) as exc:
        build_prompt_set([(spec_for(f), None)])
    message = str(exc.value)
    assert str(f) in message and f"its 4 complete records end at byte {ends[3]:,}" in message
    assert "salvage: true" in message and f"drop the last {cut_at - ends[3]:,} bytes" in message
    assert "\n" not in message


@pytest.mark.parametrize("layout", ["pretty", "one_line"])
def test_salvage_keeps_every_complete_record_and_reports_the_cut(tmp_path, layout):
    text = json.dumps(ROWS, indent=2).encode() if layout == "pretty" else orjson.dumps(ROWS)
    ends = record_ends(text)
    cut_at = ends[4] + 7  # inside record #5 (the bad one): 5 complete records, one of them a duplicate
    f = tmp_path / "dump.json"
    f.write_bytes(text[:cut_at])
    ps = build_prompt_set([(spec_for(f, salvage=True), None)])
    assert counts(ps) == (5, 5, 0, {}, 4, 1)
    assert ps.reports[0].cuts == [{"file": str(f), "offset": ends[4], "records_kept": 5, "bytes_dropped": 7,
                                   "size": cut_at, "problem": "ends in the middle of a record", "unclosed": False}]


@pytest.mark.parametrize("tail", [b"", b",", b",\n  ", b"]"])
def test_a_cut_right_after_a_complete_record_says_nothing_is_lost(tmp_path, monkeypatch, tail):
    """Regression: a dump cut just after a record (here exactly at a parser chunk's end) said 'drop 0 bytes'."""
    text = orjson.dumps({"data": ROWS}) if tail == b"]" else orjson.dumps(ROWS)
    end = record_ends(text[text.index(b"["):])[3] + text.index(b"[")
    monkeypatch.setattr(jsonarray, "CHUNK_BYTES", end)  # the record ends where a chunk ends
    f = tmp_path / "dump.json"
    f.write_bytes(text[:end] + tail)
    field = {"records_field": "data"} if tail == b"]" else {}
    with pytest.raises(TruncatedSource) as exc:
        build_prompt_set([(spec_for(f, **field), None)])
    message = str(exc.value)
    assert "ends right after a complete record, without its closing brackets" in message
    assert "keep the 4 complete records and lose nothing of a record" in message and "drop" not in message
    ps = build_prompt_set([(spec_for(f, salvage=True, **field), None)])
    assert ps.reports[0].read == 4
    [cut] = ps.reports[0].cuts
    assert cut["unclosed"] and cut["offset"] == end and cut["bytes_dropped"] == len(tail)
    from pipeline.prompts.report import report_lines
    assert "lost nothing of a record" in "\n".join(report_lines([ps.reports[0].as_dict()]))


def test_invalid_json_before_the_end_is_a_cut_at_the_exact_byte(tmp_path):
    records = [orjson.dumps(r) for r in ROWS]
    text = b"[" + b",".join(records[:2]) + b", @" + b",".join(records[2:]) + b"]"
    f = tmp_path / "broken.json"
    f.write_bytes(text)
    with pytest.raises(TruncatedSource) as exc:
        build_prompt_set([(spec_for(f), None)])
    assert exc.value.cut.error_at == text.index(b"@") and exc.value.cut.offset == 1 + len(records[0]) + 1 + len(
        records[1])
    assert "is not valid JSON at byte" in str(exc.value)
    ps = build_prompt_set([(spec_for(f, salvage=True), None)])
    assert counts(ps)[:2] == (2, 2) and ps.reports[0].cuts[0]["records_kept"] == 2


def test_a_cut_is_found_exactly_across_parser_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonarray, "CHUNK_BYTES", 64)  # records span many chunks
    text = json.dumps(ROWS, indent=2).encode()
    ends = record_ends(text)
    f = tmp_path / "dump.json"
    f.write_bytes(text[:ends[2] + 300])
    stats = ReadStats()
    out = list(read_records(spec_for(f, salvage=True), stats))
    assert len(out) == 3 and stats.cuts[0].offset == ends[2]


@pytest.mark.parametrize("doc, field", [
    ({"version": 2, "data": ROWS}, "data"),
    ({"meta": {"n": 6, "tags": ["a"]}, "splits": {"train": ROWS, "test": []}}, "splits.train"),
])
def test_an_object_holding_the_array_under_a_field(tmp_path, doc, field):
    f = tmp_path / "obj.json"
    f.write_bytes(json.dumps(doc, indent=1).encode())
    ps = build_prompt_set([(spec_for(f, records_field=field), None)])
    assert counts(ps) == EXPECTED
    assert ps.reports[0].containers == {str(f): f"JSON object, records under {field!r}"}


def test_an_object_without_records_field_names_the_key_to_set(tmp_path):
    f = tmp_path / "obj.json"
    f.write_bytes(json.dumps({"version": 2, "count": 6, "data": ROWS}, indent=1).encode())
    with pytest.raises(SourceError) as exc:
        list(read_records(spec_for(f)))
    assert "is a JSON object, not an array" in str(exc.value) and "records_field: data" in str(exc.value)
    with pytest.raises(SourceError, match="no records under 'rows'"):
        list(read_records(spec_for(f, records_field="rows")))


def test_kind_json_on_json_lines_says_kind_jsonl(tmp_path):
    f = tmp_path / "lines.json"
    f.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    with pytest.raises(SourceError, match="is JSON Lines .*use `kind: jsonl`"):
        list(read_records(spec_for(f)))


BIG = {"id": "big", "conversations": [{"from": "human", "value": "x" * 1_100_000}, {"from": "gpt", "value": "a"}]}
JSONL_SHAPES = {  # JSON Lines saved as .json that a window of the first bytes misread as one object
    "blank_first_line": b"\n" + b"".join(orjson.dumps(r) + b"\n" for r in ROWS),
    "first_record_over_1mb": b"".join(orjson.dumps(r) + b"\n" for r in [BIG, *ROWS]),
    "single_record": orjson.dumps(ROWS[0]) + b"\n",
}


@pytest.mark.parametrize("shape", sorted(JSONL_SHAPES))
def test_json_lines_named_json_is_told_apart_by_its_values(tmp_path, shape):
    f = tmp_path / "train.json"
    f.write_bytes(JSONL_SHAPES[shape])
    with pytest.raises(SourceError) as exc:
        list(read_records(spec_for(f)))
    assert "train.json is JSON Lines (one record per line)" in str(exc.value) and "use `kind: jsonl`" in str(exc.value)
    n = len(JSONL_SHAPES[shape].split(b"\n")) - 1 - (shape == "blank_first_line")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "train.json").write_bytes(JSONL_SHAPES[shape])
    ps = build_prompt_set([(spec_for(tmp_path / "hf" / "train.json", kind="hf"), None)])  # read as JSON Lines
    assert ps.reports[0].read == n and ps.reports[0].rejected == (1 if n > 1 else 0)


def test_json_lines_with_records_field_is_named_json_lines(tmp_path):
    f = tmp_path / "lines.json"
    f.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    with pytest.raises(SourceError, match="is JSON Lines .*use `kind: jsonl` without `records_field`"):
        list(read_records(spec_for(f, records_field="conversations")))


def test_an_object_holding_records_under_the_conversation_field_is_still_an_object(tmp_path):
    f = tmp_path / "obj.json"
    f.write_bytes(orjson.dumps({"conversations": ROWS}))
    with pytest.raises(SourceError, match="records_field: conversations"):
        list(read_records(spec_for(f)))


@pytest.mark.parametrize("text", [orjson.dumps(ROWS), json.dumps(ROWS, indent=2).encode(),
                                  json.dumps({"data": ROWS}, indent=2).encode()])
def test_kind_jsonl_on_a_json_document_says_so_at_once_and_rejects_nothing(tmp_path, text):
    # Regression: every physical line of the array was rejected as bad JSON (hundreds of thousands of rows).
    f = tmp_path / "ShareGPT_V3_unfiltered.json"
    f.write_bytes(text)
    stats_seen = []
    with pytest.raises(SourceError) as exc:
        for rec in read_records(spec_for(f, kind="jsonl")):
            stats_seen.append(rec)
    assert stats_seen == [] and "set `kind: json`" in str(exc.value) and f.name in str(exc.value)


def test_a_truncated_jsonl_file_is_a_cut_too(tmp_path):
    lines = [orjson.dumps(r) + b"\n" for r in ROWS]
    f = tmp_path / "cut.jsonl"
    f.write_bytes(b"".join(lines[:4]) + lines[4][:25])
    with pytest.raises(TruncatedSource) as exc:
        build_prompt_set([(spec_for(f, kind="jsonl"), None)])
    assert exc.value.cut.offset == sum(len(x) for x in lines[:4]) and exc.value.cut.records_kept == 4
    ps = build_prompt_set([(spec_for(f, kind="jsonl", salvage=True), None)])
    assert counts(ps) == (4, 4, 0, {}, 4, 0) and ps.reports[0].cuts[0]["bytes_dropped"] == 25


# --- kind: hf with local files and folders ------------------------------------------------------
def write_spec(folder: Path, **keys) -> SourceSpec:
    import yaml

    path = folder / f"{keys['name']}.yaml"
    path.write_text(yaml.safe_dump(keys))
    return load_source_spec(path)


def test_hf_takes_a_local_json_array_file(tmp_path):
    # Regression: `datasets.load_dataset(<file path>)` said "Couldn't find any data file".
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "ShareGPT_V3.json").write_bytes(json.dumps(ROWS, indent=2).encode())
    spec = write_spec(tmp_path, name="sg", kind="hf", path="dl/ShareGPT_V3.json", format="sharegpt", id_field="id")
    ps = build_prompt_set([(spec, None)])
    assert counts(ps) == EXPECTED and ps.prompts[0].origin == "dl/ShareGPT_V3.json#0"


def test_hf_takes_a_local_jsonl_file_named_json_and_an_arrow_file(tmp_path):
    import datasets

    (tmp_path / "lines.json").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    spec = write_spec(tmp_path, name="l", kind="hf", path="lines.json", format="sharegpt")
    assert counts(build_prompt_set([(spec, None)])) == EXPECTED
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    spec = write_spec(tmp_path, name="a", kind="hf", path=str(arrow), format="sharegpt")
    assert counts(build_prompt_set([(spec, None)])) == EXPECTED


def hub_snapshot(folder: Path) -> None:
    """A dataset folder as `hf download --local-dir` leaves it: parquet files named by split."""
    (folder / "data").mkdir(parents=True)
    for split, n in (("train_sft", 5), ("test_sft", 3)):
        rows = [{"messages": [{"role": "user", "content": f"{split} question {i}?"}], "prompt_id": f"{split}{i}"}
                for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / f"{split}-00000-of-00001.parquet")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("hidden files are not data")


def test_hf_takes_a_local_parquet_folder_by_split(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hub_snapshot(tmp_path / "uc")
    spec = write_spec(tmp_path, name="uc", kind="hf", path="uc", split="train_sft", format="openai",
                      id_field="prompt_id")
    ps = build_prompt_set([(spec, None)])
    assert counts(ps) == (5, 5, 0, {}, 5, 0)
    assert sorted(p.source_ref for p in ps.prompts) == [f"train_sft{i}" for i in range(5)]


def test_hf_data_files_select_files_of_a_local_folder(tmp_path):
    hub_snapshot(tmp_path / "uc")
    spec = write_spec(tmp_path, name="uc", kind="hf", path="uc", data_files="data/test_sft-*.parquet",
                      format="openai", id_field="prompt_id")
    ps = build_prompt_set([(spec, None)])
    assert counts(ps) == (3, 3, 0, {}, 3, 0)
    assert ps.prompts[0].origin == "uc/data/test_sft-00000-of-00001.parquet#0"


def test_hf_missing_local_path_is_one_clear_error(tmp_path):
    spec = write_spec(tmp_path, name="gone", kind="hf", path="./downloads/sharegpt.json", format="sharegpt")
    with pytest.raises(SourceError) as exc:
        list(read_records(spec))
    assert "'gone'" in str(exc.value) and "is neither a file nor a folder" in str(exc.value)


def test_hf_hub_unreachable_is_one_line_naming_the_cause_and_the_local_copy(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    spec = write_spec(tmp_path, name="sharegpt", kind="hf", path="Aeala/ShareGPT_Vicuna_unfiltered",
                      format="sharegpt")
    with pytest.raises(SourceError) as exc:
        list(read_records(spec))
    text = str(exc.value)
    assert text.startswith("source 'sharegpt': cannot load Aeala/ShareGPT_Vicuna_unfiltered[train] from the "
                           "Hugging Face hub: offline mode is on")
    assert "point the spec's `path` at the local copy" in text and "\n" not in text


def test_a_lone_surrogate_rejects_its_record_with_the_reason(tmp_path, monkeypatch):
    """yajl2_c turned "\\ud83d" alone into "?" silently; the record is rejected instead, the others kept."""
    body = (b'[{"id": "broken", "conversations": [{"from": "human", "value": "emoji \\ud83d here"}]}, '
            b'{"id": "pair", "conversations": [{"from": "human", "value": "emoji \\ud83d\\ude00 ok"}]}, '
            b'{"id": "escaped", "conversations": [{"from": "human", "value": "path \\\\ud83d literal"}]}, '
            b'{"id": "low", "conversations": [{"from": "human", "value": "\\ude00 alone"}]}]')
    f = tmp_path / "s.json"
    f.write_bytes(body)
    for chunk in (jsonarray.CHUNK_BYTES, 7):  # 7: escapes split across parser chunks
        monkeypatch.setattr(jsonarray, "CHUNK_BYTES", chunk)
        out = list(read_records(spec_for(f)))
        kept = {r.data["id"]: r.data["conversations"][0]["value"] for r in out if hasattr(r, "data")}
        assert kept == {"pair": "emoji \U0001F600 ok", "escaped": "path \\ud83d literal"}, chunk
        rejects = [r for r in out if not hasattr(r, "data")]
        assert [r.origin.rsplit("#", 1)[1] for r in rejects] == ["0", "3"]
        assert all("lone UTF-16 surrogate" in r.reason and r.code == "bad_json" for r in rejects)
