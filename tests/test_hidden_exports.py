"""The hidden-state exports (specforge-offline, speculators-hidden): the same samples as the token exports under
every filter, a folder written whole (an earlier export's files never left behind, a folder regen did not write
refused, a killed export leaving nothing a loader would take), a capture mixing widths named, and
`--speculators-data` naming the folder it wrote."""
from __future__ import annotations

import os

import orjson
import pytest

from pipeline.core.capture_config import load_capture_config
from tests.smollm2_run import make_smollm2_run, smollm2_records
from tests.capture_helpers import (  # noqa: F401 (fixtures by name)
    capture_in_process, captured_tiny_run, config_file, new_capture, tiny_llama, tok,
)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


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
