"""The tail of a run, reached on purpose with the real Dispatcher and real EndpointWorkers in this process
(LocalTransport: no Ray) against real SGLang emulators: a hedged copy that fails never finishes a prompt still
running elsewhere, and an endpoint half-open at the tail gets its one request."""
from __future__ import annotations

from pipeline.core.work import DONE
from pipeline.dispatch.routing import home_of
from tests.helpers import emulators
from tests.local_dispatch import make_cfg, run_local, work_item


def test_a_hedged_copy_that_fails_never_finishes_a_prompt_still_running():
    """A slow endpoint holds prompt 0; at the tail an idle fast endpoint re-runs it and gets a 400. Before the fix
    that 400 finished the prompt as failed while the original was still running (and then succeeded)."""
    with emulators(1, preset="kimi", tok_per_s=6) as (slow,), \
            emulators(1, preset="kimi", poison_text="[hedge-me]", poison_fault="400") as (fast,):
        cfg = make_cfg([{"url": slow.url, "name": "slow", "concurrency": 4},
                        {"url": fast.url, "name": "fast", "concurrency": 4}],
                       sampling={"temperature": 0.0, "max_tokens": 12})
        labels = ["slow", "fast"]
        text = next(t for t in (f"Prompt [hedge-me] {n}" for n in range(200))
                    if home_of(work_item("x", t, cfg).affinity, labels) == "slow")
        items = [work_item("target", text, cfg)] + [work_item(f"f{i}", f"Filler {i}", cfg) for i in range(12)]
        result = run_local(cfg, items)
    assert "target" in result.dispatcher.hedged, "the fast endpoint re-ran the straggler"
    assert {pid: kinds for pid, kinds in result.kinds().items()} == {i.prompt_id: [DONE] for i in items}
    outcome, attempts = result.finished["target"][0]
    assert outcome.endpoint == "slow"


def test_an_endpoint_half_open_at_the_tail_of_the_run_gets_its_one_request():
    """Near the end of the run an endpoint's demand is cut by one concurrency (no prefetch). Before the fix that cut
    also took a half-open (probing) endpoint's single request to nothing: it never closed again, and the run hung
    with work queued. Found by the supervision property test (test_supervision.py)."""
    with emulators(1, preset="kimi", poison_text="[busy]", poison_fault="503", poison_times=2) as (server,):
        cfg = make_cfg([{"url": server.url, "name": "only", "concurrency": 4}], circuit_failures=2,
                       attempts_per_endpoint=1, max_attempts=4)
        items = [work_item(f"p{i}", f"[busy] Question {i}", cfg) for i in range(2)]  # both 503: the circuit opens
        result = run_local(cfg, items, time_limit_s=60)
    assert not result.stopped_at_limit, f"the run hung with its only endpoint half-open ({result.seconds:.0f}s)"
    assert result.kinds() == {"p0": [DONE], "p1": [DONE]}
    assert result.dispatcher.slots["only"].stats["errors"].get("circuit_opened") == 1
