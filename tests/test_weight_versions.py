"""SGLang 0.5.23 reports the weight-version spans of each answer: an answer whose weights changed while it was
generated (two spans) is retried, never committed."""
from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import Retryable
from pipeline.emulator import start_emulator
from pipeline.endpoints.client import ClientSettings, EndpointClient
from tests.helpers import data_parts, prompt_source, run_regen, write_config

MODEL = "moonshotai/Kimi-K2.5"


def test_an_answer_from_two_weight_versions_is_retryable():
    server = start_emulator(preset="kimi", sglang_version="0.5.23", fault_weight_switch=1.0)

    async def ask():
        client = EndpointClient(server.url, "e", ClientSettings(model=MODEL, temperature=0.0, top_p=1.0,
                                                                max_tokens=16))
        try:
            return await client.chat([{"role": "user", "content": "Name one fact about owls."}], seed=None)
        finally:
            await client.close()

    try:
        with pytest.raises(Retryable, match="weights changed"):
            asyncio.run(ask())
    finally:
        server.stop()


def test_a_run_never_commits_an_answer_whose_weights_changed(tmp_path, ray_cluster):
    server = start_emulator(preset="kimi", sglang_version="0.5.23", fault_weight_switch=0.3, fault_seed=7)
    try:
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4}], [prompt_source(tmp_path, 24)],
                              model=MODEL, sampling={"temperature": 0.0, "max_tokens": 16}, max_attempts=8)
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr
    finally:
        server.stop()
    rows = [r for part in data_parts(tmp_path / "out" / "t") for r in pq.read_table(part).to_pylist()]
    assert len(rows) == 24 and {r["weight_version"] for r in rows} == {"default"}
    assert any(r["attempts"] > 1 for r in rows), "some answers were retried"
