"""`concurrency: auto`: the controller's pure core (no Ray, no HTTP, a fake clock) and the emulator's curve."""
from __future__ import annotations

import asyncio

from pipeline.dispatch.capacity import AutoConcurrency
from pipeline.endpoints.capacity import Gauges, Limits, capacity_line, far_below, parse_gauges, sglang_limits
from pipeline.emulator.batch import Batch, step_time


class FakeServer:
    """Runs at most `batch` of what it is sent (its pool may admit fewer); the rest waits."""

    def __init__(self, batch: int, admits: int | None = None):
        self.batch, self.admits, self.retracted = batch, admits, 0

    def gauges(self, in_flight: int, now: float) -> Gauges:
        room = min(self.batch, self.admits or self.batch)
        running = min(in_flight, room)
        if self.admits is not None and in_flight > self.admits:
            self.retracted += 1                      # a pool too small for what it admitted
        return Gauges(running, in_flight - running, self.retracted, at=now)


def drive(ctl: AutoConcurrency, server: FakeServer, t0: float, seconds: float, seen: list[int]) -> float:
    t = t0
    while t < t0 + seconds:
        t += 1.0
        seen.append(ctl.on_gauges(server.gauges(ctl.limit, t), ctl.limit, t))
    return t


def test_auto_never_exceeds_its_cap_and_starts_small():
    ctl = AutoConcurrency(cap=100, limits=Limits(max_running=512), start=8)
    assert ctl.limit == 8                            # no burst at start
    seen: list[int] = []
    drive(ctl, FakeServer(512), 0.0, 300, seen)
    assert max(seen) <= 100 and seen[-1] == 100
    assert all(b - a <= a for a, b in zip(seen, seen[1:]))   # doubles at most: no burst


def test_auto_stays_within_the_servers_batch_and_queue():
    ctl = AutoConcurrency(cap=4096, limits=Limits(max_running=200, max_queued=4), start=8)
    seen: list[int] = []
    drive(ctl, FakeServer(200), 0.0, 300, seen)
    assert max(seen) <= 200 + 3                      # past the batch plus max_queued - 1: 503s
    assert seen[-1] >= 200


def test_auto_backs_off_when_the_servers_queue_grows():
    ctl = AutoConcurrency(cap=4096, limits=Limits(max_running=512), start=8)
    server = FakeServer(512)
    seen: list[int] = []
    t = drive(ctl, server, 0.0, 200, seen)
    high = ctl.limit
    server.batch = 60                                # the server now batches 60: the rest waits
    t = drive(ctl, server, t, 200, seen)
    assert ctl.limit < high and ctl.limit <= 60 + 2 * 3 + 2
    assert ctl.reason == "server queue" or ctl.limit >= 60


def test_auto_reconverges_on_a_restarted_server_with_a_smaller_pool():
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=300), start=8)
    seen: list[int] = []
    t = drive(ctl, FakeServer(300), 0.0, 200, seen)
    assert 290 <= ctl.limit <= 300 + 15
    ctl.reset(Limits(max_running=80), t)            # restarted: another pool, another batch
    assert ctl.limit <= 8
    small = FakeServer(80, admits=64)               # its pool admits 64 at once: more retracts
    seen.clear()
    drive(ctl, small, t, 300, seen)
    assert max(seen) <= 84
    tail = seen[-60:]
    assert 40 <= min(tail) and max(tail) <= 84      # settled near what the pool holds


def test_gauges_that_predate_a_change_are_not_acted_on():
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=500), start=8, interval_s=5.0)
    assert ctl.on_gauges(Gauges(8, 0, 0, at=6.0), 8, 6.0) > 8      # grew at t=6
    grown = ctl.limit
    # a reading from before the change (lagging gauges) showing a queue: ignored
    assert ctl.on_gauges(Gauges(8, 50, 0, at=5.0), grown, 9.0) == grown


def test_latency_mode_settles_past_the_knee():
    """No gauges: the time per token grows past the knee (the emulator's curve); the limit settles near it."""
    knee, step = 32, 0.02
    ctl = AutoConcurrency(cap=1000, limits=Limits(), start=8, interval_s=2.0)
    t = 0.0
    for _ in range(400):
        t += 0.25
        ctl.on_completion(step_time(step, knee, ctl.limit), ctl.limit, t)
    assert knee <= ctl.limit <= 4 * knee


