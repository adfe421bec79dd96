"""`concurrency: auto`: the controller's pure core (no Ray, no HTTP, a fake clock) and the emulator's curve."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.dispatch.capacity import AutoConcurrency
from pipeline.endpoints.capacity import Gauges, Limits, capacity_line, far_below, parse_gauges, sglang_limits
from pipeline.emulator.batch import Batch, step_time
from tests.helpers import post_json


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


def test_the_ramp_doubles_as_soon_as_the_gauges_show_the_raise_not_once_an_interval():
    """Readings every 0.25 s that show the server running all it is sent: 8 -> 160 in well under one 2.5 s
    interval per doubling, never more than doubling at once."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=160), start=8, interval_s=2.5)
    seen, t = [8], 0.0
    while t < 3.0:
        t += 0.25
        seen.append(ctl.on_gauges(FakeServer(160).gauges(ctl.limit, t), ctl.limit, t))
    assert seen[-1] >= 160
    assert all(b <= 2 * a for a, b in zip(seen, seen[1:]))


def test_the_ramp_waits_for_a_reading_that_shows_the_raise():
    """Lagging gauges: readings still showing the batch from before a raise change nothing; the first one in which
    the server runs more than the old limit allows the next doubling, before the interval has passed."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=500), start=8, interval_s=2.5)
    assert ctl.on_gauges(Gauges(8, 0, 0, at=2.5), 8, 2.5) == 16       # the first raise: an aged reading
    for t in (2.75, 3.0, 3.25):                                         # snapshots from before it: 8 running
        assert ctl.on_gauges(Gauges(8, 0, 0, at=t), 16, t) == 16
    assert ctl.on_gauges(Gauges(16, 0, 0, at=3.5), 16, 3.5) == 32      # 1 s after the raise, not 2.5


def test_a_retraction_while_ramping_ends_the_ramp_at_once():
    """Ramping up, the limit has only risen: a retraction in the next reading cuts it without waiting an interval."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=500), start=8, interval_s=2.5)
    ctl.on_gauges(Gauges(8, 0, 0, at=2.5), 8, 2.5)
    ctl.on_gauges(Gauges(16, 0, 0, at=3.0), 16, 3.0)
    assert ctl.limit == 32
    assert ctl.on_gauges(Gauges(20, 0, 3, at=3.25), 32, 3.25) == 20
    assert not ctl.slow_start and ctl.reason == "retractions"


def test_a_retraction_cuts_to_what_the_server_runs_but_never_below_half_the_limit():
    """SGLang's retraction sends running requests back to its queue: the reading that shows it can show a running
    count far below what the pool holds. Cutting to it made a pool-bound server's limit swing; half is the floor."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=500), start=64, interval_s=2.5)
    ctl.on_gauges(Gauges(64, 0, 0, at=2.5), 64, 2.5)
    assert ctl.limit == 128
    assert ctl.on_gauges(Gauges(6, 100, 5, at=3.0), 128, 3.0) == 64
    assert ctl.reason == "retractions" and ctl.too_many == 128


def test_a_queue_in_one_reading_alone_is_no_cut():
    """A snapshot taken while a burst of arrivals waits for the next scheduler step shows a queue once; the limit
    is cut only when the next reading shows it still."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=160), start=168, interval_s=2.5)
    assert ctl.on_gauges(Gauges(109, 35, 0, at=3.0), 168, 3.0) == 168
    assert ctl.on_gauges(Gauges(160, 8, 0, at=4.0), 168, 4.0) == 168      # gone: it was a burst
    assert ctl.on_gauges(Gauges(120, 40, 0, at=5.0), 168, 5.0) == 168
    assert ctl.on_gauges(Gauges(118, 42, 0, at=6.0), 168, 6.0) < 168      # twice in a row: a queue
    assert ctl.reason == "server queue"


