"""The capture's identity is its model's, not its name: a replaced model folder, a weight file changed in the
middle, a capture made by an older regen (upgraded in place when it is the same folder, drift when not), and a
model whose name differs from the run's. Tiny random Llamas with SmolLM2's vocabulary (built here, a few MB) stand
in for a real model wherever the states' values do not matter; records carry SmolLM2's real token ids."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from pipeline.capture import open_capture
from pipeline.core.capture_config import load_capture_config
from pipeline.core.errors import DriftError
from pipeline.hidden.layout import CaptureLayout, capture_fingerprint
from pipeline.hidden.parts import hidden_parts
from pipeline.store.capture_ledger import capture_run_dir
from tests.capture_helpers import (  # noqa: F401 (fixtures by name)
    capture_in_process, config_file, new_capture, tiny_llama, tok,
)
from tests.smollm2_run import make_smollm2_run, smollm2_records


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def as_unversioned_capture(run, model: Path) -> dict:
    """Rewrite capture.json as regen before the identity version wrote it: weights = sha256 of the sorted
    [name, size, mtime_ns] listing of the weight files, no identity_version, the fingerprint over that identity."""
    cap = capture_run_dir(run)
    manifest = cap.read_manifest()
    files = sorted(f for f in model.iterdir() if f.name.endswith((".safetensors", ".safetensors.index.json")))
    listing = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    ident = {k: v for k, v in manifest["model_identity"].items() if k not in ("identity_version", "weights_identity")}
    ident["weights"] = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
    layout = CaptureLayout.from_dict(manifest["layout"])
    old = {**manifest, "model_identity": ident,
           "fingerprint": capture_fingerprint(manifest["route"], layout, ident, manifest["compute_dtype"])}
    cap.write_manifest(old)
    return old


def identity(model, mode="sampled"):
    from transformers import AutoConfig

    from pipeline.hidden.routes import model_identity

    return model_identity(str(model), AutoConfig.from_pretrained(model), mode)


def flipped_copy(model: Path, dest: Path, offset: int) -> Path:
    """The model with one byte of its safetensors file inverted at `offset` (same size, same header)."""
    import shutil

    shutil.copytree(model, dest)
    with (dest / "model.safetensors").open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dest


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


def test_a_capture_model_named_otherwise_than_the_runs_is_warned_about(tmp_path, tok, caplog):
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])  # generation.model SmolLM2-135M-Instruct
    with caplog.at_level("WARNING", logger="regen"):
        new_capture(run, load_capture_config(config_file(tmp_path, tiny_llama(tmp_path / "tiny8"))))
    assert any("tiny8" in r.message and "SmolLM2-135M-Instruct" in r.message for r in caplog.records)
    caplog.clear()
    same = tiny_llama(tmp_path / "SmolLM2-135M-Instruct")
    run2 = make_smollm2_run(tmp_path / "run2", [smollm2_records(tok)[:1]])
    with caplog.at_level("WARNING", logger="regen"):
        new_capture(run2, load_capture_config(config_file(tmp_path, f"{same}/")))
    assert not [r for r in caplog.records if "generated this run" in r.message]


def test_an_unversioned_capture_on_the_same_folder_is_upgraded_and_resumes(tmp_path, tok, caplog):
    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)[:2]
    run = make_smollm2_run(tmp_path / "run", [records])
    cfg = load_capture_config(config_file(tmp_path, model))
    new_capture(run, cfg)
    old = as_unversioned_capture(run, model)
    caplog.set_level("INFO", logger="regen")
    _, manifest = open_capture(run, cfg)
    on_disk = capture_run_dir(run).read_manifest()
    assert on_disk == manifest and on_disk["fingerprint"] != old["fingerprint"]
    assert "identity_version" in on_disk["model_identity"] and "upgraded" in caplog.text
    capture_in_process(run, cfg, records[:1], expected=manifest)  # the actor's check agrees with the upgrade
    open_capture(run, cfg)  # and the next start is a plain resume


def test_an_unversioned_capture_whose_folder_was_touched_is_drift(tmp_path, tok):
    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    cfg = load_capture_config(config_file(tmp_path, model))
    new_capture(run, cfg)
    old = as_unversioned_capture(run, model)
    for f in model.iterdir():
        os.utime(f, ns=(10**18, 10**18))  # the older form cannot tell a re-save from a copy: drift, as it was
    with pytest.raises(DriftError, match="model_identity.weights"):
        open_capture(run, cfg)
    assert capture_run_dir(run).read_manifest() == old  # left as it was


def test_a_middle_of_file_change_is_drift_under_full_and_under_sampled_when_it_falls_in_a_window(tmp_path, tok):
    import torch
    from transformers import LlamaForCausalLM

    from pipeline.hidden.routes import SAMPLE_BYTES, WINDOWS

    model = tiny_llama(tmp_path / "model")
    size = (model / "model.safetensors").stat().st_size
    assert size > WINDOWS * SAMPLE_BYTES  # sampled, not read whole
    window = 8 * (size - SAMPLE_BYTES) // (WINDOWS - 1)  # the start of a window in the middle of the file
    in_window = flipped_copy(model, tmp_path / "in", window + 100)
    between = flipped_copy(model, tmp_path / "between", window + SAMPLE_BYTES + 100)
    assert identity(in_window)["weights"] != identity(model)["weights"]
    assert identity(between) == identity(model)  # what `sampled` misses (README): a change between its windows
    assert identity(between, "full")["weights"] != identity(model, "full")["weights"]

    # the review's fine-tune: one decoder layer's down_proj scaled by -3, same shapes and header
    tuned = LlamaForCausalLM.from_pretrained(model)
    with torch.no_grad():
        tuned.model.layers[3].mlp.down_proj.weight.mul_(-3.0)
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    cfg = load_capture_config(config_file(tmp_path, model, weights_identity="full"))
    new_capture(run, cfg)
    tuned.save_pretrained(model)
    with pytest.raises(DriftError, match="model_identity.weights"):
        open_capture(run, cfg)
    with pytest.raises(DriftError, match="model_identity.weights_identity: 'full' -> 'sampled'"):
        open_capture(run, load_capture_config(config_file(tmp_path, model)))


def test_an_unversioned_capture_of_a_hub_model_is_upgraded_by_its_revision(tmp_path):
    """A hub model's identity is its revision (no weight digest): an older capture.json of the same revision
    resumes, upgraded; another revision stays drift."""
    import types

    from pipeline.capture import upgraded_identity
    from pipeline.hidden.routes import model_identity
    from pipeline.store.capture_ledger import CaptureDir

    hub = "HuggingFaceTB/SmolLM2-135M"
    config = types.SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=30,
                                   hidden_size=576, vocab_size=49152, _commit_hash="abc123")
    layout = CaptureLayout.build(hub, 30, 576, None)
    now = model_identity(hub, config)
    cfg = types.SimpleNamespace(model=hub, route="transformers")
    cap = CaptureDir(tmp_path / "capture")
    cap.create()
    for revision, upgraded in (("abc123", True), ("other", False)):
        old = {k: v for k, v in now.items() if k not in ("identity_version", "weights_identity")}
        old["revision"] = revision
        before = {"fingerprint": capture_fingerprint("transformers", layout, old, "float32"), "model_identity": old}
        after = upgraded_identity(cap, before, cfg, layout, now, "float32")
        assert (after["fingerprint"] == capture_fingerprint("transformers", layout, now, "float32")) is upgraded
