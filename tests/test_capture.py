"""`regen capture` on SmolLM2-135M (CPU, route transformers, real Ray actors), checked against a layer loop written
here, and its exports through SpecForge's and speculators' own loaders; beside a live generation; SIGKILL and resume.

The reference never calls the model's forward: it runs the embedding, each decoder layer module and the final norm
itself, so it shares no code path with the capture route (one forward with output_hidden_states)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import orjson
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.hidden.parts import hidden_parts, iter_hidden
from pipeline.store.capture_ledger import capture_run_dir
from pipeline.store.faults import kill_at_data_part
from tests.helpers import run_regen, start_regen, wait_for
from tests.smollm2_run import SAMPLES, add_part, make_smollm2_run, smollm2_records
from tests.trainlib import run_checks

pytestmark = pytest.mark.torch

AUX = [2, 15, 27]  # [2, L//2, L-3] for L = 30


@pytest.fixture(scope="module")
def model_dir():
    from tests.smollm2_hf import smollm2_hf_dir

    return smollm2_hf_dir()


class LayerLoop:
    """States of every layer by running the modules one at a time: [T, L + 1, H] pre-norm inputs, plus post-norm."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def states(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inner = self.model.model
        with torch.inference_mode():
            x = inner.embed_tokens(torch.tensor([ids]))
            positions = torch.arange(len(ids))[None]
            rope = inner.rotary_emb(x, positions)
            inputs = [x[0]]
            for layer in inner.layers:  # causal attention: no mask given, more than one query
                out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
                x = out[0] if isinstance(out, tuple) else out
                inputs.append(x[0])
            return torch.stack(inputs, dim=1), inner.norm(x)[0]


@pytest.fixture(scope="module")
def ref(model_dir):
    return LayerLoop(model_dir)


def write_capture_config(tmp_path, model_dir, **extra):
    cfg = {"route": "transformers", "model": str(model_dir), "actors": 1, "actor_num_cpus": 1, "torch_threads": 1,
           "prompts_per_call": 1, "flush_records": 1, "flush_interval_s": 0.5, **extra}
    path = tmp_path / "capture.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def bf16_close(stored: np.ndarray, expected: torch.Tensor) -> dict:
    """Within bf16 rounding: |stored - ref| <= 2^-8 |ref| (half an ulp) plus float32 slack of the two passes."""
    exp = expected.double().numpy()
    diff = np.abs(stored.astype(np.float64) - exp)
    over = int((diff > np.abs(exp) * 2.0 ** -8 * 1.05 + 2e-3).sum())
    assert over == 0, f"{over} values beyond bf16 rounding (max diff {diff.max():.3g})"
    return {"max_abs_diff": float(diff.max())}


def stored_samples(run):
    cap = capture_run_dir(run)
    layout = orjson.loads(cap.manifest_path.read_bytes())["layout"]
    out = {}
    for s in iter_hidden(cap):
        out[s.prompt_id] = (s, np.asarray(s.hidden, dtype=np.float32).reshape(s.n_rows, len(layout["states"]),
                                                                              layout["hidden_size"]))
    return layout, out


