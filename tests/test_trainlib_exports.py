"""The text exports through SpecForge's and speculators' own loaders (tests/trainlib.py), on records carrying
SmolLM2's exact token ids: what each library trains on is what the target generated, and nothing else."""
from __future__ import annotations

import orjson
import pytest

pytest.importorskip("transformers")

from pipeline.export.jsonl import export_run, manifest_path
from tests.smollm2_run import make_smollm2_run, smollm2_records
from tests.trainlib import require_trainlib, run_checks



@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    require_trainlib()
    from tests.smollm2_hf import smollm2_hf_dir

    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def run(tmp_path, tok):
    records = smollm2_records(tok)
    return make_smollm2_run(tmp_path / "run", [records[:2], records[2:]]), records


def _target(records):
    return {r["prompt_id"]: (r["prompt_token_ids"], r["output_token_ids"], r["finish_reason"]) for r in records}


def test_specforge_tokens_export_loads_unchanged_and_masks_a_truncated_end(tmp_path, run):
    rd, records = run
    out = tmp_path / "sf-tokens.jsonl"
    summary = export_run(rd.path, "specforge-tokens", out)
    got = run_checks({"check": "specforge_rows", "path": str(out)})["rows"]
    assert len(got) == len(records) == summary.rows_written
    by_ids = {tuple(r["input_ids"]): r["loss_mask"] for r in got}
    for prompt, output, finish in _target(records).values():
        mask = by_ids[tuple(prompt + output)]  # SpecForge kept the ids exactly as the target saw and wrote them
        expected = [0] * len(prompt) + [1] * len(output)
        if finish == "length":
            expected[-1] = 0
        assert mask == expected
    assert summary.masked_truncated == 1


def test_speculators_export_through_prepare_data(tmp_path, run, tokenizer_dir):
    rd, records = run
    out = tmp_path / "spec.jsonl"
    export_run(rd.path, "speculators", out)
    got = run_checks({"check": "speculators_prepare", "path": str(out), "tokenizer": str(tokenizer_dir),
                      "out": str(tmp_path / "prepared")})
    assert got["columns"] == ["input_ids", "loss_mask", "seq_len"]
    rows = {tuple(r["input_ids"]): r["loss_mask"] for r in got["rows"]}
    assert len(rows) == len(records)
    for prompt, output, finish in _target(records).values():
        expected = [0] * len(prompt) + [1] * len(output)
        if finish == "length":
            expected[-1] = 0
        assert rows[tuple(prompt + output)] == expected


def test_conversation_export_drops_truncated_and_renders_the_exact_prompt_with_lfm(tmp_path, run, tokenizer_dir):
    rd, records = run
    out = tmp_path / "sf.jsonl"
    summary = export_run(rd.path, "specforge", out)
    assert summary.dropped == {"truncated": 1} and summary.rows_written == 3
    manifest = orjson.loads(manifest_path(out).read_bytes())
    assert "lfm" in manifest["chat_template"]["specforge"]
    target = _target(records)
    for template, exact in (("lfm", True), ("qwen", False)):
        got = run_checks({"check": "specforge_rows", "path": str(out), "tokenizer": str(tokenizer_dir),
                          "template": template, "train_only_last_turn": True})["rows"]
        assert len(got) == 3
        for row in got:
            matches = [pid for pid, (prompt, output, _) in target.items()
                       if row["input_ids"][:len(prompt + output)] == prompt + output]
            assert bool(matches) == exact, template
            if exact:
                prompt, output, _ = target[matches[0]]
                # SpecForge trains the reply (with the end-of-turn the model did generate), never the prompt
                assert not any(row["loss_mask"][:len(prompt)])
                assert all(row["loss_mask"][len(prompt):len(prompt + output)])


