"""`concurrency` not set: `auto` on a server that reports its batch, else a fixed 8 (config_sections.Endpoint,
dispatch/autolimit.py); set, it is exactly what it says."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import orjson
import pytest

from pipeline.core.config_sections import Endpoint, LocalFleet
from pipeline.dispatch.autolimit import AutoLimit
from pipeline.endpoints.capacity import Limits, capacity_line, shown_concurrency

BATCH_256 = (200, {"internal_states": [{"effective_max_running_requests_per_dp": 256}], "dp_size": 1})
FULL = "sglang:num_running_reqs 8\nsglang:num_queue_reqs 0\n"   # a server running all it is sent


def test_only_an_endpoint_without_a_concurrency_is_auto_by_default():
    assert Endpoint(url="http://10.0.0.1:30000").auto_by_default
    assert not Endpoint(url="http://10.0.0.1:30000", concurrency=8).auto_by_default  # a fixed 8 stays exact
    assert not Endpoint(url="http://10.0.0.1:30000", concurrency="auto").auto_by_default
    assert not any(e.auto_by_default for e in LocalFleet(servers=2).endpoints())  # slots: the servers' own batch


def test_the_preflight_says_auto_for_an_unset_concurrency_only_where_the_server_reports_its_batch():
    unset, fixed = Endpoint(url="http://10.0.0.1:30000"), Endpoint(url="http://10.0.0.1:30000", concurrency=8)
    assert capacity_line(shown_concurrency(unset, Limits(max_running=256)), Limits(max_running=256)) == \
        "concurrency auto, the server batches up to 256"
    assert shown_concurrency(unset, Limits()) == 8
    assert shown_concurrency(fixed, Limits(max_running=256)) == 8


class NoBatchServer:
    """The client of a server with no /server_info (llama.cpp, vLLM outside dev mode): 404 on both paths."""
    engine = None

    def __init__(self):
        self.asked: list[str] = []

    async def get_json(self, path: str, timeout_s: float = 10.0):
        self.asked.append(path)
        return 404, None

    async def get_text(self, path: str, timeout_s: float = 5.0):
        self.asked.append(path)
        return 404, ""


def test_an_unset_concurrency_on_a_server_without_a_batch_is_a_fixed_8_and_nothing_moves_it():
    async def scenario():
        client = NoBatchServer()
        auto = AutoLimit(client, "llama", cap=512, fallback=8)
        auto.start(lambda: True, lambda: 8)
        while auto.fallback is not None and "/get_server_info" not in client.asked:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(auto._task, 10)  # the poll ends once pinned: no gauges, no latency after
        for _ in range(50):
            auto.completed(latency_s=0.01, tokens=10, in_flight=8)  # fast answers never raise a pinned limit
        return auto, client

    auto, client = asyncio.run(scenario())
    assert auto.limit == 8 and auto.ctl.cap == 8
    assert "/metrics" not in client.asked


def test_an_unset_concurrency_on_an_emulated_sglang_climbs_past_8():
    from pipeline.core.work import WorkItem
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.emulator import start_emulator
    from pipeline.endpoints.client import ClientSettings

    settings = ClientSettings(model="moonshotai/Kimi-K2.5", temperature=0.0, top_p=1.0, max_tokens=24)

    async def scenario(server) -> tuple[int, int | None]:
        worker = EndpointWorker(server.url, "emu", 8, settings, concurrency_cap=64, auto_by_default=True)
        worker.auto.ctl.interval_s = 0.4
        n = 0
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 180  # a ceiling: it ends on the event
            while worker.auto.limit <= 8 and loop.time() < end:
                work = [WorkItem(f"p{n + i}", orjson.dumps([{"role": "user", "content": f"q {n + i}"}]), None)
                        for i in range(worker.demand())]
                n += len(work)
                await worker.exchange(work, wait_s=0.2)
            return worker.auto.limit, worker.auto.ctl.limits.max_running
        finally:
            await worker.close()

    with start_emulator(capacity=40, throughput_curve=True, enable_metrics=True, step_ms=5, knee=8,
                        decode_log_interval=5) as server:
        limit, batch = asyncio.run(scenario(server))
    assert batch == 40 and 8 < limit <= 42


class DownThenBatchServer(NoBatchServer):
    """/server_info fails twice (the server down for a moment), then reports a batch of 256."""

    async def get_json(self, path: str, timeout_s: float = 10.0):
        from pipeline.core.errors import EndpointDown

        self.asked.append(path)
        if len(self.asked) <= 2:
            raise EndpointDown("connection refused", endpoint="http://127.0.0.1:9")
        return 200, {"internal_states": [{"effective_max_running_requests_per_dp": 256}], "dp_size": 1}


def test_a_server_down_at_the_first_reading_of_its_limits_is_read_again_not_pinned_to_8():
    async def scenario():
        client = DownThenBatchServer()
        auto = AutoLimit(client, "sgl", cap=512, interval_s=0.1, fallback=8)
        auto.start(lambda: True, lambda: 0)
        while auto.fallback is not None and not auto._task.done():
            await asyncio.sleep(0.01)  # each poll is an await on the fake client: no clock involved
        auto.close()
        return auto

    auto = asyncio.run(scenario())
    assert auto.fallback is None and auto.ctl.limits.max_running == 256 and auto.ctl.cap == 512


class InfoServer:
    """The client of a server whose /server_info answers `info(n)` at its n-th ask (a (status, body) pair, or an
    exception to raise) and whose /metrics shows it running everything it is sent. Each call sets `called`."""
    engine = None

    def __init__(self, info: Callable[[int], Any]):
        self.info, self.asked, self.info_at = info, [], []
        self.called = asyncio.Event()

    async def get_json(self, path: str, timeout_s: float = 10.0):
        self.asked.append(path)
        self.info_at.append(time.monotonic())
        self.called.set()
        answer = self.info(len(self.info_at))
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def get_text(self, path: str, timeout_s: float = 5.0):
        self.asked.append(path)
        self.called.set()
        return 200, FULL


async def poll_until(auto: AutoLimit, done: Callable[[], bool]) -> None:
    """Wait, call by call of the fake client, until `done()` or the poll's end (60 s: a hang, never a budget)."""
    client = auto.client
    auto._task.add_done_callback(lambda _: client.called.set())

    async def calls() -> None:
        while not done() and not auto._task.done():
            client.called.clear()
            await client.called.wait()

    await asyncio.wait_for(calls(), 60)