def test_after_a_cut_auto_holds_below_the_limit_that_was_cut_instead_of_oscillating():
    """A pool that holds 24 requests (more retract): after its first cut the limit climbs back to just below the
    limit the cut came from and stays there, trying that limit again rarely (4, then 8, then 16 intervals)."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=48), start=8, interval_s=2.5)
    server = FakeServer(48, admits=24)
    seen: list[int] = []
    t = drive(ctl, server, 0.0, 100, seen)
    changes = len(ctl.changes)
    tail: list[int] = []
    drive(ctl, server, t, 200, tail)
    assert len(ctl.changes) - changes <= 12          # a probe and its cut every 40 s at most
    assert max(tail) <= 25 and sum(v <= 24 for v in tail) >= 0.9 * len(tail)
    assert min(tail) >= 20


def test_a_held_limit_grows_again_once_a_probe_holds():
    """The held limit is no ceiling: held below a pool of 24, once the pool holds more (a long run's prompts get
    shorter) the next probe holds and the limit grows past the old cut."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=96), start=8, interval_s=2.5)
    server = FakeServer(96, admits=24)
    seen: list[int] = []
    t = drive(ctl, server, 0.0, 100, seen)
    held = seen[30:]                                 # held at 24, trying 25 rarely, not climbing past the pool
    assert max(held) <= 25 and sum(v <= 24 for v in held) >= 0.85 * len(held)
    server.admits = 64
    drive(ctl, server, t, 200, seen)
    assert 56 <= ctl.limit <= 65                     # 64, or a probe of 65


def test_settled_is_when_the_limit_entered_its_final_band_not_its_last_probe():
    """Probes within 10% of the held limit do not move the settle time; a cut out of the band does."""
    ctl = AutoConcurrency(cap=1000, limits=Limits(max_running=48), start=8, interval_s=2.5)
    server = FakeServer(48, admits=24)
    seen: list[int] = []
    drive(ctl, server, 0.0, 300, seen)
    last_change = ctl.changes[-1][0]
    assert ctl.settled_at is not None and ctl.settled_at < 60 < last_change
    ctl.on_gauges(Gauges(10, 0, server.retracted + 1, at=400.0), 24, 400.0)   # the pool shrank: a real cut
    assert ctl.settled_at == 400.0


def test_latency_mode_settles_past_the_knee():
    """No gauges: the time per token grows past the knee (the emulator's curve); the limit settles near it."""
    knee, step = 32, 0.02
    ctl = AutoConcurrency(cap=1000, limits=Limits(), start=8, interval_s=2.0)
    t = 0.0
    for _ in range(400):
        t += 0.25
        ctl.on_completion(step_time(step, knee, ctl.limit), ctl.limit, t)
    assert knee <= ctl.limit <= 4 * knee


def test_curve_batch_throughput_rises_flattens_and_retracts(monkeypatch):
    """The emulator's batch in virtual terms: B requests of n tokens take n * step(B); a small pool retracts. Time is
    virtual (no load changes a figure): the clock moves only when the batch's own scheduler waits out the timeout it
    chose, so a scheduler that slept too long, or never woke, fails here."""
    from types import SimpleNamespace

    import pipeline.emulator.batch as batch_module

    clock = [0.0]
    monkeypatch.setattr(batch_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def waits_in_virtual_time(awaitable, timeout):
        if timeout is None:
            return await awaitable                # nothing runs: only an arrival wakes it
        task = asyncio.ensure_future(awaitable)
        await asyncio.sleep(0)                    # arrivals scheduled now get in first
        if task.done():
            return task.result()
        task.cancel()
        clock[0] += max(timeout, 1e-7)            # the timeout passes (a real clock always moves a little)
        raise TimeoutError

    virtual_asyncio = SimpleNamespace(**{**vars(asyncio), "wait_for": waits_in_virtual_time})
    monkeypatch.setattr(batch_module, "asyncio", virtual_asyncio)

    async def run(batch: Batch, n: int, tokens: int) -> tuple[float, int]:
        t0 = clock[0]
        requests = asyncio.gather(*(batch.run(20, 20, tokens, tokens, None) for _ in range(n)))
        retracted = await asyncio.wait_for(requests, 60)  # real seconds: a batch that never finishes fails
        batch.close()
        return clock[0] - t0, sum(retracted)

    small, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 4, 50))
    knee, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 8, 50))
    big, _ = asyncio.run(run(Batch(0.002, 8, 10**6, 256), 32, 50))
    assert small == pytest.approx(50 * step_time(0.002, 8, 4), rel=1e-4)
    assert knee == pytest.approx(50 * step_time(0.002, 8, 8), rel=1e-4)
    assert knee < small * 1.6                        # memory-bound: twice the batch, about the same time
    assert big > knee * 2.5                          # compute-bound: 4x the batch, ~4x the time
    _, retracted = asyncio.run(run(Batch(0.002, 8, 1200, 256), 32, 50))
    assert retracted > 0


