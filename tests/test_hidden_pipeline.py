"""Hidden states through the whole pipeline, against the SGLang emulator: /generate with
return_hidden_states, bf16 parts written by the endpoint actors, aligned to prompt + completion tokens,
referenced by the data rows, garbage-collected on resume, exported."""
from __future__ import annotations

import collections

import pyarrow.parquet as pq

from pipeline.emulator import start_emulator
from pipeline.hidden.parts import hidden_parts, iter_hidden
from tests.helpers import assert_emulated_hidden_states, data_parts, run_regen, sigkill, start_regen, wait_for, write_config, write_prompts, write_source

MODEL = "moonshotai/Kimi-K2.5"
WIDTH = 3 * 32  # EAGLE-3: three auxiliary layers of a 32-wide toy model


def test_hidden_states_are_aligned_stored_and_referenced(tmp_path, ray_cluster):
    server = start_emulator(preset="kimi-eagle3", hidden_width=32, tok_per_s=200)
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 40)
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4, "name": "emu-0"}],
                              [write_source(tmp_path, prompts)], model=MODEL, thinking=True,
                              sampling={"temperature": 0.0, "max_tokens": 24}, flush_records=4,
                              hidden_states={"enabled": True, "expected_width": WIDTH})
        run = tmp_path / "out" / "t"
        proc = start_regen("generate", "--config", str(config), log=tmp_path / "log")
        wait_for(lambda: len(data_parts(run)) >= 2, 120, what="some committed records")
        sigkill(proc)
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr

        rows = [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]
        assert len(rows) == 40 and all(r["hidden_part"] and r["hidden_row"] is not None for r in rows)
        referenced = {r["hidden_part"] for r in rows}
        assert {p.name for p in hidden_parts(run)} == referenced, "unreferenced parts are removed on resume"
        assert_emulated_hidden_states(rows, list(iter_hidden(run)), WIDTH)
        assert collections.Counter(r["finish_reason"] for r in rows).keys() <= {"stop", "length"}
        assert any(r["reasoning_content"] for r in rows), "Kimi's reasoning is split out of /generate's text"

        out = tmp_path / "hs"  # the generating request's parts are not exported: they lack what the libraries need
        export = run_regen("export", str(run), "--format", "speculators-hidden", "--out", str(out))
        assert export.returncode == 2 and "regen capture" in export.stderr
    finally:
        server.stop()


def test_a_wrong_hidden_width_refuses_the_run_before_any_prompt(tmp_path, ray_cluster):
    # The failure that cost days: --speculative-algorithm EAGLE instead of EAGLE3 gives 7168, not 21504.
    eagle = start_emulator(preset="kimi-eagle3", speculative_algorithm="EAGLE")
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 5)
        config = write_config(tmp_path, [{"url": eagle.url, "concurrency": 4, "name": "emu-0"}],
                              [write_source(tmp_path, prompts)], model=MODEL,
                              hidden_states={"enabled": True, "expected_width": 21504})
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 1
        assert "7168-wide" in result.stderr and "EAGLE3" in result.stderr and "emu-0" in result.stderr
        assert not list((tmp_path / "out" / "t" / "data").glob("part-*")), "no prompt was generated"
    finally:
        eagle.stop()


def test_storage_preflight_refuses_a_run_that_cannot_fit(tmp_path, ray_cluster):
    server = start_emulator(preset="kimi-eagle3")
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 5)
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4, "name": "emu-0"}],
                              [write_source(tmp_path, prompts)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 10_000_000},
                              hidden_states={"enabled": True, "expected_width": 21504})
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 1 and "TB" in result.stderr and "--force" in result.stderr
    finally:
        server.stop()