def test_curve_batch_throughput_rises_flattens_and_retracts():
    """The emulator's batch in virtual terms: B requests of n tokens take n * step(B); a small pool retracts."""
    async def run(batch: Batch, n: int, tokens: int) -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        results = await asyncio.gather(*(batch.run(20, 20, tokens, tokens, None) for _ in range(n)))
        batch.close()
        return loop.time() - t0, sum(results)

    small, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 4, 50))
    knee, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 8, 50))
    big, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 32, 50))
    assert knee < small * 1.6                        # memory-bound: twice the batch, about the same time
    assert big > knee * 2.5                          # compute-bound: 4x the batch, ~4x the time
    _, retracted = asyncio.run(run(Batch(0.002, 8, 1200, 256), 32, 50))
    assert retracted > 0


def test_limits_gauges_and_the_preflight_line():
    info = {"max_running_requests": None, "dp_size": 2, "max_total_num_tokens": 900_000, "max_queued_requests": None,
            "internal_states": [{"effective_max_running_requests_per_dp": 256}, {}]}
    limits = sglang_limits(info)
    assert limits == Limits(512, None, 900_000)
    assert capacity_line(64, limits) == "concurrency 64, the server batches up to 512: at most 12% of its batch"
    assert far_below(64, limits) and not far_below(400, limits) and not far_below("auto", limits)
    text = ('sglang:num_running_reqs{dp_rank="0"} 30.0\nsglang:num_running_reqs{dp_rank="1"} 2.0\n'
            '# HELP x\nsglang:num_queue_reqs{a="b"} 4.0\nsglang:num_retracted_requests_total{a="b"} 7.0\n')
    assert parse_gauges(text, 1.0) == Gauges(32.0, 4.0, 7.0, 1.0)
    assert parse_gauges("vllm:num_requests_running 3\nvllm:num_requests_waiting 0\n", 2.0) == Gauges(3, 0, None, 2.0)


def test_auto_on_an_emulated_server_fills_its_batch_and_resettles_after_a_restart():
    """A worker with `concurrency: auto` against a curve emulator (batch 40): the limit climbs from 8 to the batch
    without passing it; the server restarts batching 12 and the limit comes down to it."""
    import orjson

    from pipeline.core.work import WorkItem
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.emulator import start_emulator
    from pipeline.endpoints.client import ClientSettings

    settings = ClientSettings(model="moonshotai/Kimi-K2.5", temperature=0.0, top_p=1.0, max_tokens=24)
    opts = dict(throughput_curve=True, enable_metrics=True, step_ms=5, knee=8, decode_log_interval=5)
    seen: list[int] = []

    async def scenario(server) -> None:
        worker = EndpointWorker(server.url, "emu", "auto", settings, concurrency_cap=64)
        worker.auto.ctl.interval_s = 0.4
        n = 0

        async def drive_until(done, deadline: float) -> None:
            nonlocal n
            loop = asyncio.get_running_loop()
            end = loop.time() + deadline
            while not done() and loop.time() < end:
                work = [WorkItem(f"p{n + i}", orjson.dumps([{"role": "user", "content": f"q {n + i}"}]), None)
                        for i in range(worker.demand())]
                n += len(work)
                await worker.exchange(work, wait_s=0.2)
                seen.append(worker.auto.limit)

        try:
            await drive_until(lambda: worker.auto.limit >= 40, 40.0)
            assert worker.auto.ctl.limits.max_running == 40
            assert 40 <= worker.auto.limit <= 42 and max(seen) <= 42
            server.restart(capacity=12)
            seen.clear()
            await drive_until(lambda: worker.auto.limit <= 16 and worker.state == "healthy", 40.0)
            assert worker.auto.limit <= 16, seen
            assert worker.stats()["concurrency"] == worker.auto.limit
        finally:
            await worker.close()

    with start_emulator(capacity=40, **opts) as server:
        asyncio.run(scenario(server))


def test_an_endpoints_file_line_may_say_auto(tmp_path):
    from pipeline.core.config import read_endpoints_file

    path = tmp_path / "endpoints.txt"
    path.write_text("http://10.0.0.1:30000 auto\nhttp://10.0.0.2:30000 16\nhttp://10.0.0.3:30000\n")
    got = [(e.concurrency, e.max_in_flight) for e in read_endpoints_file(path, "auto")]
    assert got == [("auto", 512), (16, 16), ("auto", 512)]