def test_keep_truncated_shows_why_the_default_drops_it(tmp_path, run, tok, tokenizer_dir):
    rd, records = run
    out = tmp_path / "sf-all.jsonl"
    assert export_run(rd.path, "specforge", out, keep_truncated=True).rows_written == 4
    got = run_checks({"check": "specforge_rows", "path": str(out), "tokenizer": str(tokenizer_dir),
                      "template": "lfm", "train_only_last_turn": True})["rows"]
    prompt, output, _ = _target(records)["p1"]
    row = next(r for r in got if r["input_ids"][:len(prompt + output)] == prompt + output)
    trained = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    # SpecForge closes the cut reply with <|im_end|> and trains it: a token the target never generated
    assert tok.convert_tokens_to_ids("<|im_end|>") in trained[len(output):]


def test_train_only_last_turn_is_a_data_key_as_specforge_reads_it(tmp_path, run, tokenizer_dir):
    rd, _ = run
    out = tmp_path / "sf.jsonl"
    settings = export_run(rd.path, "specforge", out).specforge_settings
    assert settings == {"data": {"train_only_last_turn": True}, "overrides": ["data.train_only_last_turn=true"]}
    base = {"model": {"target_model_path": str(tokenizer_dir)},
            "data": {"train_data_path": str(out), "max_length": 4096, "chat_template": "lfm"},
            "training": {"role": "auto"},
            "deployment": {"mode": "disaggregated", "disaggregated": {
                "control_dir": str(tmp_path / "control"), "backend": "mooncake",
                "server_urls": ["http://127.0.0.1:30000"]}}}

    def load(doc, overrides=()):
        path = tmp_path / "train.yaml"
        path.write_bytes(orjson.dumps(doc))  # JSON is YAML
        return run_checks({"check": "specforge_config", "yaml": str(path), "overrides": list(overrides)})

    merged = {**base, "data": {**base["data"], **settings["data"]}}
    assert load(merged) == {"ok": True, "train_only_last_turn": True, "chat_template": "lfm"}
    assert load(base, settings["overrides"])["train_only_last_turn"] is True
    refused = load({**base, "train_only_last_turn": True})  # the old README's top-level key
    assert not refused["ok"] and "train_only_last_turn" in refused["message"]


def test_specforge_reads_the_data_source_from_run_yaml_and_an_override_only_replaces_it(tmp_path, tokenizer_dir):
    """The run.yaml of docs/exports-and-training.md: SpecForge validates the file before its overrides, so the
    file names the one data source; an override replaces it, or adds a second one that SpecForge refuses."""
    base = {"model": {"target_model_path": str(tokenizer_dir)}, "training": {"role": "auto"},
            "deployment": {"mode": "disaggregated", "disaggregated": {
                "control_dir": str(tmp_path / "control"), "backend": "mooncake",
                "server_urls": ["http://127.0.0.1:30000"]}}}
    cases = [({"prompts_path": "tok.jsonl"}, []),
             ({"train_data_path": "sf.jsonl", "chat_template": "lfm", "train_only_last_turn": True}, []),
             ({}, ["data.prompts_path=tok.jsonl"]),  # no source in the file
             ({"train_data_path": "sf.jsonl"}, ["data.prompts_path=tok.jsonl"]),  # a second one by override
             ({"train_data_path": "sf.jsonl"}, ["data.train_data_path=", "data.prompts_path=tok.jsonl"])]
    configs = []
    for i, (data, overrides) in enumerate(cases):
        path = tmp_path / f"run{i}.yaml"
        path.write_bytes(orjson.dumps({**base, "data": data}))  # JSON is YAML
        configs.append({"yaml": str(path), "overrides": overrides})
    tokens, conversations, none_in_file, two, switched = run_checks({"check": "specforge_configs",
                                                                     "configs": configs})["results"]
    assert tokens["ok"] and switched["ok"], (tokens, switched)
    assert conversations == {"ok": True, "train_only_last_turn": True, "chat_template": "lfm"}
    for refused in (none_in_file, two):
        assert not refused["ok"] and "set exactly one of" in refused["message"], refused
