"""The endpoint client gives up an idle connection before the server closes it: SGLang and vLLM close a connection
idle for 5 s (their own code, read here), and a request sent on a connection the server is closing is dropped."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.connections import KEEPALIVE_CONNECTIONS, KEEPALIVE_EXPIRY_S
from tests.test_sglang_conformance import VERSIONS, wheel


def sglang_keep_alive_s(version: str) -> int:
    environ = (wheel(version) / "sglang/srt/environ.py").read_text()
    server = (wheel(version) / "sglang/srt/entrypoints/http_server.py").read_text()
    assert "timeout_keep_alive=envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()" in server  # uvicorn is given this value
    return int(re.search(r"SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt\((\d+)\)", environ).group(1))


@pytest.mark.parametrize("version", VERSIONS)
def test_an_idle_connection_is_given_up_before_sglang_closes_it(version):
    assert KEEPALIVE_EXPIRY_S < sglang_keep_alive_s(version) - 1  # a second's margin for a loaded client


def test_an_idle_connection_is_given_up_before_vllm_closes_it():
    python = os.environ.get("REGEN_VLLM_PYTHON")
    if not python:
        pytest.skip("REGEN_VLLM_PYTHON is not set (make test sets it): vLLM's code is not here")
    envs = next((Path(python).parent.parent / "lib").glob("python3*/site-packages/vllm/envs.py")).read_text()
    default = int(re.search(r"VLLM_HTTP_TIMEOUT_KEEP_ALIVE: int = (\d+)", envs).group(1))
    assert KEEPALIVE_EXPIRY_S < default - 1


def test_the_endpoint_clients_pool_uses_these_limits():
    settings = ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8)
    pool = EndpointClient("http://127.0.0.1:9", "e", settings)._openai._client._transport._pool
    assert (pool._keepalive_expiry, pool._max_keepalive_connections) == (KEEPALIVE_EXPIRY_S, KEEPALIVE_CONNECTIONS)
