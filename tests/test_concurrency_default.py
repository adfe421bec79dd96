"""`concurrency` not set: `auto` on a server that reports its batch, else a fixed 8 (config_sections.Endpoint,
dispatch/autolimit.py); set, it is exactly what it says."""
from __future__ import annotations

import asyncio

import orjson

from pipeline.core.config_sections import Endpoint, LocalFleet
from pipeline.dispatch.autolimit import AutoLimit
from pipeline.endpoints.capacity import Limits, capacity_line, shown_concurrency


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
            end = loop.time() + 60
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
