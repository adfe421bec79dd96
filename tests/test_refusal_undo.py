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