def test_capture_beside_a_live_generation_matches_the_layer_loop_and_loads_in_both_libraries(
        tmp_path, ray_cluster, model_dir, ref):
    records = smollm2_records(ref.tok)
    no_ids = smollm2_records(ref.tok, [("q9", "Hi", "Hello.", "stop")], token_ids=False)  # as llama.cpp gives
    run = make_smollm2_run(tmp_path / "run", [records[:2] + no_ids])
    # a live generation: its lock is held by another process; capture never takes it
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pipeline.store.rundir import RunDir, RunLock
        with RunLock(RunDir({str(run.path)!r})):
            print("locked", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    config = write_capture_config(tmp_path, model_dir, follow=True, poll_interval_s=0.5)
    started = time.monotonic()
    proc = start_regen("capture", str(run.path), "--config", str(config), log=tmp_path / "capture.log")
    cap = capture_run_dir(run)
    try:
        wait_for(lambda: len(cap.committed_ids()) >= 2, timeout=240, interval=0.2, what="the committed prompts")
        add_part(run, records[2:])  # generation commits more while the capture runs
        wait_for(lambda: len(cap.committed_ids()) == 4, timeout=120, interval=0.2, what="the new part")
        assert proc.poll() is None, "follow: the capture waits while the generation holds its lock"
    finally:
        holder.kill()
        holder.wait()
    assert proc.wait(timeout=120) == 0, (tmp_path / "capture.log").read_text()[-3000:]
    wall = time.monotonic() - started
    log = (tmp_path / "capture.log").read_text()
    assert "1 records refused: no token ids" in log

    # one sample per exported record, with the token export's id, exactly once
    ledger = cap.read_table(cap.data).to_pylist()
    assert sorted(r["sample_id"] for r in ledger) == [f"{pid}#turn0" for pid, *_ in SAMPLES]
    layout, samples = stored_samples(run)
    assert layout["aux_layer_ids"] == AUX and [s["kind"] for s in layout["states"]] == \
        ["aux", "aux", "aux", "final_post_norm", "last_pre_norm"]
    reference = {}
    for rec in records:
        ids = rec["prompt_token_ids"] + rec["output_token_ids"]
        sample, stored = samples[rec["prompt_id"]]
        assert sample.token_ids.tolist() == ids and stored.shape[0] == len(ids)  # T rows for T tokens
        inputs, post = ref.states(ids)
        for k, layer in enumerate(AUX):
            bf16_close(stored[:, k], inputs[:, layer])
        bf16_close(stored[:, 3], post)
        bf16_close(stored[:, 4], inputs[:, 30])
        reference[rec["prompt_id"]] = (ids, inputs, post, rec)

    # bf16 on disk within 2% of the ideal (T x K x H x 2 bytes)
    ideal = sum(len(ids) * 5 * 576 * 2 for ids, *_ in reference.values())
    on_disk = sum(p.size() for p in hidden_parts(cap))
    assert on_disk <= ideal * 1.02, (on_disk, ideal)
    route_s = sum(r["capture_s"] for r in ledger)
    tokens = sum(r["n_tokens"] for r in ledger)
    print(f"\ncapture: {tokens} tokens, route (forward pass) {tokens / route_s:.0f} tok/s, whole command "
          f"{tokens / wall:.1f} tok/s in {wall:.1f}s; on disk {on_disk} bytes, ideal {ideal} ({on_disk / ideal:.4f}x)")

    status = run_regen("status", str(run.path), "--json")
    assert status.returncode == 0, status.stderr
    report = orjson.loads(status.stdout)["capture"]
    assert (report["captured"], report["capturable"], report["refused_no_token_ids"]) == (4, 4, 1)
    assert report["state"] == "complete"
    assert run_regen("card", str(run.path)).returncode == 0
    assert "4 of 4 samples" in (run.path / "README.md").read_bytes().decode()

    check_exports(tmp_path, run, reference)


def check_exports(tmp_path, run, reference):
    """Both hidden-state exports through the libraries' loaders: every row is the layer loop's, masks as expected."""
    sf = tmp_path / "sf-offline"
    assert run_regen("export", str(run.path), "--format", "specforge-offline", "--out", str(sf)).returncode == 0
    got = run_checks({"check": "specforge_offline", "path": str(sf), "save": str(tmp_path / "sf.pt")})
    assert got["n"] == 4 and got["trainer_reader_same_batch"]
    items = torch.load(tmp_path / "sf.pt", weights_only=False)["items"]
    for item in items:
        ids = item["input_ids"][0].tolist() if item["input_ids"].dim() == 2 else item["input_ids"].tolist()
        pid = next(p for p, (r_ids, *_) in reference.items() if r_ids == ids)
        _, inputs, post, rec = reference[pid]
        T, P = len(ids), len(rec["prompt_token_ids"])
        aux = item["hidden_state"].reshape(T, 3, 576).float().numpy()  # SpecForge's loader swaps the names
        for k, layer in enumerate(AUX):
            bf16_close(aux[:, k], inputs[:, layer])
        bf16_close(item["target"].reshape(T, 576).float().numpy(), post)
        mask = item["loss_mask"].reshape(-1).tolist()
        expected = [0] * P + [1] * (T - P)
        expected[-1] = 0  # SpecForge's loader zeroes the last position itself; a truncated one is 0 already
        assert mask == expected, pid

    spec = tmp_path / "spec-hidden"
    assert run_regen("export", str(run.path), "--format", "speculators-hidden", "--out", str(spec)).returncode == 0
    got = run_checks({"check": "speculators_hidden", "path": str(spec), "save": str(tmp_path / "spec.pt")})
    assert got["checked"] == 4 and got["not_loaded"] == [], got
    saved = torch.load(tmp_path / "spec.pt", weights_only=False)
    for item in saved["items"]:
        ids = item["input_ids"].tolist()
        pid = next(p for p, (r_ids, *_) in reference.items() if r_ids == ids)
        _, inputs, post, rec = reference[pid]
        T, P = len(ids), len(rec["prompt_token_ids"])
        aux = item["hidden_states"].reshape(T, 3, 576).float().numpy()
        for k, layer in enumerate(AUX):
            bf16_close(aux[:, k], inputs[:, layer])
        bf16_close(item["verifier_last_hidden_states"].float().numpy(), inputs[:, 30])  # before the final norm
        expected = [0] * P + [1] * (T - P)
        if rec["finish_reason"] == "length":
            expected[-1] = 0
        assert item["loss_mask"].tolist() == expected, pid
    assert saved["batch"]["input_ids"].shape[-1] == 4096  # the packed batch of its own collate


def test_sigkill_during_capture_then_resume_captures_each_sample_exactly_once(tmp_path, ray_cluster, model_dir, ref):
    samples = [(f"k{i}", f"Tell me fact number {i} about owls.", f"Owls fact {i}: they can turn their heads.",
                "stop") for i in range(8)]
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(ref.tok, samples)])
    config = write_capture_config(tmp_path, model_dir)
    cap = capture_run_dir(run)
    # SIGKILLed at its third commit (flush_records 1: after two samples, the third's hidden part written but not
    # referenced); a kill from outside after a first commit could land after the last one on a loaded machine
    proc = start_regen("capture", str(run.path), "--config", str(config), env=kill_at_data_part(3),
                       log=tmp_path / "first.log")
    assert proc.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    before = cap.committed_ids()
    assert 1 <= len(before) < 8, "the kill must land mid-capture"
    resumed = run_regen("capture", str(run.path), "--config", str(config), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ledger = cap.read_table(cap.data).to_pylist()
    assert sorted(r["sample_id"] for r in ledger) == sorted(f"k{i}#turn0" for i in range(8))  # none twice
    named = {r["hidden_part"] for r in ledger}
    assert {p.name for p in hidden_parts(cap)} == named  # what the kill left unreferenced is gone
    for rec in smollm2_records(ref.tok, samples)[:3]:
        ids = rec["prompt_token_ids"] + rec["output_token_ids"]
        sample = next(s for s in iter_hidden(cap) if s.prompt_id == rec["prompt_id"])
        inputs, post = ref.states(ids)
        stored = np.asarray(sample.hidden, dtype=np.float32).reshape(len(ids), 5, 576)
        bf16_close(stored[:, 3], post)
    again = run_regen("capture", str(run.path), "--config", str(config))
    assert again.returncode == 0 and len(cap.read_table(cap.data)) == 8  # a rerun captures nothing twice


def test_a_changed_layer_choice_is_drift(tmp_path, model_dir, ref):
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(ref.tok)[:1]])
    cap = capture_run_dir(run)
    cap.path.mkdir()
    from pipeline.capture import open_capture
    from pipeline.core.capture_config import load_capture_config

    open_capture(run, load_capture_config(write_capture_config(tmp_path, model_dir)))
    other = load_capture_config(write_capture_config(tmp_path, model_dir, aux_layer_ids=[1, 14, 26]))
    from pipeline.core.errors import DriftError

    with pytest.raises(DriftError, match="aux_layer_ids"):
        open_capture(run, other)
