"""Review break31: faults in `concurrency` unset -> auto / 8 (7235758, 643b619) and the 2 s keep-alive (dd9aa60).
Each test fails on main at 643b619 and names the behaviour it expects."""
from __future__ import annotations

import asyncio
import socket
import time

import orjson
import pytest
import yaml

from pipeline.dispatch.autolimit import AutoLimit
from pipeline.endpoints.client import ClientSettings, EndpointClient
from pipeline.endpoints.connections import KEEPALIVE_EXPIRY_S

SETTINGS = ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8)
METRICS = "sglang:num_running_reqs 8\nsglang:num_queue_reqs 0\n"


class FakeServer:
    """The client of a server: /server_info answers `info` (a (status, body) pair, or a callable of the call's
    number), /metrics the gauges of a server running everything it is sent."""
    engine = None

    def __init__(self, info, metrics: tuple[int, str] = (200, METRICS)):
        self.info, self.metrics, self.asked = info, metrics, []

    async def get_json(self, path: str, timeout_s: float = 10.0):
        self.asked.append(path)
        n = sum(p != "/metrics" for p in self.asked)
        return self.info(n) if callable(self.info) else self.info

    async def get_text(self, path: str, timeout_s: float = 5.0):
        self.asked.append(path)
        return self.metrics


def _run_poll(client, seconds: float, **options) -> AutoLimit:
    async def scenario():
        auto = AutoLimit(client, "e", cap=512, **options)
        auto.start(lambda: True, lambda: auto.limit)
        await asyncio.sleep(seconds)
        auto.close()
        return auto

    return asyncio.run(scenario())


def _pinned_stats() -> dict:
    """The worker stats of an endpoint with `concurrency` unset on a server that reports no batch (llama.cpp)."""
    auto = _run_poll(FakeServer((404, None)), 0.3, fallback=8)
    assert auto.fallback == 8 and auto.limit == 8 and auto.ctl.reason == "not set; no batch reported"
    return {"state": "healthy", "tok_s": 1.0, "errors": {}, **auto.stats()}


# --- change 1: what is shown and logged -------------------------------------------------------------------------
def test_status_does_not_call_a_concurrency_pinned_to_8_auto():
    from pipeline.store.status import _auto

    line = _auto(_pinned_stats())
    assert "auto" not in line, line


def test_the_card_does_not_say_auto_reached_8_for_an_endpoint_pinned_to_8():
    from pipeline.export.card import _concurrency_lines

    class Run:
        def read_status(self):
            return {"endpoints": {"llama-0": _pinned_stats()}}

    lines = _concurrency_lines(Run())
    assert not any("concurrency auto reached" in line for line in lines), lines


def test_the_driver_logs_that_an_unset_concurrency_was_pinned_to_8(caplog):
    """The actor's own log line never reaches the run's log (see the e2e test below); the driver's story logs a
    change of value only, and 8 -> 8 is none."""
    from pipeline.dispatch.story import log_concurrency

    before, after = {"concurrency": 8, "concurrency_reason": "start"}, _pinned_stats()
    caplog.clear()
    with caplog.at_level("INFO", logger="regen.dispatch"):
        log_concurrency("llama-0", before, after)
    assert "not set" in caplog.text or "no batch" in caplog.text, caplog.text


def test_the_run_log_says_an_unset_concurrency_became_auto(tmp_path, ray_cluster):
    """Docs: "the actor ... decides once it has read the server's limits, with a log line either way". The line is
    logged inside the Ray actor, whose logger has no handler: neither regen.log nor the console has it."""
    from tests.helpers import emulators, prompt_source, run_regen, write_config

    spec = prompt_source(tmp_path, 12)
    with emulators(1, preset="kimi", enable_metrics=True) as (server,):
        config = write_config(tmp_path, [{"url": server.url, "name": "emu"}], [spec], model="moonshotai/Kimi-K2.5",
                              ray={"address": ray_cluster["address"]})
        result = run_regen("generate", "--config", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "out" / "t" / "logs" / "regen.log").read_text()
    status = orjson.loads((tmp_path / "out" / "t" / "status.json").read_bytes())
    assert status["endpoints"]["emu"]["server_batch"], status["endpoints"]  # the actor read the batch: auto it is
    assert "concurrency auto (not set" in log + result.stderr, (log[-2000:], result.stderr[-2000:])


def test_validate_does_not_print_a_fixed_8_for_an_unset_concurrency(capsys):
    from pipeline.core.config_sections import Endpoint
    from pipeline.prompts.validate import _missing_secrets

    class Cfg:
        def all_endpoints(self):
            return [Endpoint(url="http://10.0.0.1:30000", name="sgl")]

    _missing_secrets(Cfg(), check=False)
    out = capsys.readouterr().out
    assert "concurrency 8" not in out, out   # the run makes it auto on an SGLang


def test_simulate_runs_an_unset_concurrency_as_the_real_run_would(tmp_path, monkeypatch):
    """`regen simulate` runs emulated SGLang servers, which report their batch: an unset concurrency is auto there,
    but the simulated config sets it to a fixed 8 (and the emulators' capacity to 8)."""
    import subprocess

    import pipeline.emulator
    from pipeline.tools import simulate
    from tests.helpers import prompt_source

    spec = prompt_source(tmp_path, 5)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_name": "sim", "model": "m", "sources": [{"spec": str(spec)}],
                                      "endpoints": [{"url": "http://10.0.0.1:30000"}]}))
    started, written = [], []

    class Emulator:
        url = "http://127.0.0.1:9"

        def stop(self):
            pass

    def start_emulator(**options):
        started.append(options)
        return Emulator()

    class Stop(Exception):
        pass

    def run(args, **kwargs):
        written.append(yaml.safe_load(open(args[args.index("--config") + 1]).read()))
        raise Stop

    monkeypatch.setattr(pipeline.emulator, "start_emulator", start_emulator)
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(Stop):
        simulate.simulate(str(config), endpoints=1, tok_s=50.0, sample=5)
    endpoint = written[0]["endpoints"][0]
    assert endpoint.get("concurrency", "unset") in ("auto", "unset"), (endpoint, started[0].get("capacity"))


