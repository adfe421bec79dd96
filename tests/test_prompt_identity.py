"""The prompt set in the run directory (issue 17): what selects it is its identity (the spec files' content, the
source files' size, time and digest); a source that cannot be read or gives nothing writes nothing; every
command says so in one line; `regen status`, the card and `regen validate` report what the sources are."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.core.config import load_config
from pipeline.core.errors import DriftError
from pipeline.run import GenerateOptions, materialise
from pipeline.store.rundir import RunDir
from tests.helpers import commit_a_failure, run_regen
from tests.helpers import open_run_as_generate as open_run

DEAD_ENDPOINT = [{"url": "http://127.0.0.1:9", "concurrency": 1}]  # never contacted: these runs stop before


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Tell me fact number {i}."},
                                              {"from": "gpt", "value": f"Fact {i}."}]} for i in range(start, start + n)]


def jsonl(records: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def setup_run(tmp: Path, data: bytes, kind: str = "jsonl", **spec_keys) -> tuple[Path, Path, Path]:
    """(config, spec, data file) of a one-source run in tmp; the spec reads `data` as `kind`."""
    (tmp / "data").mkdir(exist_ok=True)
    data_file = tmp / "data" / f"sharegpt.{kind}"
    data_file.write_bytes(data)
    spec = tmp / "sharegpt.yaml"
    spec.write_text(yaml.safe_dump({"name": "sharegpt", "kind": kind, "path": f"data/sharegpt.{kind}",
                                    "format": "sharegpt", "id_field": "id", **spec_keys}))
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "output_dir": str(tmp / "out"), "model": "m",
                                      "sources": [{"spec": str(spec)}], "endpoints": DEAD_ENDPOINT,
                                      "dead_fleet_deadline_s": 5}))  # a run that gets as far as the fleet ends
    return config, spec, data_file


def start(config: Path, refresh: bool = False):
    """What `regen generate` does before it dispatches: open the run (the drift guard), materialise."""
    cfg = load_config(config)
    run_dir = RunDir(Path(cfg.output_dir) / cfg.run_name)
    open_run(cfg, GenerateOptions(str(config), refresh_prompts=refresh), run_dir)
    return run_dir, materialise(cfg, run_dir, refresh)


def manifest(run: RunDir) -> dict:
    return run.read_manifest()


# --- nothing written when a source fails; one line in every command ------------------------------
def test_a_source_with_no_valid_prompt_exits_2_and_writes_nothing(tmp_path):
    # Regression: every line was rejected, then "complete: 0 records", exit 0.
    bad = [{"id": i, "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}
           for i in range(4)]
    config, _, _ = setup_run(tmp_path, jsonl(bad))
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "regen: error: source 'sharegpt' has no valid prompt: all 4 records were rejected; the most common "
        "reasons: roles_not_alternating 4 (e.g. roles do not alternate: message 2 is user where assistant was "
        "expected). Nothing was written to the run directory; the turns are not in conversation order (user, then "
        "assistant, ...)"]
    assert not (tmp_path / "out" / "t").exists()


def test_a_json_array_named_jsonl_is_one_line_and_writes_nothing(tmp_path):
    config, _, _ = setup_run(tmp_path, json.dumps(rows(50), indent=2).encode(), kind="jsonl")
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 2 and not (tmp_path / "out" / "t").exists()
    assert result.stderr.strip().splitlines() == [
        "regen: error: source 'sharegpt': data/sharegpt.jsonl is one JSON array, not JSON Lines; set `kind: json` "
        "in the spec"]


def test_a_truncated_file_stops_before_anything_runs_and_salvage_runs_what_is_complete(tmp_path):
    text = orjson.dumps(rows(10))
    cut = text[: text.index(b'{"id":"r7"') + 30]
    config, spec, _ = setup_run(tmp_path, cut, kind="json")
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 2 and not (tmp_path / "out" / "t").exists()
    offset = text.index(b',{"id":"r7"')
    assert f"its 7 complete records end at byte {offset:,}" in result.stderr  # one count: not "#6" beside "7"
    assert "keep the 7 complete records" in result.stderr and "#" not in result.stderr
    spec.write_text(spec.read_text() + "salvage: true\n")
    run, prompts = start(config)
    assert prompts.num_rows == 7
    (report,) = manifest(run)["prompt_report"]["sources"]
    assert report["cuts"] == [{"file": "data/sharegpt.json", "offset": offset, "records_kept": 7,
                               "bytes_dropped": len(cut) - offset, "size": len(cut),
                               "problem": "ends in the middle of a record", "unclosed": False}]


def hub_config(tmp: Path) -> Path:
    spec = tmp / "hub.yaml"
    spec.write_text(yaml.safe_dump({"name": "sharegpt", "kind": "hf", "path": "Aeala/ShareGPT_Vicuna_unfiltered",
                                    "format": "sharegpt"}))
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "t", "output_dir": str(tmp / "out"), "model": "m",
                                      "sources": [{"spec": str(spec)}], "endpoints": DEAD_ENDPOINT}))
    return config


@pytest.mark.parametrize("command", [["generate", "--config"], ["simulate", "--endpoints", "1", "--tok-s", "5"],
                                     ["validate"]])
def test_an_unreachable_hub_is_one_line_in_every_command(tmp_path, command):
    # Regression: `regen simulate` printed a long traceback ending in ConnectionError.
    config = hub_config(tmp_path)
    args = command[:1] + ([str(config)] + command[1:] if command[0] == "simulate" else command[1:] + [str(config)])
    result = run_regen(*args, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    out = result.stderr if command[0] != "validate" else result.stdout
    cause = ("cannot load Aeala/ShareGPT_Vicuna_unfiltered[train] from the Hugging Face hub: offline mode is on "
             "(HF_HUB_OFFLINE) and the dataset is not in the local cache; download it and point the spec's `path` "
             "at the local copy (a file or a folder)")
    assert cause in out
    if command[0] != "validate":
        assert result.stderr.strip().splitlines() == [f"regen: error: source 'sharegpt': {cause}"]
    assert not (tmp_path / "out" / "t").exists()


def test_missing_and_unreadable_files_are_one_line_naming_the_cause(tmp_path, monkeypatch):
    config, _, data = setup_run(tmp_path, jsonl(rows(3)))
    data.unlink()
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "source 'sharegpt': path 'data/sharegpt.jsonl' is not a file" in result.stderr
    data.write_bytes(jsonl(rows(3)))
    cfg = load_config(config)
    from pipeline.prompts.errors import SourceError
    from pipeline.store.promptset import stage_prompt_set

    if os.geteuid() != 0:
        data.chmod(0)
    else:  # root reads any file: make the open fail as it would for another user
        real_open = Path.open

        def denied(self, *args, **kwargs):
            if self == data:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(SourceError) as exc:
        stage_prompt_set(cfg)
    assert str(exc.value).startswith("source 'sharegpt': data/sharegpt.jsonl: permission denied")


def test_a_glob_file_gone_between_listing_and_reading_is_an_error_naming_it(tmp_path, monkeypatch):
    # Regression: the file was hashed into run.json's source_files, then silently not read (its prompts missing).
    from pipeline.core.config import load_config
    from pipeline.prompts.errors import SourceError
    from pipeline.store import promptset

    config, _, data = setup_run(tmp_path, jsonl(rows(3)), path="data/part-*.jsonl")
    data.rename(tmp_path / "data" / "part-1.jsonl")
    (tmp_path / "data" / "part-2.jsonl").write_bytes(jsonl(rows(6)[3:]))
    listed = promptset.file_identity

    def list_then_lose_one(specs):
        identity = listed(specs)
        (tmp_path / "data" / "part-2.jsonl").unlink()  # what another process does meanwhile
        return identity

    monkeypatch.setattr(promptset, "file_identity", list_then_lose_one)
    with pytest.raises(SourceError) as exc:
        promptset.stage_prompt_set(load_config(config))
    assert str(exc.value).startswith("source 'sharegpt': data/part-2.jsonl disappeared while the sources were read")
    assert "'data/part-*.jsonl'" in str(exc.value)


# --- the prompt identity ----------------------------------------------------------------------------
def test_a_changed_spec_is_drift_with_a_diff_and_refresh_takes_it(tmp_path):
    # Regression: the spec's content was not in the identity, so a fixed spec reused the stored (empty) set.
    config, spec, _ = setup_run(tmp_path, jsonl(rows(6)))
    run, prompts = start(config)
    commit_a_failure(run.path)  # bound: a run that has committed nothing takes the changed spec
    assert prompts.num_rows == 6
    spec.write_text(spec.read_text() + "limit: 2\n")
    result = run_regen("generate", "--config", str(config), timeout=120)
    assert result.returncode == 3
    assert f"prompts.specs.{spec}.limit: '<absent>' -> 2" in result.stderr
    assert "--refresh-prompts re-reads the sources" in result.stderr
    run, prompts = start(config, refresh=True)
    assert prompts.num_rows == 2 and manifest(run)["prompts"]["specs"][str(spec)]["limit"] == 2
    start(config)  # and it resumes from then on


def test_a_copied_dataset_is_not_drift_and_a_changed_one_is(tmp_path):
    config, _, data = setup_run(tmp_path, jsonl(rows(6)))
    run, _ = start(config)
    commit_a_failure(run.path)
    recorded = manifest(run)["source_files"]
    entry = recorded[str(tmp_path / "sharegpt.yaml")]["data/sharegpt.jsonl"]
    assert (entry["size"], len(entry["sha256"])) == (data.stat().st_size, 64)

    copy = tmp_path / "elsewhere.jsonl"
    shutil.copyfile(data, copy)
    time.sleep(0.01)
    os.replace(copy, data)  # the same bytes, a new file with a new modification time
    assert data.stat().st_mtime_ns != entry["mtime_ns"]
    start(config)  # resumes
    now = manifest(run)["source_files"][str(tmp_path / "sharegpt.yaml")]["data/sharegpt.jsonl"]
    assert now["mtime_ns"] == data.stat().st_mtime_ns and now["sha256"] == entry["sha256"]

    data.write_bytes(jsonl(rows(7)))
    with pytest.raises(DriftError) as exc:
        start(config)
    (line,) = [d for d in exc.value.diff if d.startswith("source file")]
    assert line.startswith(f"source file data/sharegpt.jsonl ({tmp_path / 'sharegpt.yaml'}): "
                           f"{entry['size']:,} -> {data.stat().st_size:,} bytes, content changed (sha256 "
                           f"{entry['sha256'][:12]} -> ")
    run, prompts = start(config, refresh=True)
    assert prompts.num_rows == 7 and len(run.prompt_set_versions()) == 2
    start(config)


def test_a_run_json_written_before_these_keys_still_resumes(tmp_path):
    config, _, _ = setup_run(tmp_path, jsonl(rows(4)))
    run, _ = start(config)
    commit_a_failure(run.path)
    old = manifest(run)
    for key in ("source_files", "prompt_report"):
        del old[key]
    old["prompts"] = {k: old["prompts"][k] for k in ("sources", "selection_seed")}  # as 0b8bac4 wrote it
    run.write_manifest(old)
    _, prompts = start(config)
    assert prompts.num_rows == 4
    adopted = manifest(run)
    assert set(adopted["prompts"]) >= {"specs", "max_prompt_tokens", "tokenizer"} and adopted["source_files"]


def test_a_refresh_that_fails_writes_nothing(tmp_path):
    config, _, data = setup_run(tmp_path, jsonl(rows(4)))
    run, _ = start(config)
    commit_a_failure(run.path)
    before = manifest(run)
    data.write_bytes(jsonl(rows(5))[:-30])  # cut short
    with pytest.raises(Exception, match="ends in the middle of a record"):
        start(config, refresh=True)
    assert manifest(run) == before and len(run.prompt_set_versions()) == 1
    assert len(list((tmp_path / "out" / "t" / "rejects").iterdir())) == 1


# --- reports: status, card, validate ------------------------------------------------------------------
def test_status_and_card_show_every_count_of_the_source_report(tmp_path):
    wild = rows(3) + rows(1) + [{"id": "lead", "conversations": [{"from": "gpt", "value": "Hi!"},
                                                                 {"from": "human", "value": "Q?"}]},
                                {"id": "bs", "conversations": [{"from": "system", "value": ""},
                                                               {"from": "human", "value": "Q2?"}]},
                                {"id": "bad", "conversations": [{"from": "human", "value": " "}]}]
    config, _, data = setup_run(tmp_path, jsonl(wild))
    run, _ = start(config)
    status = run_regen("status", str(run.path))
    assert status.returncode == 0, status.stderr
    assert ("  source sharegpt: read 7, valid 6, rejected 1 (blank_content 1), selected 5, duplicates 1; "
            "dropped turns: blank_system 1, leading_assistant 1") in status.stdout
    assert "  source files: 1 unchanged since the prompt set was built" in status.stdout
    data.write_bytes(data.read_bytes() + b" ")
    status = run_regen("status", str(run.path), "--json")
    report = orjson.loads(status.stdout)
    assert report["sources"][0]["rejected_by_reason"] == {"blank_content": 1}
    assert "changed since the prompt set was built" in report["source_files"][0]

    from pipeline.export.card import gather, render_card

    card = render_card(run, manifest(run), gather(run))
    assert "| sharegpt | 7 | 6 | 1 | 5 | 1 | blank_system 1, leading_assistant 1 | - | blank_content 1 |" in card
    assert "- rejected inputs: 1 — blank_content 1" in card


@pytest.mark.parametrize("text", [b"[]", b"\xef\xbb\xbf \n [ ] \n"])
def test_validate_refuses_a_source_without_records_like_generate(tmp_path, text):
    # Regression: `regen validate` said "is valid" (exit 0) where `regen generate` stops with exit 2.
    config, _, _ = setup_run(tmp_path, text, kind="json")
    out = run_regen("validate", str(config))
    assert out.returncode == 2, out.stdout
    assert "  no records: regen generate refuses a source without a valid prompt" in out.stdout
    assert "1 of 1 sources cannot be read or hold no valid prompt" in out.stderr and "is valid" not in out.stdout
    assert run_regen("generate", "--config", str(config)).returncode == 2


def test_validate_refuses_a_source_whose_records_are_all_rejected_like_generate(tmp_path):
    # Regression: every record rejected, `regen validate` said "is valid" (exit 0); generate stops with exit 2.
    # Past the first 20 records it reads on until one is valid: a valid 26th record makes the source valid.
    invalid = [{"id": f"x{i}", "conversations": []} for i in range(25)]
    config, _, data = setup_run(tmp_path, jsonl(invalid))
    out, generate = run_regen("validate", str(config)), run_regen("generate", "--config", str(config))
    assert (out.returncode, generate.returncode) == (2, 2), out.stdout
    refusal = generate.stderr.strip().splitlines()[-1].removeprefix("regen: error: ")
    assert refusal.startswith("source 'sharegpt' has no valid prompt: all 25 records were rejected; the most common "
                              "reasons: empty_conversation 25")
    assert f"  {refusal}" in out.stdout
    assert "1 of 1 sources cannot be read or hold no valid prompt" in out.stderr and "is valid" not in out.stdout
    data.write_bytes(jsonl(invalid + rows(1)))
    out = run_regen("validate", str(config))
    assert out.returncode == 0 and "is valid" in out.stdout, out.stdout + out.stderr


def test_validate_reports_what_it_sees_in_each_source(tmp_path):
    config, spec, data = setup_run(tmp_path, json.dumps(rows(30), indent=2).encode(), kind="json")
    out = run_regen("validate", str(config))
    assert out.returncode == 0, out.stderr
    assert "  reads as data/sharegpt.json: JSON array" in out.stdout
    assert ("  first 20 records: 20 valid; keys id, conversations; they look like sharegpt (field "
            "'conversations')") in out.stdout

    spec.write_text(yaml.safe_dump({"name": "sharegpt", "kind": "json", "path": "data/sharegpt.json",
                                    "format": "openai"}))
    data.write_bytes(data.read_bytes()[:-200])
    out = run_regen("validate", str(config))
    assert "first 20 records: 0 valid, rejected missing_field 20" in out.stdout
    assert ("warning: the spec says format openai with field 'messages'; these records look like sharegpt "
            "(prompts_sources/sharegpt.yaml): format sharegpt, field 'conversations'") in out.stdout
    # cut short without `salvage: true`: refused as generate refuses it (issue 23), no longer only a warning
    assert out.returncode == 2 and "  cannot read it: data/sharegpt.json ends in the middle of a record" in out.stdout

    spec.write_text(yaml.safe_dump({"name": "sharegpt", "kind": "jsonl", "path": "data/sharegpt.json",
                                    "format": "sharegpt"}))
    out = run_regen("validate", str(config))
    assert out.returncode == 2
    assert "  cannot read it: data/sharegpt.json is one JSON array, not JSON Lines; set `kind: json` in the spec" \
        in out.stdout


def test_rejects_carry_their_code(tmp_path):
    config, _, _ = setup_run(tmp_path, jsonl(rows(2) + [{"id": "x", "conversations": []}]))
    run, _ = start(config)
    (reject,) = pq.read_table(run.path.path + "/rejects/rejects-000001.parquet").to_pylist()
    assert (reject["code"], reject["origin"]) == ("empty_conversation", "data/sharegpt.jsonl:3")
