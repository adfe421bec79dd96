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
    from pipeline.hidden.errors import StoredLayoutMismatch

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


# --- D2 / D4: follow beside a live generation --------------------------------------------------------------------
def hold_generation_lock(run, script: str):
    """A live generation in another process: holds RUN's lock while `script` runs (`run`, `recs`, `add_part`)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipeline.store.rundir import RunDir, RunLock
        from pipeline.store.capture_ledger import capture_run_dir
        from tests.smollm2_run import add_part, smollm2_records
        from transformers import AutoTokenizer
        from tests.smollm2_hf import smollm2_hf_dir
        recs = smollm2_records(AutoTokenizer.from_pretrained(smollm2_hf_dir()))
        run = RunDir({str(run.path)!r})
        cap = capture_run_dir(run)
        with RunLock(run):
            print("locked", flush=True)
    """) + textwrap.indent(textwrap.dedent(script), "    ")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_follow_captures_the_last_commit_made_while_it_was_between_listing_and_the_lock_check(
        tmp_path, ray_cluster, tok):
    """The race forced: the pass that finds nothing new lets generation commit its last part and release its lock
    before the capture looks at the lock (a wrapper around the real pending_samples)."""
    import subprocess
    import sys
    import textwrap

    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    go, done = tmp_path / "go", tmp_path / "done"
    holder = hold_generation_lock(run, f"""
        while not Path({str(go)!r}).exists(): time.sleep(0.05)
        add_part(run, recs[1:])  # generation's last commit, then its lock is released
    """)
    config = config_file(tmp_path, model, follow=True, poll_interval_s=0.2)
    child = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import pipeline.capture as pc
        real, calls = pc.pending_samples, [0]
        def wrapped(*a, **k):
            out = real(*a, **k)
            calls[0] += 1
            if calls[0] == 2 and not out.prompts:
                Path({str(go)!r}).touch()
                while Path({str(go)!r}).exists() and not Path({str(done)!r}).exists(): time.sleep(0.05)
            return out
        pc.pending_samples = wrapped
        sys.argv = ["regen", "capture", {str(run.path)!r}, "--config", {str(config)!r}]
        from pipeline.cli import main; sys.exit(main())
    """)
    import threading

    threading.Thread(target=lambda: (holder.wait(), done.touch()), daemon=True).start()
    try:
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capture complete" in proc.stderr
    assert sorted(capture_run_dir(run).committed_ids()) == ["p0", "p1", "p2", "p3"]


def test_follow_keeps_one_actor_across_passes(tmp_path, ray_cluster, tok):
    from pipeline.hidden.parts import HIDDEN_PART_RE
    from tests.helpers import run_regen

    model = tiny_llama(tmp_path / "model")
    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    holder = hold_generation_lock(run, """
        for k in (1, 2, 3):  # a commit each time the capture has caught up
            while not (cap.exists() and len(cap.committed_ids()) >= k): time.sleep(0.1)
            add_part(run, recs[k:k + 1])
        while len(cap.committed_ids()) < 4: time.sleep(0.1)
    """)
    try:
        proc = run_regen("capture", str(run.path), "--config",
                         str(config_file(tmp_path, model, follow=True, poll_interval_s=0.2)))
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = [HIDDEN_PART_RE.match(p.name) for p in hidden_parts(capture_run_dir(run))]
    assert len(parts) == 4 and len({m.group(1) for m in parts}) == 1
    # one actor (its model loaded once) wrote the four passes' parts: its part counter ran on, 1 to 4
    assert sorted(int(m.group(4)) for m in parts) == [1, 2, 3, 4]


# --- D3: one bad record fails alone, named ----------------------------------------------------------------------
def test_a_record_the_route_cannot_take_fails_alone_and_is_named(tmp_path, ray_cluster, tok):
    from tests.helpers import run_regen

    model = tiny_llama(tmp_path / "model")
    records = smollm2_records(tok)
    records[2]["output_token_ids"] = records[2]["output_token_ids"][:-1] + [60000]  # past the 49152-token vocab
    run = make_smollm2_run(tmp_path / "run", [records])
    proc = run_regen("capture", str(run.path), "--config", str(config_file(tmp_path, model, prompts_per_call=4)))
    assert proc.returncode == 1
    assert sorted(capture_run_dir(run).committed_ids()) == ["p0", "p1", "p3"]  # its batch's good prompts captured
    failed = [line for line in proc.stderr.splitlines() if "capture of prompt" in line]
    assert len(failed) == 1 and "prompt p2" in failed[0] and "token id 60000" in failed[0], proc.stderr[-3000:]
    assert '"failed_prompts":1' in proc.stderr


# --- D5: the hidden-state exports apply the token exports' filters ----------------------------------------------
def captured_tiny_run(tmp_path, tok, records=None):
    records = records or smollm2_records(tok)
    run = make_smollm2_run(tmp_path / "run", [records])
    cfg = load_capture_config(config_file(tmp_path, tiny_llama(tmp_path / "model")))
    new_capture(run, cfg)
    capture_in_process(run, cfg, records)
    return run


@pytest.mark.parametrize("flags", [[], ["--drop-truncated"], ["--drop-flagged"], ["--source", "other"]])
def test_hidden_and_token_exports_hold_the_same_samples_under_each_filter(tmp_path, tok, flags):
    from pipeline.cli import main

    records = smollm2_records(tok)
    records[3]["source"] = "other"
    run = captured_tiny_run(tmp_path, tok, records)
    assert main(["export", str(run.path), "--format", "specforge-tokens", "--out", str(tmp_path / "t.jsonl"),
                 *flags]) == 0
    token_ids = sorted(orjson.loads(line)["id"] for line in (tmp_path / "t.jsonl").read_text().splitlines())
    assert main(["export", str(run.path), "--format", "specforge-offline", "--out", str(tmp_path / "sf"), *flags]) == 0
    files = orjson.loads((tmp_path / "sf" / "manifest.json").read_bytes())["files"]
    assert sorted(f["sample_id"] for f in files) == token_ids
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == len(token_ids)
    kept = {(): records, ("--drop-truncated",): [r for r in records if r["finish_reason"] != "length"],
            ("--drop-flagged",): [r for r in records if not r["flags"]],
            ("--source", "other"): [r for r in records if r["source"] == "other"]}[tuple(flags)]
    assert token_ids == sorted(f"{r['prompt_id']}#turn0" for r in kept) and 0 < len(kept) <= 4


# --- D6: folder exports are replaced whole ----------------------------------------------------------------------
def test_an_export_into_an_earlier_exports_folder_leaves_none_of_its_files(tmp_path, tok):
    from pipeline.cli import main
    from tests.trainlib import run_checks

    records = smollm2_records(tok)
    records[3]["source"] = "other"
    run = captured_tiny_run(tmp_path, tok, records)
    out = tmp_path / "sf"
    assert main(["export", str(run.path), "--format", "specforge-offline", "--out", str(out)]) == 0
    assert main(["export", str(run.path), "--format", "specforge-offline", "--out", str(out), "--source", "other"]) == 0
    assert [p.name for p in out.rglob("*.ckpt")] == ["data_0.ckpt"]
    got = run_checks({"check": "specforge_offline", "path": str(out), "save": str(tmp_path / "sf.pt")})
    assert got["n"] == 1  # SpecForge's own glob finds only this export's sample
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".regen")] == []


def test_an_export_refuses_a_folder_it_did_not_write(tmp_path, tok):
    from pipeline.cli import main

    run = captured_tiny_run(tmp_path, tok)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export", str(run.path), "--format", "speculators-hidden", "--out", str(out)]) != 0
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_killed_export_leaves_no_file_a_loader_would_take(tmp_path, tok):
    import os
    import signal
    import subprocess
    import sys

    run = captured_tiny_run(tmp_path, tok)
    out = tmp_path / "sf"
    child = f"""
