"""`regen simulate` says what failed (walk of issue 30): of 36 xlam prompts at k=2 the emulated run committed 42
samples and failed 30 for good (SGLang's 400 for a tool schema it refuses), and simulate printed "sampled 21 of 36
prompts (42 samples, 2 per prompt), 36 of them sent with their tools": every prompt was sampled, the 30 failures were
not named, and the prediction scaled the 42 answers up to all 72 samples as if the failed ones would answer."""
from __future__ import annotations

import json

import yaml

from pipeline.tools.simulate import simulate

GOOD = {"name": "is_prime", "description": "Checks if a number is prime.",
        "parameters": {"type": "object", "properties": {"num": {"type": "integer"}}, "required": ["num"]}}
REFUSED = {"name": "live_giveaways_by_type", "description": "Live giveaways by type.",
           "parameters": {"type": {"description": "game, loot or beta", "type": "str", "default": "game"}}}


def test_simulate_counts_the_samples_that_failed_and_predicts_from_every_sampled_one(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"question {i}"}], "tools": [REFUSED if i < 2 else GOOD]}
               for i in range(6)]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump({"name": "t", "kind": "jsonl", "path": str(data),
                                                         "format": "openai"}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run_name": "sim", "model": "moonshotai/Kimi-K2.5", "thinking": True, "samples_per_prompt": 2,
        "sampling": {"temperature": 0.6, "max_tokens": 32}, "sources": [{"spec": "tools.yaml"}],
        "endpoints": [{"url": "http://127.0.0.1:1", "concurrency": 4}], "flush_interval_s": 1,
        "ray": {"address": "local"}}))
    prediction = simulate(str(config), endpoints=1, tok_s=200, speedup=20)
    table = prediction.table()
    assert "sampled 6 of 6 prompts (12 samples, 2 per prompt), 6 of them sent with their tools" in table, table
    assert "4 samples failed for good" in table and "invalid 'parameters' schema" in table, table
    assert prediction.failed == 4 and prediction.sample == 12
