"""One misconfigured server need not stop a fleet (issue 23, dead end 5): refusing stays the default, and its
message names `--start-with-passing`; with the flag the run starts with the servers that pass, names the refused
one in the log and in status.json, and the refused one joins through the readmission preflight once it is fixed.
Real `regen generate` subprocesses on a real Ray head, against SGLang emulators (one launched with a context too
short for the run), and the run's own files."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.emulator import start_emulator
from tests.helpers import (
    all_prompt_ids, regen_cmd, regen_log_says, reset_faults, run_regen, set_faults, set_speed, wait_while_running,
    write_config, write_prompts, write_source,
)

MODEL = "moonshotai/Kimi-K2.5"
SHORT_CONTEXT = 200  # below max_tokens + min_prompt_tokens: the preflight refuses it


@pytest.fixture(scope="module")
def fleet():
    """Two good emulators and one launched with a context too short for the run (40 tok/s a request)."""
    servers = [start_emulator(preset="kimi", tok_per_s=40) for _ in range(2)]
    servers.append(start_emulator(preset="kimi", tok_per_s=40, context_length=SHORT_CONTEXT))
    yield servers
    for server in servers:
        server.stop()


def config_for(tmp: Path, servers) -> Path:
    write_prompts(tmp / "p.jsonl", 48)
    endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)]
    return write_config(tmp, endpoints, [write_source(tmp, tmp / "p.jsonl")], model=MODEL,
                        sampling={"temperature": 0.0, "max_tokens": 32}, flush_records=8)


def test_one_misconfigured_server_refuses_the_run_by_default_and_names_the_flag(tmp_path, fleet):
    out = run_regen("generate", "--config", str(config_for(tmp_path, fleet)), timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "fleet preflight refused the run" in out.stderr and "emu-2" in out.stderr
    assert ("2 of 3 endpoints pass: `regen generate --start-with-passing` starts the run with them, and the 1 "
            "refused above joins once fixed") in out.stderr


SLOWED_TOK_PER_S = 2  # ~12 s a prompt (24 of 32 tokens on average): the run outlasts the readmission


def test_start_with_passing_runs_without_the_refused_server_until_it_is_fixed(tmp_path, ray_cluster, fleet):
    import subprocess

    config = config_for(tmp_path, fleet)
    run = tmp_path / "out" / "t"
    log = tmp_path / "driver.log"
    with open(log, "wb") as sink:
        try:
            set_speed(fleet[:2], SLOWED_TOK_PER_S)  # held slow until the readmission is seen: the run outlasts it
            driver = subprocess.Popen(regen_cmd("generate", "--config", str(config), "--start-with-passing"),
                                      stdout=sink, stderr=subprocess.STDOUT)
            try:
                def refused_in_status() -> bool:
                    status = run / "status.json"
                    return status.exists() and orjson.loads(status.read_bytes())["endpoints"].get(
                        "emu-2", {}).get("state") == "refused"

                wait_while_running(driver, log, refused_in_status, 90, "status.json to show emu-2 refused")
                entry = orjson.loads((run / "status.json").read_bytes())["endpoints"]["emu-2"]
                assert entry["refused"].startswith("the preflight refused it: ") and \
                    "--context-length" in entry["refused"]
                set_faults(fleet[2], context_length=262144)
                wait_while_running(driver, log, regen_log_says(run, "endpoint emu-2 now passes the preflight"), 240,
                                   "the fixed emu-2 to be readmitted")
                set_speed(fleet[:2], 40)
                assert driver.wait(timeout=180) == 0, log.read_text()[-3000:]
            finally:
                driver.kill()
        finally:
            reset_faults(*fleet)  # the launch values: the good servers' speed, emu-2's short context

    said = (run / "logs" / "regen.log").read_text()
    assert "endpoint emu-2 failed the preflight: " in said and "--start-with-passing: the run starts without it" in said
    assert "starting with 2 of 3 endpoints (--start-with-passing); held out: emu-2" in said
    assert "endpoint emu-2 now passes the preflight" in said and "it joins the run" in said
    rows = [r for p in sorted((run / "data").glob("part-*.parquet"))
            for r in pq.read_table(p, columns=["prompt_id", "endpoint"]).to_pylist()]
    assert Counter(Counter(r["prompt_id"] for r in rows).values()) == {1: 48}  # each prompt once, none lost
    assert {r["prompt_id"] for r in rows} == all_prompt_ids(run)
    assert any(r["endpoint"] == "emu-2" for r in rows), "the fixed server joined and took work"
    final = orjson.loads((run / "status.json").read_bytes())
    assert final["state"] == "complete" and final["held_out"] == []
    assert {label: e["in_flight"] for label, e in final["endpoints"].items()} == {"emu-0": 0, "emu-1": 0, "emu-2": 0}
    assert final["endpoints"]["emu-2"]["state"] != "refused"


def test_the_end_line_names_a_server_refused_throughout(tmp_path, ray_cluster):
    """--start-with-passing, and the refused server is never fixed: the session's end line says so (issue 30)."""
    servers = [start_emulator(preset="kimi"), start_emulator(preset="kimi", context_length=SHORT_CONTEXT)]
    try:
        write_prompts(tmp_path / "p.jsonl", 6)
        endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)]
        config = write_config(tmp_path, endpoints, [write_source(tmp_path, tmp_path / "p.jsonl")], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 8})
        result = run_regen("generate", "--config", str(config), "--start-with-passing")
    finally:
        for server in servers:
            server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    said = (tmp_path / "out" / "t" / "logs" / "regen.log").read_text()
    assert ("dispatch: 6 prompts to 1 of 2 endpoints; 1 held out by the preflight, joining once it passes: emu-1 "
            "(refused)") in said
    last = said.splitlines()[-1]
    assert "is complete: 6 records" in last and "emu-1 refused by the preflight throughout (held out: no work)" in last