def started(client: Any, **options) -> AutoLimit:
    auto = AutoLimit(client, "e", cap=options.pop("cap", 512), **options)
    auto.start(lambda: True, lambda: auto.limit)
    return auto


def pinned_stats() -> dict:
    """The stats of an endpoint with `concurrency` unset on a server that reports no batch (llama.cpp)."""
    async def scenario() -> dict:
        auto = started(NoBatchServer(), fallback=8)
        await asyncio.wait_for(auto._task, 60)  # the poll ends once pinned
        return auto.stats()

    return {"state": "healthy", "tok_s": 1.0, "errors": {}, **asyncio.run(scenario())}


def decided_auto_stats() -> dict:
    async def scenario() -> dict:
        auto = started(InfoServer(lambda n: BATCH_256), fallback=8)
        await poll_until(auto, lambda: auto.mode != "deciding")
        auto.close()
        return auto.stats()

    return {"state": "healthy", "tok_s": 1.0, "errors": {}, **asyncio.run(scenario())}


# --- what is shown and logged -------------------------------------------------------------------------------------
def test_status_says_fixed_not_auto_for_an_unset_concurrency_pinned_to_8():
    from pipeline.store.status import _auto

    pinned, auto = _auto(pinned_stats()), _auto(decided_auto_stats())
    assert "auto" not in pinned and "concurrency 8 (not set; the server reports no batch)" in pinned, pinned
    assert auto.startswith("  concurrency auto ") and "batch 256" in auto, auto


def test_metrics_say_whether_auto_drives_an_unset_concurrency():
    from pipeline.dispatch.metrics import RunMetrics

    metrics = RunMetrics("r", "m", "f")
    metrics.status({"endpoints": {"llama": pinned_stats(), "sgl": decided_auto_stats()}})
    auto = {ep: metrics.registry.get_sample_value("regen_endpoint_capacity",
                                                   {"run": "r", "endpoint": ep, "what": "auto"}) for ep in ("llama", "sgl")}
    assert auto == {"llama": 0.0, "sgl": 1.0}, auto


def test_the_driver_logs_what_an_unset_concurrency_became(caplog):
    """The actor's own log reaches no file: the driver logs the decision, a pin to 8 from 8 included."""
    from pipeline.dispatch.story import log_concurrency

    start = {"concurrency": 8, "concurrency_reason": "start", "concurrency_mode": "deciding"}
    with caplog.at_level(logging.INFO, logger="regen.dispatch"):
        log_concurrency("llama-0", start, pinned_stats())
        log_concurrency("sgl-0", start, decided_auto_stats())
        log_concurrency("explicit-0", {}, {"concurrency": 8, "concurrency_reason": "start", "concurrency_mode": "auto",
                                           "concurrency_unset": False})
    assert "endpoint llama-0: concurrency 8 (not set, and the server reports no batch limit" in caplog.text
    assert "endpoint sgl-0: concurrency auto (not set, and the server batches up to 256)" in caplog.text
    assert "explicit-0" not in caplog.text, caplog.text


def test_the_run_log_says_an_unset_concurrency_became_auto(tmp_path, ray_cluster):
    """Docs: the actor decides once it has read the server's limits, with a log line either way: in regen.log."""
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
    assert "endpoint emu: concurrency auto (not set, and the server batches up to" in log, log[-2000:]


