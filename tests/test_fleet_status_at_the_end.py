"""A complete run shows nothing in flight (issue 23, smaller point: `regen status` showed `in flight 1` for an
endpoint of a complete run). The status of an endpoint is the snapshot of its last answer; a copy hedged at the
tail of the run is still running there when the run ends, and ending the actors stops it. The real Dispatcher and
EndpointWorkers in this process (tests/local_dispatch.py) against a fast and a slow SGLang emulator."""
from __future__ import annotations

from pipeline.emulator import start_emulator
from tests.local_dispatch import make_cfg, run_local, work_item


def test_after_a_complete_run_with_hedged_copies_no_endpoint_shows_work_in_flight():
    fast, slow = start_emulator(preset="kimi"), start_emulator(preset="kimi", tok_per_s=4)
    try:
        cfg = make_cfg([{"url": fast.url, "concurrency": 2, "name": "fast"},
                        {"url": slow.url, "concurrency": 2, "name": "slow"}], hedge_tail=True)
        items = [work_item(f"p{i}", f"Name one fact about owls (#{i}).", cfg) for i in range(6)]
        run = run_local(cfg, items, time_limit_s=60)
    finally:
        fast.stop()
        slow.stop()
    assert sorted(run.finished) == [f"p{i}" for i in range(6)]
    assert run.dispatcher.hedged, "the fast endpoint re-ran work the slow one still held"
    status = run.dispatcher.fleet_status()
    assert {label: entry["in_flight"] for label, entry in status.items()} == {"fast": 0, "slow": 0}