import os, signal, sys
real, n = os.replace, [0]
def replace(a, b):
    if str(b).endswith(".ckpt"):
        n[0] += 1
        if n[0] == 3: os.kill(os.getpid(), signal.SIGKILL)  # data_2 written, not yet renamed
    return real(a, b)
os.replace = replace
from pipeline.cli import main
sys.exit(main(["export", {str(run.path)!r}, "--format", "specforge-offline", "--out", {str(out)!r}]))
"""
    killed = subprocess.run([sys.executable, "-c", child], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists() or not list(out.rglob("*.ckpt"))  # nothing under the target a glob could load
    import re

    partial = [p for p in tmp_path.rglob("*.ckpt") if not re.fullmatch(r"data_\d+\.ckpt", p.name)]
    assert partial == [], "a killed writer's temporary file matches *.ckpt"
    from pipeline.cli import main

    assert main(["export", str(run.path), "--format", "specforge-offline", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.rglob("*")) == sorted(
        ["manifest.json", "rows_0-2000", "data_0.ckpt", "data_1.ckpt", "data_2.ckpt", "data_3.ckpt"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".regen")] == []


# --- D7: counts, names and messages -------------------------------------------------------------------------------
def all_turns_records(tok, pid, turns, no_ids_turn=None):
    from pipeline.store.quality import quality_flags

    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows, messages = [], []
    for k, (user, reply) in enumerate(turns):
        messages = messages + [{"role": "user", "content": user}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        output = tok.encode(reply, add_special_tokens=False) + [end]
        ids = k != no_ids_turn
        rows.append({"prompt_id": pid, "turn_index": k, "n_turns": len(turns), "source": "test", "messages": messages,
                     "content": reply, "reasoning_content": None, "finish_reason": "stop",
                     "flags": quality_flags(reply, None, "stop"), "prompt_tokens": len(prompt),
                     "completion_tokens": len(output), "endpoint": "e0", "model": "SmolLM2-135M-Instruct",
                     "config_fingerprint": "fp-smollm2", "prompt_token_ids": prompt if ids else None,
                     "output_token_ids": output if ids else None})
        messages = messages + [{"role": "assistant", "content": reply}]
    return rows


def test_all_turns_a_turn_without_ids_is_refused_alone_and_the_capture_completes(tmp_path, ray_cluster, tok):
    from pipeline.cli import main
    from pipeline.store.capture_ledger import capture_counts
    from tests.helpers import run_regen

    records = (all_turns_records(tok, "a", [("Hi there.", "Hello!"), ("Name a colour.", "Blue.")])
               + all_turns_records(tok, "b", [("One?", "Two."), ("Three?", "Four.")], no_ids_turn=1))
    run = make_smollm2_run(tmp_path / "run", [records], mode="all_turns")
    proc = run_regen("capture", str(run.path), "--config", str(config_file(tmp_path, tiny_llama(tmp_path / "m"))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cap = capture_run_dir(run)
    captured = sorted(cap.read_table(cap.data).column("sample_id").to_pylist())
    assert main(["export", str(run.path), "--format", "specforge-tokens", "--out", str(tmp_path / "t.jsonl")]) == 0
    exported = sorted(orjson.loads(line)["id"] for line in (tmp_path / "t.jsonl").read_text().splitlines())
    assert captured == exported == ["a#turn0", "a#turn1", "b#turn0"]
    counts = capture_counts(run)
    assert (counts["state"], counts["captured"], counts["capturable"], counts["refused_no_token_ids"]) == \
        ("complete", 3, 3, 1)


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


def test_the_capture_space_check_gives_capture_advice_in_human_units(tmp_path, tok):
    from pipeline.capture import Pending, check_space
    from pipeline.hidden.errors import InsufficientStorage

    run = make_smollm2_run(tmp_path / "run", [smollm2_records(tok)[:1]])
    cap, _ = new_capture(run, load_capture_config(config_file(tmp_path, tiny_llama(tmp_path / "model"))))
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(InsufficientStorage) as err:
        check_space(cap, Pending(tokens=free // 300 + 1), 5 * 64, force=False)  # 644 bytes a token
    message = str(err.value)
    assert "output_dir" not in message and "max tokens" not in message and "capture" in message
    assert "--force" in message and " 0.00 " not in message


def test_speculators_data_summary_names_the_folder_it_wrote(tmp_path, tok, capsys):
    from datasets import Dataset

    from pipeline.cli import main

    records = smollm2_records(tok)
    run = captured_tiny_run(tmp_path, tok, records)
    prepared = tmp_path / "prepared"  # the rows `speculators prepare-data` saves, in another order
    Dataset.from_dict({"input_ids": [r["prompt_token_ids"] + r["output_token_ids"] for r in records[::-1]]}) \
        .save_to_disk(str(prepared))
    assert main(["export", str(run.path), "--format", "speculators-hidden", "--out", str(tmp_path / "unused"),
                 "--speculators-data", str(prepared)]) == 0
    summary = [line for line in capsys.readouterr().err.splitlines() if "samples in" in line]
    assert summary == [f"regen: speculators-hidden: 4 samples in {prepared / 'hidden_states'} "
                       "(manifest.json says which layers and which norm convention)"]
    assert sorted(p.name for p in (prepared / "hidden_states").glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(4)]
    assert not (tmp_path / "unused").exists()
