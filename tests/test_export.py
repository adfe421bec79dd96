"""Exports (SpecForge conversations and tokens, speculators rows), their safety, and quality flags.
Run directories are built by hand: no Ray, no HTTP."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest

from pipeline.core.errors import StorageError
from pipeline.export import command, jsonl as export, formats
from pipeline.export.formats import validate_specforge_row
from pipeline.export.jsonl import NotARunDirectory, export_run
from pipeline.store import schema
from pipeline.store.quality import quality_flags
from pipeline.store.rundir import RunDir, table_bytes

SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64}


# --- building run directories ----------------------------------------------------------------------
def record(prompt_id: str, turn_index: int, messages: list[dict[str, str]], content: str, *,
           n_turns: int = 1, reasoning: str | None = None, finish: str = "stop", flags: list[str] | None = None,
           source: str = "chat", endpoint: str = "e0", token_ids: bool = True, **extra: Any) -> dict[str, Any]:
    base = 1000 * (abs(hash((prompt_id, turn_index))) % 1000)
    prompt_ids = [base + i for i in range(3 * len(messages) + 2)]
    output_ids = [base + 500 + i for i in range(len(content.split()) + 1)]
    row = {
        "prompt_id": prompt_id, "turn_index": turn_index, "n_turns": n_turns, "source": source,
        "messages": messages, "content": content, "reasoning_content": reasoning, "finish_reason": finish,
        "flags": flags if flags is not None else quality_flags(content, reasoning, finish),
        "prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids), "endpoint": endpoint,
        "model": "kimi-k2.5", "weight_version": "w1", "config_fingerprint": "fp123",
        "prompt_token_ids": prompt_ids if token_ids else None, "output_token_ids": output_ids if token_ids else None,
    }
    row.update(extra)
    return row


def make_run(path: Path, mode: str, parts: list[list[dict[str, Any]]]) -> Path:
    run = RunDir(path)
    run.create()
    run.write_manifest({"schema_version": schema.SCHEMA_VERSION, "fingerprint": "fp123",
                        "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": "kimi-k2.5", "mode": mode, "sampling": SAMPLING,
                                       "chat_template_kwargs": {"thinking": True}, "hidden_states": None}})
    for rows in parts:
        run.write_part(run.data, pa.Table.from_pylist(rows, schema=schema.RECORDS))
    return path


SYSTEM = {"role": "system", "content": "You are terse."}


def last_turn_records() -> list[dict[str, Any]]:
    """Each history holds source-written assistant turns (marked SOURCE); replies are marked TARGET."""
    rows = []
    for i in range(4):
        history = [SYSTEM] if i % 2 else []
        history += [{"role": "user", "content": f"q{i}.0"}, {"role": "assistant", "content": f"SOURCE answer {i}.0"},
                    {"role": "user", "content": f"q{i}.1"}]
        rows.append(record(f"p{i}", 1, history, f"TARGET reply {i}", reasoning=f"thinking {i}" if i < 2 else None,
                           source="chat" if i < 3 else "code"))
    rows.append(record("p-single", 0, [{"role": "user", "content": "hi"}], "TARGET hello"))
    return rows


def all_turns_conversation(prompt_id: str, n: int, *, finishes: dict[int, str] | None = None,
                           source: str = "chat") -> list[dict[str, Any]]:
    """n turns; each turn's history holds the target's earlier replies (no reasoning: it is not sent back)."""
    rows, history = [], [SYSTEM]
    for k in range(n):
        history = history + [{"role": "user", "content": f"{prompt_id} user {k}"}]
        reply, thought = f"{prompt_id} TARGET reply {k}", f"{prompt_id} reasoning {k}"
        rows.append(record(prompt_id, k, history, reply, n_turns=n, reasoning=thought,
                           finish=(finishes or {}).get(k, "stop"), source=source))
        history = history + [{"role": "assistant", "content": reply}]
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def accounted(summary: export.ExportSummary) -> bool:
    return summary.records_read == summary.records_exported + sum(summary.dropped.values())


# --- conformance -----------------------------------------------------------------------------------
def test_last_turn_specforge_rows_are_per_turn_and_only_the_last_assistant_turn_is_target_text(tmp_path):
    records = last_turn_records()
    run = make_run(tmp_path / "run", "last_turn", [records[:2], records[2:]])
    out = tmp_path / "out" / "sf.jsonl"
    summary = export_run(run, "specforge", out)
    rows = read_jsonl(out)
    assert len(rows) == summary.rows_written == len(records) and accounted(summary)
    by_id = {r["prompt_id"]: r for r in records}
    for row in rows:
        assert validate_specforge_row(row) == []
        source = by_id[row["source_id"]]
        assert row["id"] == f"{source['prompt_id']}#turn{source['turn_index']}"
        assert row["assistant_turn_index"] == source["turn_index"]
        assistants = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert assistants[-1]["content"] == source["content"] and "TARGET" in assistants[-1]["content"]
        assert assistants[-1].get("reasoning_content") == source["reasoning_content"]
        assert all("SOURCE" in m["content"] and "reasoning_content" not in m for m in assistants[:-1])
        assert row["conversations"][:-1] == source["messages"]  # the history exactly as sent
    assert summary.specforge_settings == {"data": {"train_only_last_turn": True}, "overrides": ["data.train_only_last_turn=true"]}
    assert any("data.train_only_last_turn: true" in note for note in summary.notes)
    manifest = orjson.loads(export.manifest_path(out).read_bytes())
    assert manifest["run_fingerprint"] == "fp123" and manifest["mode"] == "last_turn"
    assert manifest["specforge_settings"] == {"data": {"train_only_last_turn": True}, "overrides": ["data.train_only_last_turn=true"]}
    assert manifest["counts"]["rows_written"] == len(records)


@pytest.mark.parametrize("mode", ["last_turn", "all_turns"])
def test_token_export_masks_exactly_the_generated_tokens(tmp_path, mode):
    records = last_turn_records() if mode == "last_turn" else all_turns_conversation("c1", 3)
    records.append(record("no-ids", 0, [{"role": "user", "content": "x"}], "y", token_ids=False))
    run = make_run(tmp_path / "run", mode, [records])
    summary = export_run(run, "specforge-tokens", tmp_path / "tok.jsonl")
    rows = read_jsonl(tmp_path / "tok.jsonl")
    assert summary.dropped == {export.NO_TOKEN_IDS: 1} and len(rows) == len(records) - 1 and accounted(summary)
    by_id = {formats.turn_id(r["prompt_id"], r["turn_index"]): r for r in records}
    for row in rows:
        source = by_id[row["id"]]
        assert set(row) == {"id", "input_ids", "loss_mask", "source_ref"} and row["source_ref"] is None
        assert len(row["input_ids"]) == len(row["loss_mask"]) and set(row["loss_mask"]) <= {0, 1}
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m == 1]
        assert trained == source["output_token_ids"]
        first = row["loss_mask"].index(1)
        assert row["input_ids"][:first] == source["prompt_token_ids"] and all(row["loss_mask"][first:])


def test_speculators_rows(tmp_path):
    records = last_turn_records()
    run = make_run(tmp_path / "run", "last_turn", [records])
    export_run(run, "speculators", tmp_path / "spec.jsonl")
    rows = read_jsonl(tmp_path / "spec.jsonl")
    assert len(rows) == len(records)
    by_id = {f"{r['prompt_id']}_gen{r['turn_index']}": r for r in records}
    for row in rows:
        source = by_id[row["id"]]
        assert row["primary_id"] == source["prompt_id"] and row["text"] == source["content"]
        assert len(row["input_ids"]) == len(row["loss_mask"])
        assert row["loss_mask"] == [0] * len(source["prompt_token_ids"]) + [1] * len(source["output_token_ids"])
        assert row["metadata"] == {"idx": source["turn_index"], "finish_reason": "stop",
                                   "usage": {"prompt_tokens": source["prompt_tokens"],
                                             "completion_tokens": source["completion_tokens"]},
                                   "endpoint": "e0", "sampling_params": SAMPLING}


def test_all_turns_whole_conversations_round_trip_reasoning_per_turn(tmp_path):
    conversations = [all_turns_conversation("c1", 3), all_turns_conversation("c2", 1), all_turns_conversation("c3", 2)]
    run = make_run(tmp_path / "run", "all_turns", [conversations[0] + conversations[1], conversations[2]])
    summary = export_run(run, "specforge", tmp_path / "whole.jsonl")
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "whole.jsonl")}
    assert set(rows) == {"c1", "c2", "c3"} and summary.records_exported == 6 and accounted(summary)
    assert summary.specforge_settings == {"data": {"train_only_last_turn": False}, "overrides": ["data.train_only_last_turn=false"]}
    for turns in conversations:
        row = rows[turns[0]["prompt_id"]]
        assert validate_specforge_row(row) == []
        assert row["conversations"][0] == SYSTEM
        assistants = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert [(m["content"], m["reasoning_content"]) for m in assistants] == \
            [(t["content"], t["reasoning_content"]) for t in turns]
        assert [m["content"] for m in row["conversations"] if m["role"] == "user"] == \
            [m["content"] for m in turns[-1]["messages"] if m["role"] == "user"]


def test_all_turns_per_turn_expansion(tmp_path):
    turns = all_turns_conversation("c1", 3)
    run = make_run(tmp_path / "run", "all_turns", [turns])
    summary = export_run(run, "specforge", tmp_path / "pt.jsonl", per_turn=True)
    rows = read_jsonl(tmp_path / "pt.jsonl")
    assert [r["id"] for r in rows] == ["c1#turn0", "c1#turn1", "c1#turn2"]
    assert summary.specforge_settings == {"data": {"train_only_last_turn": True}, "overrides": ["data.train_only_last_turn=true"]}
    for k, row in enumerate(rows):
        assert validate_specforge_row(row) == []
        assert row["source_id"] == "c1" and row["assistant_turn_index"] == k
        assert row["conversations"][-1] == {"role": "assistant", "content": turns[k]["content"],
                                            "reasoning_content": turns[k]["reasoning_content"]}


def test_all_turns_conversation_is_cut_before_a_dropped_turn(tmp_path):
    cut = all_turns_conversation("c1", 4, finishes={2: "length"})
    whole = all_turns_conversation("c2", 2)
    run = make_run(tmp_path / "run", "all_turns", [cut + whole])
    summary = export_run(run, "specforge", tmp_path / "w.jsonl", drop_truncated=True)
    rows = {row["id"]: row for row in read_jsonl(tmp_path / "w.jsonl")}
    assert len([m for m in rows["c1"]["conversations"] if m["role"] == "assistant"]) == 2
    assert summary.dropped == {export.TRUNCATED: 1, export.FOLLOWS_DROPPED_TURN: 1} and accounted(summary)


# --- filters, duplicates, safety -------------------------------------------------------------------
def test_filters_are_counted(tmp_path):
    user = [{"role": "user", "content": "q"}]
    records = [
        record("a", 0, user, "fine answer"),
        record("b", 0, user, "cut off mid", finish="length"),
        record("c", 0, user, "<think>oops</think> answer"),  # leaked_think
        record("d", 0, user, "from the code source", source="code"),
        record("e", 0, user, "", reasoning="only thoughts", finish="stop"),  # empty content
    ]
    run = make_run(tmp_path / "run", "last_turn", [records])
    summary = export_run(run, "specforge", tmp_path / "f.jsonl", drop_truncated=True, drop_flagged=True,
                         sources=["chat"])
    assert [r["source_id"] for r in read_jsonl(tmp_path / "f.jsonl")] == ["a"]
    assert summary.dropped == {export.TRUNCATED: 1, export.FLAGGED: 1, export.SOURCE_NOT_SELECTED: 1,
                               export.EMPTY_CONTENT: 1}
    assert summary.records_read == 5 and accounted(summary)
    for reason in summary.dropped:
        assert reason in summary.table()
    unfiltered = export_run(run, "specforge", tmp_path / "all.jsonl", keep_truncated=True)
    assert unfiltered.rows_written == 4 and unfiltered.dropped == {export.EMPTY_CONTENT: 1}
    # by default the conversation export drops a cut reply (SpecForge would train an end-of-turn after it)
    default = export_run(run, "specforge", tmp_path / "default.jsonl")
    assert default.rows_written == 3 and default.dropped == {export.EMPTY_CONTENT: 1, export.TRUNCATED: 1}


def test_duplicates_are_never_emitted(tmp_path):
    records = last_turn_records()
    conversation = all_turns_conversation("c1", 2)
    run = make_run(tmp_path / "run", "last_turn", [records, records[:2]])
    summary = export_run(run, "specforge", tmp_path / "d.jsonl")
    ids = [r["id"] for r in read_jsonl(tmp_path / "d.jsonl")]
    assert len(ids) == len(set(ids)) == len(records) and summary.dropped == {export.DUPLICATE: 2}
    run2 = make_run(tmp_path / "run2", "all_turns", [conversation, conversation])
    for per_turn in (False, True):
        summary = export_run(run2, "specforge", tmp_path / "d2.jsonl", per_turn=per_turn)
        ids = [r["id"] for r in read_jsonl(tmp_path / "d2.jsonl")]
        assert len(ids) == len(set(ids)) and summary.dropped == {export.DUPLICATE: 2} and accounted(summary)


def test_uncommitted_temporary_parts_are_ignored(tmp_path):
    run = make_run(tmp_path / "run", "last_turn", [last_turn_records()])
    stray = pa.Table.from_pylist([record("in-flight", 0, [{"role": "user", "content": "q"}], "partial")],
                                 schema=schema.RECORDS)
    data = Path(RunDir(run).data)
    (data / ".tmp-part-000002-deadbeef.parquet.0a1b2c3d").write_bytes(table_bytes(stray))
    (data / ".tmp-part-000003-deadbeef.parquet").write_bytes(table_bytes(stray))
    for fmt in export.FORMATS:
        export_run(run, fmt, tmp_path / f"{fmt}.jsonl")
        assert b"in-flight" not in (tmp_path / f"{fmt}.jsonl").read_bytes()


def test_unwritable_output_gives_a_typed_error_and_leaves_nothing(tmp_path):
    run = make_run(tmp_path / "run", "last_turn", [last_turn_records()])
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(StorageError):
        export_run(run, "specforge", blocker / "out.jsonl")
    assert blocker.read_text() == "a file where a directory should be"


def test_an_error_mid_export_leaves_the_previous_output_and_no_temporary_file(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", "last_turn", [last_turn_records()])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "sf.jsonl").write_text("previous export\n")
    calls = []

    def failing(record):
        calls.append(record)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return formats.specforge_per_turn_row(record)

    monkeypatch.setattr(formats, "specforge_per_turn_row", failing)
    with pytest.raises(RuntimeError):
        export_run(run, "specforge", out_dir / "sf.jsonl")
    assert sorted(p.name for p in out_dir.iterdir()) == ["sf.jsonl"]
    assert (out_dir / "sf.jsonl").read_text() == "previous export\n"


def test_not_a_run_directory(tmp_path):
    with pytest.raises(NotARunDirectory):
        export_run(tmp_path, "specforge", tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_arguments_and_summary(tmp_path, capsys):
    run = make_run(tmp_path / "run", "last_turn", [last_turn_records()])
    parser = argparse.ArgumentParser()
    command.add_export_arguments(parser)
    args = parser.parse_args([str(run), "--format", "specforge", "--out", str(tmp_path / "c.jsonl"),
                              "--source", "chat", "--source", "code", "--drop-truncated"])
    assert command.run_export(args) == 0
    err = capsys.readouterr().err
    assert "rows written" in err and "data.train_only_last_turn: true" in err
    assert len(read_jsonl(tmp_path / "c.jsonl")) == 5  # every record is from chat or code
    assert args.sources == ["chat", "code"]


def test_validator_rejects_what_specforge_rejects():
    good = {"id": "x", "conversations": [SYSTEM, {"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a", "reasoning_content": "r"}]}
    assert validate_specforge_row(good) == []
    bad_rows = [
        {"conversations": good["conversations"]},  # no id
        {"id": "x", "conversations": []},
        {"id": "x", "conversations": [{"role": "assistant", "content": "a"}]},  # starts with assistant
        {"id": "x", "conversations": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"}, SYSTEM, {"role": "assistant", "content": "a"}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning_content": 3}]},
        {"id": "x", "conversations": [{"role": "user", "content": "q"}]},  # nothing to train on
    ]
    for row in bad_rows:
        assert validate_specforge_row(row), row


# --- the run's Parquet through `datasets`, offline ---------------------------------------------------
def test_datasets_loads_the_run_offline(tmp_path):
    run = make_run(tmp_path / "run", "all_turns",
                   [all_turns_conversation("c1", 2), all_turns_conversation("c2", 3) + last_turn_records()[:1]])
    Path(RunDir(run).data / ".tmp-part-000009-deadbeef.parquet.0a1b2c3d").write_bytes(b"torn")
    script = ("import datasets, sys\n"
              "ds = datasets.load_dataset('parquet', data_files=sys.argv[1] + '/data/part-*.parquet', split='train')\n"
              "print(ds.num_rows, sorted(set(ds['prompt_id'])), ds.features['messages'])\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("6 ['c1', 'c2', 'p0']")


# --- quality flags ---------------------------------------------------------------------------------
PROSE = (
    "Rivers shape the land they cross. Over thousands of years a river carves valleys, deposits silt on its "
    "flood plain and builds deltas where it meets the sea. The same water that erodes a canyon also feeds "
    "farms and cities, which is why so many civilisations grew along river banks. "
) * 3  # a paragraph quoted three times is not a loop
CODE = "\n".join(
    ["def matrix(n):", "    rows = []", "    for i in range(n):", "        row = []"]
    + ["        row.append(0)"] * 3
    + ["        rows.append(row)", "    return rows", "", "}", "}", "}", "}", "}", "}", "", "x = [0, 0, 0, 0, 0, 0]"]
)
LIST = "\n".join(f"{i}. Item number {i} is good." for i in range(1, 30))


@pytest.mark.parametrize("content,reasoning,finish,expected", [
    ("A normal answer.", None, "stop", []),
    (PROSE, "Let me think about rivers. " * 2, "stop", []),
    (CODE, None, "stop", []),
    (LIST, None, "stop", []),
    ("- a\n- a\n- a\n- a\n- a\n- a", None, "stop", []),  # short identical lines are not a loop
    ("ha " * 20, None, "stop", []),  # 20 single-word repeats: under the 32-word floor
    ("A long answer that was cut", None, "length", ["truncated"]),
    ("", "I was still thinking when", "length", ["truncated", "truncated_thinking"]),
    ("", None, "length", ["truncated", "empty"]),
    ("  ", "   ", "stop", ["empty"]),
    ("Sure. <think>hmm</think> Done.", None, "stop", ["leaked_think"]),
    ("Fine.", "step one </think> step two", "stop", ["leaked_think"]),
    ("Answer: " + "I will check the result again. " * 9 + "I will ch", None, "length", ["truncated", "repetition"]),
    ("ok", "wait " * 40, "length", ["truncated", "repetition"]),
    ("Intro.\n" + "The answer is forty two, as computed.\n\n" * 5 + "Done.", None, "stop", ["repetition"]),
    ("", "<think> " + "and then " * 20, "length", ["truncated", "truncated_thinking", "leaked_think", "repetition"]),
])
def test_quality_flags(content, reasoning, finish, expected):
    assert quality_flags(content, reasoning, finish) == expected


def test_quality_flags_take_under_a_millisecond_of_cpu_a_record():
    """A guard against a pattern that backtracks (seconds a record over 88K records), not a speed figure (that is
    `make bench`'s): this process's CPU time, which another process's load does not change."""
    answer = " ".join(f"word{i % 97} and{i % 13}" for i in range(1000)) + "\n" + CODE  # ~2K tokens
    reasoning = PROSE * 4
    start = time.process_time()
    for _ in range(200):
        quality_flags(answer, reasoning, "stop")
    assert (time.process_time() - start) / 200 < 1e-3
