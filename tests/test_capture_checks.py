"""Review 16b, items 5, 6 and 9-12: the model identity (no mtimes), rows prepare-data cut, the state of a pass with
failures, duplicate aux layers, ids that disagree with their counts, and follow's listing of settled parts."""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.capture import open_capture, pending_samples
from pipeline.core.capture_config import load_capture_config
from pipeline.core.errors import ConfigError, DriftError
from pipeline.dispatch.capture_worker import Sample
from pipeline.hidden.layout import CaptureLayout, default_aux_layers
from pipeline.store.capture_ledger import capture_counts, capture_run_dir
from tests.smollm2_run import add_part, make_smollm2_run, smollm2_records
from tests.capture_helpers import captured_tiny_run, config_file, new_capture, tiny_llama, tok  # noqa: F401

pytestmark = pytest.mark.torch


# --- 5: the model identity is its files' names, sizes and a few bytes, not their mtimes ---------------------------
def test_the_same_weights_with_other_mtimes_or_another_copy_are_not_drift(tmp_path, tok):
    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    new_capture(run, load_capture_config(config_file(tmp_path, model)))
    for f in model.iterdir():
        os.utime(f, ns=(10**18, 10**18))  # as another node's own download of the same files
    open_capture(run, load_capture_config(config_file(tmp_path, model)))
    copy = shutil.copytree(model, tmp_path / "copy", copy_function=shutil.copyfile)  # new mtimes
    from pipeline.hidden.routes import identity_for

    assert identity_for(load_capture_config(config_file(tmp_path, copy))) == \
        identity_for(load_capture_config(config_file(tmp_path, model)))
    tiny_llama(model, seed=1)  # other weights, same shape and sizes: still drift, with capture's own advice
    with pytest.raises(DriftError, match="model_identity.weights") as err:
        open_capture(run, load_capture_config(config_file(tmp_path, model)))
    assert "--new-run" not in str(err.value) and "another copy of the run" in str(err.value)


# --- 6: --speculators-data matches the rows prepare-data cut at its seq_length -------------------------------------
def test_speculators_data_cut_at_seq_length_gets_every_file_and_loads_in_speculators(tmp_path, tok):
    from pipeline.export.hidden import export_hidden
    from pipeline.export.jsonl import export_run
    from tests.smollm2_hf import smollm2_hf_dir
    from tests.trainlib import run_checks

    run = captured_tiny_run(tmp_path, tok)
    export_run(run.path, "speculators", tmp_path / "spec.jsonl")
    prepared = tmp_path / "prepared"
    got = run_checks({"check": "speculators_prepare", "path": str(tmp_path / "spec.jsonl"), "out": str(prepared),
                      "tokenizer": str(smollm2_hf_dir()), "seq_length": 44})
    lengths = [len(r["input_ids"]) for r in got["rows"]]
    assert sorted(lengths) == [42, 43, 44, 44]  # speculators cut two of them
    summary = export_hidden(run, "speculators-hidden", None, speculators_data=prepared)
    assert summary["samples"] == 4, summary["notes"]
    checked = run_checks({"check": "speculators_hidden", "path": str(prepared), "save": str(tmp_path / "s.pt")})
    assert checked["checked"] == 4 and checked["not_loaded"] == [], checked


# --- 9: a pass with failures is "finished", not "complete", and says so everywhere --------------------------------
def test_a_pass_with_failed_prompts_is_finished_with_its_failures_in_status_and_card(tmp_path, ray_cluster, tok):
    from pipeline.export.card import write_card
    from tests.helpers import run_regen

    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)
    records[2]["output_token_ids"] = records[2]["output_token_ids"][:-1] + [60000]  # past the vocabulary
    records[2]["completion_tokens"] = None
    run = make_smollm2_run(tmp_path / "run", [records])
    proc = run_regen("capture", str(run.path), "--config", str(config_file(tmp_path, model)))
    assert proc.returncode == 1
    assert "capture finished: 3 prompts captured, 1 failed" in proc.stderr, proc.stderr[-2000:]
    assert "complete" not in proc.stderr.splitlines()[-1]
    status = capture_run_dir(run).read_status()
    assert status["state"] == "finished" and status["failed_prompt_ids"] == ["p2"]
    counts = capture_counts(run)
    assert (counts["state"], counts["captured"], counts["failed_prompts"]) == ("finished", 3, 1)
    card = open(str(write_card(run.path))).read()
    assert "finished, 3 of 4 samples captured" in card and "1 prompts failed in its last pass (p2)" in card


# --- 10: aux layer ids are distinct, and so is the default of a small model ----------------------------------------
def test_duplicate_aux_layers_are_refused_and_small_models_default_to_distinct_ones(tmp_path):
    assert [default_aux_layers(n) for n in (4, 5, 6, 7, 8, 30)] == \
        [[1, 2, 3], [1, 2, 4], [1, 3, 5], [2, 3, 4], [2, 4, 5], [2, 15, 27]]
    for n in range(4, 40):
        assert len(set(CaptureLayout.build("m", n, 8).aux_layer_ids)) == 3
    with pytest.raises(ConfigError, match=r"aux_layer_ids.*repeats a layer"):
        load_capture_config(config_file(tmp_path, tmp_path, aux_layer_ids=[2, 2, 2]))
    with pytest.raises(ValueError, match="3 distinct layer ids"):
        CaptureLayout.build("m", 6, 8, [2, 3, 3])


# --- 11: ids that disagree with the record's own counts are refused, counted and named ------------------------------
def test_a_record_whose_ids_disagree_with_its_counts_is_refused_and_named(tmp_path, tok, caplog):
    records = smollm2_records(tok)
    records[0]["prompt_tokens"] += 5
    records[2]["output_token_ids"] = records[2]["output_token_ids"][:3]  # cut; completion_tokens says more
    records[3]["completion_tokens"] = 0  # no usage reported: nothing to check
    run = make_smollm2_run(tmp_path / "run", [records])
    pending = pending_samples(run, set(), set(), Sample)
    assert sorted(p[0].prompt_id for p in pending.prompts) == ["p1", "p3"]
    assert (pending.count_mismatch, pending.no_token_ids) == (2, 0)
    named = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("p0" in m and "prompt_tokens" in m for m in named)
    assert any("p2" in m and "completion_tokens" in m for m in named)


# --- 12: a follow's listing reads a part's ids once it has nothing left to capture --------------------------------
def test_follow_listing_skips_parts_with_nothing_left(tmp_path, tok, monkeypatch):
    from pipeline.store import storage

    records = smollm2_records(tok)
    run = make_smollm2_run(tmp_path / "run", [records[:2]])
    add_part(run, records[2:])
    reads: list[tuple[str, tuple]] = []
    real = storage.Location.read_parquet

    def counting(self, *args, **kwargs):
        reads.append((self.name, tuple(kwargs.get("columns") or ())))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(storage.Location, "read_parquet", counting)
    settled: set[str] = set()
    first = pending_samples(run, set(), set(), Sample, settled)
    assert len(first.prompts) == 4
    reads.clear()
    again = pending_samples(run, {"p0", "p1"}, set(), Sample, settled)  # the first part's prompts captured
    assert [p[0].prompt_id for p in again.prompts] == ["p2", "p3"]
    reads.clear()
    pending_samples(run, {"p0", "p1", "p2", "p3"}, set(), Sample, settled)
    pending_samples(run, {"p0", "p1", "p2", "p3"}, set(), Sample, settled)
    assert not any("prompt_token_ids" in cols for _, cols in reads)  # no ids read for done parts
    assert len(reads) <= 1  # the second part's ids column list once, then nothing
