"""The exact token ids of every SGLang version regen supports: where each version puts the output ids (0.5.17's
`token_ids`, 0.5.18's `response_token_ids`), the preflight refusing a server that returns none (naming its
version), and a run storing the ids the server generated."""
from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import PreflightError
from pipeline.emulator import make_config, start_emulator
from pipeline.emulator.model import expected_chat
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.preflight import preflight
from tests.helpers import data_parts, prompt_source, run_regen, write_config


MODEL = "moonshotai/Kimi-K2.5"


VERSIONS = ("0.5.23", "0.5.18", "0.5.17", "0.5.14")


MESSAGES = [{"role": "user", "content": "Name one fact about owls."}]


@pytest.fixture(scope="module")
def versioned():
    """One Kimi emulator per SGLang version, each answering with that version's response fields."""
    servers = {v: start_emulator(preset="kimi", sglang_version=v) for v in VERSIONS}
    yield servers
    for server in servers.values():
        server.stop()


def expected_ids(version: str) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0.0}
    return expected_chat(body, make_config(preset="kimi", sglang_version=version))


def make_cfg(urls: list[str], **overrides) -> RunConfig:
    raw = {"run_name": "ids", "model": MODEL, "sources": [{"spec": "prompts_sources/sample_prompts.yaml"}],
           "endpoints": [{"url": url} for url in urls], "sampling": {"max_tokens": 64}, "min_prompt_tokens": 16,
           "dead_fleet_deadline_s": 5}
    raw.update(overrides)
    return RunConfig.model_validate(raw)


def test_the_client_reads_the_output_ids_of_every_version(versioned):
    async def ask(url: str):
        client = EndpointClient(url, "e", ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=12))
        try:
            return await client.chat(MESSAGES, seed=None)
        finally:
            await client.close()

    for version, server in versioned.items():
        completion = asyncio.run(ask(server.url))
        expected = expected_ids(version)
        assert completion.prompt_token_ids == expected["prompt_ids"], version
        if version == "0.5.14":  # no return_token_ids before 0.5.17: nothing to read, and nothing invented
            assert completion.output_token_ids is None
        else:
            assert completion.output_token_ids == expected["output_ids"], version


def test_the_preflight_refuses_a_server_without_output_ids_naming_its_version(versioned):
    old, new = versioned["0.5.14"], versioned["0.5.23"]
    with pytest.raises(PreflightError) as info:
        preflight(make_cfg([old.url, new.url]), {})
    lines = str(info.value).splitlines()
    about_old = [line for line in lines if old.url.split("://")[1] in line]
    assert about_old and "SGLang 0.5.14" in about_old[0] and "no output token ids" in about_old[0]
    assert "return_token_ids: false" in about_old[0]
    assert not [line for line in lines if new.url.split("://")[1] in line], "0.5.23 returns its ids"
    # the way out the message names: a run that does not ask for ids passes
    assert all(r.ok for r in preflight(make_cfg([old.url, new.url], return_token_ids=False), {}))


@pytest.mark.parametrize("version", ["0.5.23", "0.5.17"])
def test_a_run_stores_the_exact_ids(tmp_path, ray_cluster, versioned, version):
    endpoints = [{"url": versioned[version].url, "concurrency": 4}]
    config = write_config(tmp_path, endpoints, [prompt_source(tmp_path, 12)], model=MODEL,
                          sampling={"temperature": 0.0, "max_tokens": 16})
    result = run_regen("generate", "--config", str(config))
    assert result.returncode == 0, result.stderr
    rows = [r for part in data_parts(tmp_path / "out" / "t") for r in pq.read_table(part).to_pylist()]
    assert len(rows) == 12
    kimi = make_config(preset="kimi")
    for row in rows:
        expected = expected_chat({"model": MODEL, "messages": row["messages"], "max_tokens": 16,
                                  "temperature": 0.0}, kimi)
        assert row["output_token_ids"] == expected["output_ids"] and row["prompt_token_ids"] == expected["prompt_ids"]
