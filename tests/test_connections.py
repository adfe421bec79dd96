"""The endpoint client gives up an idle connection before the server closes it: SGLang and vLLM close a connection
idle for 5 s (their own code, read here), and a request sent on a connection the server is closing is dropped. Its
pool opens a connection for each request the endpoint may have in flight."""
from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from pipeline.core.config_sections import MAX_CONCURRENCY
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.connections import KEEPALIVE_EXPIRY_S
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


SETTINGS = ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8)


def test_the_endpoint_clients_pool_keeps_a_connection_for_each_request_in_flight():
    for max_in_flight in (MAX_CONCURRENCY, 64):
        pool = EndpointClient("http://127.0.0.1:9", "e", SETTINGS, max_in_flight=max_in_flight)._openai._client. \
            _transport._pool
        assert (pool._keepalive_expiry, pool._max_keepalive_connections, pool._max_connections) == \
            (KEEPALIVE_EXPIRY_S, max_in_flight, max(1000, max_in_flight))  # the SDK's own 1000 at least


class HoldingServer:
    """Accepts connections, reads each request and never answers; `all_open` is set once `n` are open at once."""

    def __init__(self, n: int):
        self.n, self.open, self.peak = n, 0, 0
        self.all_open = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        if self.open >= self.n:
            self.all_open.set()
        try:
            await reader.read()          # until the client goes
        finally:
            self.open -= 1
            writer.close()


def test_a_concurrency_above_1024_gets_as_many_connections_at_once():
    """`concurrency` (and `concurrency_cap`) may be up to 4096, and a set number stays exact: the pool held 1024
    before, the rest waited in it, counted in flight but never sent."""
    n = 1100

    async def scenario() -> int:
        holder = HoldingServer(n)
        server = await asyncio.start_server(holder.handle, "127.0.0.1", 0, backlog=2048)
        client = EndpointClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "e", SETTINGS)
        tasks = [asyncio.create_task(client.chat([{"role": "user", "content": "q"}], None)) for _ in range(n)]
        try:
            await asyncio.wait_for(holder.all_open.wait(), 120)   # a hang guard: the pool stops short otherwise
        except TimeoutError:
            pass
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        server.close()
        return holder.peak

    assert asyncio.run(scenario()) == n


def test_the_probe_and_metrics_session_gives_up_idle_connections_as_the_sdk_does():
    """/health, /metrics, /server_info and the preflight's probes go through aiohttp, whose connector kept an idle
    connection 15 s, past SGLang's and vLLM's 5 s. The idle time is what is tested: a second /health once the
    first one's connection has been idle past KEEPALIVE_EXPIRY_S goes out on a new connection."""
    from aiohttp import web

    async def scenario() -> tuple[set, float]:
        peers: list = []

        async def health(request):
            peers.append(request.transport.get_extra_info("peername")[1])
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, keepalive_timeout=30)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = EndpointClient(f"http://127.0.0.1:{port}", "e", SETTINGS)
        try:
            await client.get_json("/health")
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 1.0)   # idle: the stimulus, not a wait for something
            await client.get_json("/health")
            return set(peers), client._session().connector._keepalive_timeout
        finally:
            await client.close()
            await runner.cleanup()

    peers, keepalive = asyncio.run(scenario())
    assert keepalive == KEEPALIVE_EXPIRY_S and len(peers) == 2, (keepalive, peers)
