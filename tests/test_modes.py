"""Regeneration modes and what the training libraries get, end to end against the SGLang emulator:
all_turns histories, a SIGKILL mid-conversation, Kimi thinking on/off/truncated, exports of a real run,
--retry-failures, and a stalled stream."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from pipeline.emulator import make_config, start_emulator
from pipeline.emulator.model import expected_chat
from pipeline.export.formats import is_truncated, validate_specforge_row
from tests.helpers import (
    committed_ids, data_parts, run_regen, set_faults, sigkill, start_regen, wait_for, write_config, write_prompts,
    write_source,
)

MODEL = "moonshotai/Kimi-K2.5"
KIMI = make_config(preset="kimi")


def endpoints(servers, concurrency: int = 4) -> list[dict]:
    return [{"url": s.url, "concurrency": concurrency, "name": f"emu-{i}"} for i, s in enumerate(servers)]


def rows_of(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def write_conversations(path: Path, n: int) -> None:
    """ShareGPT conversations with 3 user turns and the source's own (to be discarded) replies."""
    lines = []
    for i in range(n):
        turns = []
        for k in range(3):
            turns += [{"from": "human", "value": f"Conversation {i}, question {k}: tell me about topic {i * 3 + k}."},
                      {"from": "gpt", "value": f"SOURCE-WRITTEN answer {k} of {i}."}]
        lines.append(orjson.dumps({"id": f"c{i}", "conversations": turns}))
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_all_turns_history_is_the_targets_own_replies_and_exports(tmp_path, ray_cluster, emulator_fleet):
    source = tmp_path / "conv.jsonl"
    write_conversations(source, 12)
    config = write_config(tmp_path, endpoints(emulator_fleet), [write_source(tmp_path, source, fmt="sharegpt")],
                          model=MODEL, mode="all_turns", thinking=True, sampling={"temperature": 0.0, "max_tokens": 48})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    run = tmp_path / "out" / "t"
    # the end line counts records as the card does: one per regenerated turn, the prompts beside (issue 30)
    last = (run / "logs" / "regen.log").read_text().splitlines()[-1]
    assert "is complete: 36 records (12 prompts), 0 failures" in last, last
    rows = rows_of(run)
    by_prompt = collections.defaultdict(list)
    for row in rows:
        by_prompt[row["prompt_id"]].append(row)
    assert len(by_prompt) == 12 and len(rows) == 36
    for turns in by_prompt.values():
        turns.sort(key=lambda r: r["turn_index"])
        assert [r["turn_index"] for r in turns] == [0, 1, 2] and {r["n_turns"] for r in turns} == {3}
        assert len({r["endpoint"] for r in turns}) == 1, "a conversation's turns stay on one endpoint"
        for k, row in enumerate(turns):
            history = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            assert history == [t["content"] for t in turns[:k]], "history is the target's earlier replies"
            assert not any("SOURCE-WRITTEN" in m["content"] for m in row["messages"])
            expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 48,
                                      "temperature": 0.0, "chat_template_kwargs": {"thinking": True}}, KIMI)
            assert row["content"] == expected["content"] and row["reasoning_content"] == expected["reasoning_content"]
            assert row["output_token_ids"] == expected["output_ids"] and row["prompt_token_ids"] == expected["prompt_ids"]

    out = tmp_path / "sf.jsonl"
    assert run_regen("export", str(run), "--format", "specforge", "--out", str(out)).returncode == 0
    exported = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert exported and all(validate_specforge_row(row) == [] for row in exported)
    tokens = tmp_path / "tok.jsonl"
    assert run_regen("export", str(run), "--format", "specforge-tokens", "--out", str(tokens)).returncode == 0
    token_rows = [orjson.loads(line) for line in tokens.read_bytes().splitlines()]
    assert len(token_rows) == 36
    by_id = {f"{r['prompt_id']}#turn{r['turn_index']}": r for r in rows}
    for row in token_rows:
        record = by_id[row["id"]]
        assert len(row["input_ids"]) == len(row["loss_mask"]) and set(row["loss_mask"]) <= {0, 1}
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m == 1]
        generated = record["output_token_ids"]
        if is_truncated(record):  # cut at max_tokens: its last position would predict an end of turn never made
            generated = generated[:-1]
        assert trained == generated, "the mask is 1 exactly on the generated tokens"
    spec = tmp_path / "spec.jsonl"
    assert run_regen("export", str(run), "--format", "speculators", "--out", str(spec)).returncode == 0
    assert len(spec.read_bytes().splitlines()) == 36


