"""The dataset card of a run with known contents."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.export import card, card_concurrency
from pipeline.export.jsonl import NotARunDirectory
from pipeline.store import schema
from pipeline.store.rundir import RunDir, atomic_write, table_bytes
from tests.test_export import make_run, record

USER = [{"role": "user", "content": "q"}]


def known_run(path):
    records = [
        record("a", 0, USER, "one two three", endpoint="e0", source="chat", prompt_tokens=10, completion_tokens=5,
               reasoning="think think", reasoning_tokens=4),
        record("b", 0, USER, "four", endpoint="e0", source="chat", prompt_tokens=20, completion_tokens=5,
               reasoning="hmm", reasoning_tokens=8),
        record("c", 0, USER, "cut " * 3, finish="length", endpoint="e0", source="code", prompt_tokens=30,
               completion_tokens=5),
        record("d", 0, USER, "The answer is forty two, as computed.\n" * 5, endpoint="e1", source="code",
               prompt_tokens=40, completion_tokens=25),
    ]
    assert [r["flags"] for r in records] == [[], [], ["truncated"], ["repetition"]]
    run = make_run(path, "last_turn", [records[:3], records[3:]])
    rundir = RunDir(run)
    failures = [{"prompt_id": "f1", "source": "chat", "error_class": "TerminalForPrompt", "status": 400,
                 "message": "context overflow", "endpoint": "e1", "attempts": 1, "config_fingerprint": "fp123"},
                {"prompt_id": "a", "source": "chat", "error_class": "Retryable", "status": 503,  # retried later: done
                 "message": "busy", "endpoint": "e1", "attempts": 3, "config_fingerprint": "fp123"}]
    rundir.write_part(rundir.failures, pa.Table.from_pylist(failures, schema=schema.FAILURES))
    rejects = [{"source": "chat", "origin": "f.jsonl:3", "reason": "empty message", "raw": "{}"}] * 2
    atomic_write(rundir.rejects / "rejects-000001.parquet",
                 table_bytes(pa.Table.from_pylist(rejects, schema=schema.REJECTS)))
    return run


def test_card_numbers(tmp_path):
    run = known_run(tmp_path / "run")
    path = Path(card.write_card(run))
    text = path.read_text()
    assert path == run / "README.md"
    assert "data_files: data/part-*.parquet" in text
    assert "4 records (4 prompts) in 2 committed parts" in text
    assert "- config fingerprint: `fp123`" in text and "- mode: `last_turn`" in text
    assert '"temperature":0.7' in text and "`kimi-k2.5` (4)" in text and "`w1` (4)" in text
    # sources, finish reasons, flags, endpoints
    assert "| chat | 2 | 50.0% |" in text and "| code | 2 | 50.0% |" in text
    assert "| stop | 3 | 75.0% |" in text and "| length | 1 | 25.0% |" in text
    assert "| truncated | 1 | 25.0% |" in text and "| repetition | 1 | 25.0% |" in text
    assert "2 of 4 records carry at least one flag" in text
    assert "| e0 | 3 | 75.0% |" in text and "| e1 | 1 | 25.0% |" in text
    # token statistics: prompt 10/20/30/40, completion 5/5/5/25, reasoning tokens 4/8
    assert "| prompt (tokens) | 4 | 25.0 | 25.0 | 38.5 | 40 |" in text
    assert "| completion (tokens) | 4 | 10.0 | 5.0 | 22.0 | 25 |" in text
    assert "| reasoning (tokens) | 2 | 6.0 | 6.0 | 7.8 | 8 |" in text
    assert "words" not in text.split("## Token statistics")[1].split("p50/p95")[0]
    assert "terminal failures (prompts without a record): 1 — TerminalForPrompt 1" in text
    assert "rejected inputs: 2 — empty message 2" in text
    assert f'data_files="{run}/data/part-*.parquet"' in text
    for name in ("completion_length.png", "reasoning_length.png"):
        assert (run / "card" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reasoning_falls_back_to_a_labelled_word_count(tmp_path):
    records = [record("a", 0, USER, "x", reasoning="one two three"),
               record("b", 0, USER, "y", reasoning="one two three four five")]
    run = make_run(tmp_path / "run", "last_turn", [records])
    text = Path(card.write_card(run)).read_text()
    assert "| reasoning (words, where no reasoning_tokens) | 2 | 4.0 |" in text
    assert "| reasoning (tokens) | 0 | - |" in text
    assert card.reasoning_label(card.gather(RunDir(run))).startswith("reasoning length (words")


def test_card_of_an_empty_run_and_the_cli(tmp_path, capsys):
    run = make_run(tmp_path / "run", "all_turns", [])
    from pipeline.cli import main

    assert main(["card", str(run)]) == 0
    assert "0 records (0 prompts) in 0 committed parts" in (run / "README.md").read_text()
    assert (run / "card" / "reasoning_length.png").exists()
    assert "README.md" in capsys.readouterr().err
    with pytest.raises(NotARunDirectory):
        card.write_card(tmp_path / "nothing")


def test_card_of_an_image_run_shows_images_per_prompt_their_sizes_and_prompt_tokens_apart(tmp_path):
    from tests.image_records import last_turn_run

    run, images = last_turn_run(tmp_path / "run", tmp_path / "photos")
    text = Path(card.write_card(run.path)).read_text()
    assert "4 prompts with images (4 records, 5 image parts sent, 3 distinct images)" in text
    assert "| 1 | 3 |" in text and "| 2 | 1 |" in text  # three prompts with one image, one with two
    sizes = [(p["width"], p["height"], p["bytes"]) for p in images.values()]
    widths = sorted(w for w, _, _ in sizes)
    assert f"| image width (pixels) | 3 | {sum(widths) / 3:.1f} | {widths[1]:.1f} |" in text
    assert f"| image file (bytes) | 3 | {sum(b for *_, b in sizes) / 3:.1f} |" in text
    # image records' prompt tokens (6 + 9 image tokens in the stand-in ids) beside the text records', not subtracted
    assert "| prompt tokens, image records | 4 | 13.8 |" in text and "| prompt tokens, text records | 2 | 8.0 |" in text
    assert "not as a difference" in text
    assert "- `t-img` (source `vision`, source id `coco-123`):" in text
    assert "  - prompt: [image 24x16] What is in this image?" in text


def test_card_examples_without_a_source_id_on_their_records_take_it_from_the_prompt_set(tmp_path):
    run = known_run(tmp_path / "run")
    prompts = pa.Table.from_pylist([{"prompt_id": "a", "source": "chat", "source_ref": "conv-7", "messages": USER}],
                                   schema=schema.PROMPTS)
    RunDir(run).write_prompt_set(prompts, pa.Table.from_pylist([], schema=schema.REJECTS))
    text = Path(card.write_card(run)).read_text()
    assert "- `a` (source `chat`, source id `conv-7`):\n  - prompt: q\n  - reply: one two three" in text
    assert "- `b` (source `chat`):" in text and "## Images" not in text


def test_the_card_says_fixed_not_auto_reached_for_an_unset_concurrency_pinned_to_8():
    from tests.test_concurrency_default import decided_auto_stats, pinned_stats

    class Run:
        def read_status(self):
            return {"endpoints": {"llama-0": pinned_stats(), "sgl-0": decided_auto_stats()}}

    lines = card_concurrency.concurrency_lines(Run())
    assert lines[0] == "- llama-0: concurrency 8 (not set; the server reports no batch)", lines
    assert lines[1].startswith("- sgl-0: concurrency auto (not set, and the server batches up to 256): "), lines
    assert lines[1].endswith(" at the end of the last session"), lines