# --- the reading that decides -------------------------------------------------------------------------------------
def test_auto_reads_the_gauges_of_a_server_whose_server_info_answers_5xx_and_asks_it_again_with_a_backoff():
    """An explicit auto is not held at its start by a /server_info that keeps failing: its gauges drive it, and
    the limits are asked again after interval_s, then twice as long each time (not at every poll)."""
    async def scenario():
        client = InfoServer(lambda n: (500, {"error": "internal"}))
        auto = started(client, interval_s=0.1)
        await poll_until(auto, lambda: auto.limit > 8 and len(client.info_at) >= 4)
        auto.close()
        return auto, client

    auto, client = asyncio.run(scenario())
    assert "/metrics" in client.asked and auto.limit > 8, (auto.limit, client.asked[:5])
    gaps = [b - a for a, b in zip(client.info_at, client.info_at[1:])][:3]
    assert all(gap >= 0.1 * 2 ** i for i, gap in enumerate(gaps)), gaps


@pytest.mark.parametrize("status", [408, 429, 503])
def test_a_gateways_408_or_429_at_the_first_reading_is_read_again_not_pinned_to_8(status):
    async def scenario():
        client = InfoServer(lambda n: (status, {"error": "slow down"}) if n == 1 else BATCH_256)
        auto = started(client, interval_s=0.1, fallback=8)
        await poll_until(auto, lambda: auto.mode != "deciding")
        auto.close()
        return auto

    auto = asyncio.run(scenario())
    assert auto.mode == "auto" and auto.fallback is None and auto.ctl.limits.max_running == 256, auto.ctl.reason


def test_an_unset_concurrency_under_a_smaller_cap_is_pinned_to_the_cap_the_workers_there_are():
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.endpoints.client import ClientSettings

    async def scenario():
        settings = ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8)
        worker = EndpointWorker("http://127.0.0.1:9", "llama", 8, settings, concurrency_cap=4, auto_by_default=True)
        worker.auto.client = NoBatchServer()
        worker.auto.start(lambda: True, lambda: 0)
        await asyncio.wait_for(worker.auto._task, 60)
        stats, workers = worker.stats(), worker.concurrency
        await worker.close()
        return stats, workers

    stats, workers = asyncio.run(scenario())
    assert (stats["concurrency_mode"], stats["concurrency"], workers) == ("pinned", 4, 4)


def test_an_odd_server_info_pins_an_unset_concurrency_and_the_poll_goes_on():
    """`internal_states` not a list (a proxy's shape): no batch reported, never a TypeError ending the poll."""
    async def scenario():
        auto = started(InfoServer(lambda n: (200, {"internal_states": 5})), interval_s=0.1, fallback=8)
        await poll_until(auto, lambda: auto.mode != "deciding")
        return auto

    auto = asyncio.run(scenario())
    assert auto._task.done() and auto._task.exception() is None, auto._task
    assert auto.mode == "pinned" and auto.limit == 8


def test_an_exception_in_the_poll_is_in_the_stats_and_the_drivers_log_and_the_poll_goes_on(caplog):
    from pipeline.dispatch.story import log_concurrency

    async def scenario():
        client = InfoServer(lambda n: RuntimeError("an odd answer") if n == 1 else BATCH_256)
        auto = started(client, interval_s=0.1, fallback=8)
        await poll_until(auto, lambda: auto.poll_error is not None)
        failed = auto.stats()
        await poll_until(auto, lambda: auto.mode != "deciding")
        auto.close()
        return auto, failed

    auto, failed = asyncio.run(scenario())
    assert failed["concurrency_poll_error"] == "RuntimeError: an odd answer"
    assert auto.mode == "auto" and auto.ctl.limits.max_running == 256   # the poll went on
    with caplog.at_level(logging.INFO, logger="regen.dispatch"):
        log_concurrency("sgl-0", {"concurrency": 8}, failed)
    assert "endpoint sgl-0: the poll of its concurrency failed (it goes on): RuntimeError: an odd answer" in \
        caplog.text


def test_an_unset_concurrency_on_a_real_llama_cpp_is_pinned_to_8(llama_fleet):
    """llama.cpp serves no batch on /server_info (its own answer, not a fake's): the worker of an endpoint without
    a concurrency runs a fixed 8 there, says so in its stats, and no gauge or latency moves it."""
    from pipeline.core.work import WorkItem
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.endpoints.client import ClientSettings

    settings = ClientSettings(model="SmolLM2-135M-Instruct", temperature=0.0, top_p=1.0, max_tokens=4)
    url = llama_fleet.endpoints()[0].url

    async def scenario() -> dict:
        worker = EndpointWorker(url, "llama", 8, settings, concurrency_cap=64, auto_by_default=True)
        try:
            n = 0
            while worker.auto.mode == "deciding":  # the poll reads the limits once the first work is in
                work = [WorkItem(f"p{n + i}", orjson.dumps([{"role": "user", "content": "hi"}]), None)
                        for i in range(max(1, worker.demand()))]
                n += len(work)
                await worker.exchange(work, wait_s=0.2)
            await asyncio.wait_for(worker.auto._task, 60)  # a pinned concurrency's poll ends
            return worker.auto.stats()
        finally:
            await worker.close()

    stats = asyncio.run(asyncio.wait_for(scenario(), 120))  # the bound only turns a hang into a failure
    assert (stats["concurrency"], stats["concurrency_mode"], stats["concurrency_unset"]) == (8, "pinned", True)
    assert stats["server_batch"] is None
