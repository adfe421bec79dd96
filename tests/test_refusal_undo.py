"""How a refused command's undo (store/untouched.py) holds up when it is itself cut short, and on an object store
(issue 30): through the real `regen` command on the SGLang emulator."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq

from tests.helpers import data_parts, emulators, run_regen, write_config, write_prompts, write_source

MODEL = "SmolLM2-135M-Instruct"


def sent_prompts(run: Path) -> set[str]:
    """The user messages of the run's committed records."""
    texts = set()
    for part in data_parts(run):
        for messages in pq.read_table(part, columns=["messages"]).column(0).to_pylist():
            texts |= {m["content"] for m in messages if m["role"] == "user"}
    return texts


def test_a_folder_left_with_a_prompt_set_and_no_run_json_reads_its_prompts_from_the_sources(tmp_path, ray_cluster):
    """What a start killed while it put a refused new run back can leave (run.json removed, the prompt set not yet,
    in whatever order the folder lists): the next start makes a new run, whose prompts are its sources', never the
    set a refused start had read from other sources."""
    write_prompts(tmp_path / "p.jsonl", 3)
    with emulators(1, served_model_name=MODEL) as (server,):
        config = write_config(tmp_path, [{"url": server.url, "name": "emu"}], [write_source(tmp_path, tmp_path / "p.jsonl")])
        first = run_regen("generate", "--config", str(config))
        assert first.returncode == 0, first.stderr
        run = tmp_path / "out" / "t"
        for name in ("run.json", "status.json"):
            (run / name).unlink()
        for folder in ("data", "failures"):
            shutil.rmtree(run / folder)
        assert list((run / "prompts").iterdir()), "the leftover prompt set is there"
        wanted = write_prompts(tmp_path / "p.jsonl", 3, start=10)
        again = run_regen("generate", "--config", str(config))
    assert again.returncode == 0, again.stderr
    assert sent_prompts(run) == {row["prompt"] for row in wanted}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its content's hash, but what a refusal may change (logs, lock, status)."""
    import hashlib

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()
            and not {"logs", "run.lock", "lock.json", "status.json"} & set(path.relative_to(folder).parts)}


def completed_run(tmp_path: Path, server, prompts: int, **options) -> Path:
    """A run of `prompts` prompts done on `server` (named emu); returns its config."""
    write_prompts(tmp_path / "p.jsonl", prompts)
    spec = write_source(tmp_path, tmp_path / "p.jsonl")
    config = write_config(tmp_path, [{"url": server.url, "name": "emu"}], [spec], **options)
    made = run_regen("generate", "--config", str(config))
    assert made.returncode == 0, made.stderr
    return config


def test_a_sigterm_while_a_refused_refresh_is_undone_leaves_the_run_as_it_was(tmp_path, ray_cluster):
    """--refresh-prompts commits a new prompt set, then the preflight refuses the fleet; a SIGTERM arrives while the
    undo removes that set (a real signal, sent by the REGEN_FAULT hook at the delete): the undo finishes, then the
    signal stops the command (exit 130), and the run is as it was."""
    with emulators(1, served_model_name=MODEL) as (good,), emulators(1, served_model_name="another") as (bad,):
        config = completed_run(tmp_path, good, 4, flush_records=2)
        run = tmp_path / "out" / "t"
        data_parts(run)[-1].unlink()  # work pending: the start goes on to the preflight
        write_prompts(tmp_path / "p.jsonl", 6)
        config.write_text(config.read_text().replace(good.url, bad.url))
        before = snapshot(run)
        refused = run_regen("generate", "--config", str(config), "--refresh-prompts",
                            env={"REGEN_FAULT": "term@1:delete:/prompts/prompts-"})
    assert "SIGTERM received" in refused.stderr and refused.returncode == 130, refused.stderr
    assert snapshot(run) == before


def test_a_refused_new_run_on_an_object_store_leaves_nothing_and_the_next_new_run_takes_its_number(
        tmp_path, ray_cluster, object_store):
    """An object store shows a prefix as a folder while a marker key holds it, and pyarrow leaves one where it
    deletes the last key under a prefix: a refused --new-run must leave no `t-r2` in the listing, so that the next
    --new-run is `t-r2`, not `t-r3`."""
    from pipeline.store.storage import Location

    out = object_store("refused-new-run")
    with emulators(1, served_model_name=MODEL) as (good,), emulators(1, served_model_name="another") as (bad,):
        config = completed_run(tmp_path, good, 3, output_dir=out)
        changed = config.read_text().replace("max_tokens: 8", "max_tokens: 9")
        config.write_text(changed.replace(good.url, bad.url))
        refused = run_regen("generate", "--config", str(config), "--new-run")
        assert refused.returncode == 1 and "another" in refused.stderr, refused.stderr
        assert sorted(entry.name for entry in Location.at(out).iterdir()) == ["t"]
        config.write_text(changed)
        again = run_regen("generate", "--config", str(config), "--new-run")
    assert again.returncode == 0 and "/t-r2 is complete" in again.stderr, again.stderr


def test_a_refused_start_in_a_folder_whose_run_json_is_missing_never_deletes_its_committed_parts(tmp_path,
                                                                                                ray_cluster):
    """A folder with committed parts but no run.json (a copy of a run still under way: `aws s3 sync` and rsync write
    run.json after data/; a run.json deleted by hand) is started as a new run; refused, the undo removes what the
    start added, never the parts that were there."""
    with emulators(1, served_model_name=MODEL) as (good,), emulators(1, served_model_name="another") as (bad,):
        config = completed_run(tmp_path, good, 4, flush_records=2)
        run = tmp_path / "out" / "t"
        data_parts(run)[-1].unlink()  # work pending: the start goes on to the preflight
        (run / "run.json").unlink()
        before = snapshot(run)
        config.write_text(config.read_text().replace(good.url, bad.url))
        refused = run_regen("generate", "--config", str(config))
    assert refused.returncode == 1 and "another" in refused.stderr, refused.stderr
    assert data_parts(run) and snapshot(run) == before