def test_emulator_gauges_count_as_waiting_only_what_its_batch_could_not_admit(monkeypatch):
    """SGLang logs its gauges after a decode batch, once the iteration has admitted what fits: arrivals it could
    admit are never counted as waiting, however late its loop runs (a starved emulator counted them, and `auto`
    cut the large server's limit on that queue)."""
    from types import SimpleNamespace

    import pipeline.emulator.batch as batch_module

    clock = [0.0]
    monkeypatch.setattr(batch_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def scenario() -> tuple:
        batch = Batch(0.001, 8, 10**6, 256, log_interval=1)
        tasks = [asyncio.ensure_future(batch.run(20, 20, 10_000, 10_000, None))]
        while len(batch.running) < 1:
            await asyncio.sleep(0)
        clock[0] += 1.0                              # 1,000 steps pass before the loop next runs
        tasks += [asyncio.ensure_future(batch.run(20, 20, 10_000, 10_000, None)) for _ in range(10)]
        while len(batch.running) < 11:
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        batch.close()
        return batch.gauges[:2]

    assert asyncio.run(scenario()) == (11, 0)


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
            await drive_until(lambda: worker.auto.limit >= 40, 180.0)  # a ceiling: it ends on the event
            assert worker.auto.ctl.limits.max_running == 40
            assert 40 <= worker.auto.limit <= 42 and max(seen) <= 42
            server.restart(capacity=12)
            seen.clear()
            await drive_until(lambda: worker.auto.limit <= 16 and worker.state == "healthy", 180.0)
            assert worker.auto.limit <= 16, seen
            assert worker.stats()["concurrency"] == worker.auto.limit
        finally:
            await worker.close()

    with start_emulator(capacity=40, **opts) as server:
        asyncio.run(scenario(server))
        # the curve times its steps itself: a per-request decode speed would be accepted and do nothing
        status, answer = post_json(server.url + "/admin/faults", {"tok_per_s": 2})
        assert status == 400 and "throughput curve" in answer["error"]["message"]
        assert post_json(server.url + "/admin/faults", {"tok_per_s": 0})[0] == 200  # its value: no change


def test_an_endpoints_file_line_may_say_auto(tmp_path):
    from pipeline.core.config import read_endpoints_file

    path = tmp_path / "endpoints.txt"
    path.write_text("http://10.0.0.1:30000 auto\nhttp://10.0.0.2:30000 16\nhttp://10.0.0.3:30000\n")
    got = [(e.concurrency, e.max_in_flight) for e in read_endpoints_file(path, "auto")]
    assert got == [("auto", 512), (16, 16), ("auto", 512)]


def test_a_server_info_of_another_shape_reads_as_no_batch_reported():
    from pipeline.endpoints.capacity import vllm_limits

    for odd in ({"internal_states": 5}, {"internal_states": "x", "dp_size": "2"}, {"max_queued_requests": True}):
        assert sglang_limits(odd) == Limits(), odd
    for odd in ({"vllm_config": {"scheduler_config": 5, "cache_config": []}}, {"vllm_config": []}):
        assert vllm_limits(odd) == Limits(), odd
    assert sglang_limits(dict(internal_states=[{"effective_max_running_requests_per_dp": 64}], dp_size=2)) == \
        Limits(max_running=128)