# --- change 1: the reading that decides -------------------------------------------------------------------------
def test_auto_still_reads_the_gauges_of_a_server_whose_server_info_answers_5xx():
    """643b619: a 5xx reading is `continue`d before the gauges are read, every poll, forever: an explicit `auto`
    on such a server never reads /metrics and stays at its start of 8 (before 643b619 it read the gauges)."""
    client = FakeServer((500, {"error": "internal"}))
    auto = _run_poll(client, 1.0, interval_s=0.2)
    assert "/metrics" in client.asked and auto.limit > 8, (auto.limit, client.asked[:5], len(client.asked))


def test_a_429_at_the_first_reading_is_read_again_not_pinned_to_8():
    """643b619 reads a 5xx again; a 429 (or 408) from a gateway at the first reading still pins an SGLang that
    batches 256 to a fixed 8 for the whole run."""
    batch = {"internal_states": [{"effective_max_running_requests_per_dp": 256}], "dp_size": 1}
    client = FakeServer(lambda n: (429, {"error": "slow down"}) if n == 1 else (200, batch))
    auto = _run_poll(client, 1.0, interval_s=0.2, fallback=8)
    assert auto.fallback is None and auto.ctl.limits.max_running == 256, (auto.ctl.reason, client.asked[:4])


def test_a_concurrency_pinned_to_8_has_8_workers_even_under_a_smaller_cap():
    """Unset concurrency, concurrency_cap 4, a server with no batch: the pin says 8 (stats, status, the driver's
    demand of 16) but the worker has only `concurrency_cap` (4) coroutines, so 4 run."""
    from pipeline.dispatch.worker import EndpointWorker

    async def scenario():
        worker = EndpointWorker("http://127.0.0.1:9", "llama", 8, SETTINGS, concurrency_cap=4, auto_by_default=True)
        worker.auto.client = FakeServer((404, None))
        worker.auto.start(lambda: True, lambda: 0)
        await asyncio.wait_for(worker.auto._task, 5)
        stats, workers = worker.stats(), worker.concurrency
        await worker.close()
        return stats, workers

    stats, workers = asyncio.run(scenario())
    assert workers >= stats["concurrency"], (workers, stats["concurrency"])


# --- change 2: the connections ----------------------------------------------------------------------------------
class HoldingServer:
    """Accepts connections, reads each request and never answers: counts connections open at once."""

    def __init__(self):
        self.open = 0
        self.peak = 0

    async def handle(self, reader, writer):
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            await reader.read()          # until the client goes
        finally:
            self.open -= 1
            writer.close()


def test_a_set_concurrency_above_1024_gets_as_many_connections():
    """`concurrency` may be set to 4096 (and concurrency_cap to 4096), "a set number stays exact"; the pool opens
    at most 1024 connections (connections.py: max(1000, 1024)): the rest wait in the SDK's pool, counted in flight."""
    n = 1100

    async def scenario() -> int:
        holder = HoldingServer()
        server = await asyncio.start_server(holder.handle, "127.0.0.1", 0, backlog=2048)
        port = server.sockets[0].getsockname()[1]
        client = EndpointClient(f"http://127.0.0.1:{port}", "e", SETTINGS)
        tasks = [asyncio.create_task(client.chat([{"role": "user", "content": "q"}], None)) for _ in range(n)]
        end = time.monotonic() + 30
        last, stable = -1, 0
        while time.monotonic() < end and stable < 20:
            await asyncio.sleep(0.1)
            stable = stable + 1 if holder.peak == last else 0
            last = holder.peak
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        server.close()
        return holder.peak

    peak = asyncio.run(scenario())
    assert peak == n, peak


def test_the_probe_and_metrics_session_gives_up_idle_connections_as_the_sdk_does():
    """/health, /metrics, /server_info and the preflight's probes go through aiohttp, whose connector keeps an
    idle connection 15 s, past SGLang's and vLLM's 5 s: the race dd9aa60 removed from the SDK's pool stays here.
    Shown: a second /health 3 s after the first goes out on the first one's connection."""
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
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        client = EndpointClient(f"http://127.0.0.1:{port}", "e", SETTINGS)
        try:
            await client.get_json("/health")
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 1.0)
            await client.get_json("/health")
            return set(peers), client._session().connector._keepalive_timeout
        finally:
            await client.close()
            await runner.cleanup()

    peers, keepalive = asyncio.run(scenario())
    assert len(peers) == 2, f"one connection reused after {KEEPALIVE_EXPIRY_S + 1.0:.0f} s idle (keepalive {keepalive})"


def test_an_odd_server_info_does_not_end_the_poll_that_decides_an_unset_concurrency():
    """A /server_info whose `internal_states` is not a list (a proxy's or another server's shape): sglang_limits
    raises TypeError, only EndpointDown is caught, the poll task dies: the endpoint stays undecided (neither auto
    nor pinned, no log line), and an explicit auto would never read its gauges again."""
    client = FakeServer((200, {"internal_states": 5}))
    auto = _run_poll(client, 0.5, interval_s=0.2, fallback=8)
    assert not (auto._task.done() and not auto._task.cancelled() and auto._task.exception()), auto._task.exception()
    assert auto.fallback is None or auto.ctl.reason == "not set; no batch reported"
