"""Run directories whose records carry SmolLM2's exact token ids (the chat template rendered by its own tokenizer,
as a server that returns token ids gives them), built with the store's own code: real Parquet, no server."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.store import schema
from pipeline.store.quality import quality_flags
from pipeline.store.rundir import RunDir

# (prompt_id, user message, reply, finish): the reply of a "stop" record ends with <|im_end|>, a "length" one is cut
SAMPLES = [("p0", "Name a prime number.", "Seven is a prime number.", "stop"),
           ("p1", "Count to ten, slowly.", "One, two, three, fo", "length"),
           ("p2", "Say hello to a friend.", "Hello, my friend! How are you today?", "stop"),
           ("p3", "What colour is the sky?", "The sky is blue on a clear day.", "stop")]


def smollm2_records(tok, samples=SAMPLES, token_ids: bool = True) -> list[dict[str, Any]]:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for pid, user, reply, finish in samples:
        messages = [{"role": "user", "content": user}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        output = tok.encode(reply, add_special_tokens=False) + ([end] if finish == "stop" else [])
        rows.append({
            "prompt_id": pid, "turn_index": 0, "n_turns": 1, "source": "test", "messages": messages,
            "content": reply, "reasoning_content": None, "finish_reason": finish,
            "flags": quality_flags(reply, None, finish), "prompt_tokens": len(prompt),
            "completion_tokens": len(output), "endpoint": "e0", "model": "SmolLM2-135M-Instruct",
            "config_fingerprint": "fp-smollm2", "prompt_token_ids": prompt if token_ids else None,
            "output_token_ids": output if token_ids else None})
    return rows


def make_smollm2_run(path: Path, parts: list[list[dict[str, Any]]], mode: str = "last_turn") -> RunDir:
    run = RunDir(path)
    run.create()
    run.write_manifest({"schema_version": schema.SCHEMA_VERSION, "fingerprint": "fp-smollm2",
                        "created_at": "2026-01-01T00:00:00+00:00",
                        "generation": {"model": "SmolLM2-135M-Instruct", "mode": mode,
                                       "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8}}})
    for rows in parts:
        add_part(run, rows)
    return run


def add_part(run: RunDir, rows: list[dict[str, Any]]) -> None:
    run.write_part(run.data, pa.Table.from_pylist(rows, schema=schema.RECORDS))
