"""Regressions of issue 16's break-it review of `regen capture`: model drift, follow, a poison record, export filters,
atomic export folders, counts. Tiny random Llamas with SmolLM2's vocabulary (built here, a few MB) stand in for a
real model wherever the states' values do not matter; records carry SmolLM2's real token ids."""
from __future__ import annotations

import shutil

import numpy as np
import orjson
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.capture import open_capture
from pipeline.core.capture_config import load_capture_config
from pipeline.core.errors import DriftError
from pipeline.dispatch.capture_worker import CaptureWorker, Sample
from pipeline.hidden.parts import hidden_parts
from pipeline.store import schema
from pipeline.store.capture_ledger import capture_run_dir
from pipeline.store.rundir import now_utc
from tests.smollm2_run import make_smollm2_run, smollm2_records

pytestmark = pytest.mark.torch


def tiny_llama(folder, hidden: int = 64, layers: int = 6, seed: int = 0):
    """A random Llama with SmolLM2's vocabulary (its token ids are valid), saved as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.rmtree(folder, ignore_errors=True)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.smollm2_hf import smollm2_hf_dir

    return AutoTokenizer.from_pretrained(smollm2_hf_dir())


def config_file(tmp_path, model, name="capture.yaml", **extra):
    import yaml

    cfg = {"route": "transformers", "model": str(model), "actors": 1, "actor_num_cpus": 1, "torch_threads": 1,
           "prompts_per_call": 1, "flush_records": 1, "flush_interval_s": 0.5, **extra}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def samples_of(records):
    return [[Sample(r["prompt_id"], 0, f"{r['prompt_id']}#turn0", r["prompt_token_ids"] + r["output_token_ids"],
                    len(r["prompt_token_ids"]), r["finish_reason"])] for r in records]


def capture_in_process(run, cfg, records, expected=None, tag="t"):
    """What one actor call does, in this process, then the driver's ledger commit (no Ray)."""
    cap = capture_run_dir(run)
    manifest = cap.read_manifest()
    worker = CaptureWorker(cfg, cap.path.uri, tag, manifest["fingerprint"], "s", expected)
    rows = [{**row, "created_at": now_utc()} for prompt in worker.capture(samples_of(records)) for row in prompt]
    cap.write_part(cap.data, pa.Table.from_pylist(rows, schema=schema.CAPTURE))


def new_capture(run, cfg):
    capture_run_dir(run).path.mkdir()
    return open_capture(run, cfg)


# --- D1: the capture's identity is the model's, not its name ----------------------------------------------------
def test_a_replaced_model_folder_is_drift_but_its_path_spelled_otherwise_is_not(tmp_path, tok):
    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    new_capture(run, load_capture_config(config_file(tmp_path, model)))
    open_capture(run, load_capture_config(config_file(tmp_path, f"{model}/")))  # the same folder: no drift
    with pytest.raises(DriftError, match="compute_dtype"):
        open_capture(run, load_capture_config(config_file(tmp_path, model, torch_dtype="bfloat16")))
    tiny_llama(model, hidden=32)  # another model behind the same path: other width
    with pytest.raises(DriftError, match="hidden_size: 64 -> 32"):
        open_capture(run, load_capture_config(config_file(tmp_path, model)))
    tiny_llama(model, seed=1)  # the same shape again, other weights
    with pytest.raises(DriftError, match="model_identity.weights"):
        open_capture(run, load_capture_config(config_file(tmp_path, model)))


def test_an_actor_refuses_a_model_replaced_after_the_driver_checked_it(tmp_path, tok):
    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)[:1]
    run = make_smollm2_run(tmp_path / "run", [records])
    cfg = load_capture_config(config_file(tmp_path, model))
    _, manifest = new_capture(run, cfg)
    tiny_llama(model, hidden=32)  # replaced between the driver's check and the actor's load
    with pytest.raises(DriftError, match="hidden_size"):
        capture_in_process(run, cfg, records, expected=manifest)
    assert hidden_parts(capture_run_dir(run)) == []  # nothing stored


def test_exporting_a_capture_that_mixes_widths_names_the_sample(tmp_path, tok):
    from pipeline.export.hidden import export_hidden
    from pipeline.hidden.parse import StoredLayoutMismatch

    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)
    run = make_smollm2_run(tmp_path / "run", [records])
    cfg = load_capture_config(config_file(tmp_path, model))
    new_capture(run, cfg)
    capture_in_process(run, cfg, records[:1])
    tiny_llama(model, hidden=32)  # what a capture without the checks stored: a 32-wide sample in a 64-wide capture
    capture_in_process(run, cfg, records[1:2], tag="u")
    for fmt in ("specforge-offline", "speculators-hidden"):
        with pytest.raises(StoredLayoutMismatch, match="sample p1#turn0"):
            export_hidden(run, fmt, tmp_path / fmt)
