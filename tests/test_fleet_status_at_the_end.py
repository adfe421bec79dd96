"""A complete run shows nothing in flight (issue 23, smaller point: `regen status` showed `in flight 1` for an
endpoint of a complete run). The status of an endpoint is the snapshot of its last answer; a copy hedged at the
tail of the run is still running there when the run ends, and ending the actors stops it. The real Dispatcher and
EndpointWorkers in this process (tests/local_dispatch.py) against a fast and a slow SGLang emulator.

The same run shows the goodput accounting of those copies (docs/goodput.md; the rest is in test_goodput.py)."""
from __future__ import annotations

import pytest

from pipeline.emulator import start_emulator
from tests.local_dispatch import make_cfg, run_local, work_item


@pytest.fixture(scope="module")
def hedged_run():
    fast, slow = start_emulator(preset="kimi"), start_emulator(preset="kimi", tok_per_s=4)
    try:
        cfg = make_cfg([{"url": fast.url, "concurrency": 2, "name": "fast"},
                        {"url": slow.url, "concurrency": 2, "name": "slow"}], hedge_tail=True)
        items = [work_item(f"p{i}", f"Name one fact about owls (#{i}).", cfg) for i in range(6)]
        return run_local(cfg, items, time_limit_s=60)
    finally:
        fast.stop()
        slow.stop()


def test_after_a_complete_run_with_hedged_copies_no_endpoint_shows_work_in_flight(hedged_run):
    run = hedged_run
    assert sorted(run.finished) == [f"p{i}" for i in range(6)]
    assert run.dispatcher.hedged, "the fast endpoint re-ran work the slow one still held"
    status = run.dispatcher.fleet_status()
    assert {label: entry["in_flight"] for label, entry in status.items()} == {"fast": 0, "slow": 0}


def test_each_hedged_copy_not_committed_is_counted_late_and_measured_or_cancelled_and_estimated(hedged_run):
    """Of each hedged prompt one copy is finished, the other answers late (its tokens measured) or is still running
    when the run ends and its actor is ended (it reports no tokens: estimated)."""
    waste = hedged_run.dispatcher.waste.goodput
    assert hedged_run.dispatcher.hedged
    assert waste.items["duplicate"] + waste.items["hedge_cancelled"] == len(hedged_run.dispatcher.hedged), waste
    assert waste.items["hedge_cancelled"] >= 1 and waste.tokens["hedge_cancelled"] > 0, waste
    assert waste.as_dict()["estimated"] == ["hedge_cancelled"]