def test_sigkill_mid_conversation_never_commits_half(tmp_path, ray_cluster):
    # the last conversation's last turn hangs until the server restarts: the SIGKILL always lands mid-run (the run
    # could end only once that turn's attempts have timed out, minutes later)
    slow = start_emulator(preset="kimi", tok_per_s=60, poison_text="topic 71.", poison_fault="hang")
    try:
        source = tmp_path / "conv.jsonl"
        write_conversations(source, 24)
        config = write_config(tmp_path, endpoints([slow], concurrency=6), [write_source(tmp_path, source, "sharegpt")],
                              model=MODEL, mode="all_turns", sampling={"temperature": 0.0, "max_tokens": 16},
                              flush_records=1, flush_interval_s=0.2)
        run = tmp_path / "out" / "t"
        proc = start_regen("generate", "--config", str(config), log=tmp_path / "log")
        wait_for(lambda: len(data_parts(run)) >= 2, 120, what="two conversations committed")
        sigkill(proc)
        for prompt_id, count in collections.Counter(committed_ids(run)).items():
            assert count == 3, f"conversation {prompt_id} committed with {count} of 3 turns"
        slow.restart(poison_text=None)
        assert run_regen("generate", "--config", str(config)).returncode == 0
        turns = collections.Counter((r["prompt_id"], r["turn_index"]) for r in rows_of(run))
        assert len(turns) == 72 and set(turns.values()) == {1}
    finally:
        slow.stop()


def test_thinking_off_and_truncated_thinking_is_flagged(tmp_path, ray_cluster, emulator_fleet):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 30)
    spec = write_source(tmp_path, prompts)
    (tmp_path / "off").mkdir()
    off = write_config(tmp_path / "off", endpoints(emulator_fleet), [spec], model=MODEL, thinking=False,
                       sampling={"temperature": 0.0, "max_tokens": 32})
    assert run_regen("generate", "--config", str(off)).returncode == 0
    rows = rows_of(tmp_path / "off" / "out" / "t")
    assert rows and all(r["reasoning_content"] is None and "</think>" not in r["content"] for r in rows)

    (tmp_path / "short").mkdir()
    short = write_config(tmp_path / "short", endpoints(emulator_fleet), [spec], model=MODEL, thinking=True,
                         sampling={"temperature": 0.0, "max_tokens": 4})
    assert run_regen("generate", "--config", str(short)).returncode == 0
    rows = rows_of(tmp_path / "short" / "out" / "t")
    cut = [r for r in rows if r["content"] == "" and r["finish_reason"] == "length"]
    assert cut, "a 4-token budget ends inside the thinking"
    assert all(r["reasoning_content"] and "truncated_thinking" in r["flags"] for r in cut)
    out = tmp_path / "sf.jsonl"
    export = run_regen("export", str(tmp_path / "short" / "out" / "t"), "--format", "specforge", "--out", str(out),
                       "--drop-truncated")
    assert export.returncode == 0 and "train_only_last_turn" in export.stderr
    assert len(out.read_bytes().splitlines()) == len(rows) - sum("truncated" in r["flags"] for r in rows)


def test_retry_failures_sends_terminal_failures_again(tmp_path, ray_cluster):
    server = start_emulator(preset="kimi")
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 10)
        long = {"prompt": "Summarise: " + " ".join(f"w{i}" for i in range(400))}
        prompts.write_text(prompts.read_text() + json.dumps(long) + "\n")
        config = write_config(tmp_path, endpoints([server]), [write_source(tmp_path, prompts)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 8}, min_prompt_tokens=1)
        set_faults(server, context_length=300)
        assert run_regen("generate", "--config", str(config)).returncode == 0
        run = tmp_path / "out" / "t"
        assert len(committed_ids(run)) == 10
        failures = [r for p in sorted((run / "failures").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
        assert len(failures) == 1 and "context length" in failures[0]["message"] and failures[0]["attempts"] == 1

        set_faults(server, context_length=262144)
        again = run_regen("generate", "--config", str(config))
        assert again.returncode == 0 and "is complete" in again.stderr, "a terminal failure is not retried by default"
        retried = run_regen("generate", "--config", str(config), "--retry-failures")
        assert retried.returncode == 0, retried.stderr
        assert len(committed_ids(run)) == 11
        status = json.loads(run_regen("status", str(run), "--json").stdout)
        assert (status["done"], status["failed"], status["pending"]) == (11, 0, 0)
    finally:
        server.stop()


def test_a_stalled_stream_is_cancelled_and_retried_elsewhere(tmp_path, ray_cluster):
    stalled = start_emulator(preset="kimi", slow_stream_s=3.0)
    healthy = start_emulator(preset="kimi")
    try:
        prompts = tmp_path / "p.jsonl"
        write_prompts(prompts, 30)
        config = write_config(tmp_path, endpoints([stalled, healthy]), [write_source(tmp_path, prompts)], model=MODEL,
                              stream=True, stall_timeout_s=0.5, sampling={"temperature": 0.0, "max_tokens": 16},
                              hedge_tail=False)  # the stall itself must cancel and move the work
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr
        run = tmp_path / "out" / "t"
        rows = rows_of(run)
        assert len(rows) == 30 and {r["endpoint"] for r in rows} == {"emu-1"}
        for row in rows:
            expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 16,
                                      "temperature": 0.0}, KIMI)
            assert (row["content"], row["reasoning_content"]) == (expected["content"], expected["reasoning_content"])
        status = orjson.loads((run / "status.json").read_bytes())
        assert status["endpoints"]["emu-0"]["errors"].get("retryable", 0) >= 1
    finally:
        stalled.stop()
        healthy.stop()
