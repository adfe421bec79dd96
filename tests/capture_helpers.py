"""Helpers shared by the capture tests: tiny random Llamas with SmolLM2's vocabulary (built in a test's folder, a
few MB) that stand in for a real model wherever the states' values do not matter, the SmolLM2 tokenizer (`tok`,
one per module), capture configs, and one actor's capture run in this process."""
from __future__ import annotations

import shutil

import pyarrow as pa
import pytest

from pipeline.capture import open_capture
from pipeline.core.capture_config import load_capture_config
from pipeline.dispatch.capture_worker import CaptureWorker, Sample
from pipeline.store import schema
from pipeline.store.capture_ledger import capture_run_dir
from pipeline.store.rundir import now_utc
from tests.smollm2_run import make_smollm2_run, smollm2_records


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

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


def captured_tiny_run(tmp_path, tok, records=None):
    records = records or smollm2_records(tok)
    run = make_smollm2_run(tmp_path / "run", [records])
    cfg = load_capture_config(config_file(tmp_path, tiny_llama(tmp_path / "model")))
    new_capture(run, cfg)
    capture_in_process(run, cfg, records)
    return run
