"""What regen says about each endpoint's concurrency (walk of issue 31): the card across resumed sessions, a set
number in `regen status` and the card, the `concurrency_cap` where it bounds auto below the server's batch, the
server's counts as integers, and the concurrency `regen simulate` predicted at."""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import orjson

from pipeline.dispatch.autolimit import AutoLimit
from pipeline.dispatch.capacity import AutoConcurrency
from pipeline.dispatch.story import log_concurrency
from pipeline.endpoints.capacity import Gauges, Limits, parse_gauges
from pipeline.export import card, card_concurrency
from pipeline.store.rundir import RunDir
from pipeline.store.status import _auto, capped, print_status
from tests.test_capacity import FakeServer, drive
from tests.test_card import known_run
from tests.test_concurrency_default import BATCH_256, InfoServer, poll_until, started

SERVER_15 = "sglang:num_running_reqs 15\nsglang:num_queue_reqs 0\n"   # Prometheus text: floats once parsed


def auto_stats(reached: int, ended: int, batch: int = 64, cap: int = 512, unset: bool = False) -> dict:
    """An auto endpoint's stats as its actor reports them: it rose to `reached`, then a cut left it at `ended`."""
    auto = AutoLimit(client=None, label="sgl", cap=cap, fallback=8 if unset else None)
    auto.mode = "auto"
    auto.ctl.reset(Limits(max_running=batch), 0.0)
    auto.ctl._set(reached, 1.0, "server keeps up")
    auto.ctl._set(ended, 2.0, "server queue")
    auto.gauges = parse_gauges(SERVER_15, 2.0)
    return {"state": "healthy", "in_flight": 0, "errors": {}, **auto.stats()}


def fixed_stats(concurrency: int) -> dict:
    """A set `concurrency`: the worker's own stats (no AutoLimit)."""
    from pipeline.dispatch.worker import EndpointWorker
    from pipeline.endpoints.client import ClientSettings

    async def scenario() -> dict:
        settings = ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8)
        worker = EndpointWorker("http://127.0.0.1:9", "vllm-0", concurrency, settings)
        stats = worker.stats()
        await worker.close()
        return stats

    return asyncio.run(scenario())


def session(run: RunDir, endpoints: dict[str, dict]) -> None:
    """One session of the run as the driver writes it: run_dispatch reads the last status.json, the dispatch's
    endpoints report, the end writes status.json (Ray's part stubbed: what the actors would have said)."""
    from pipeline.dispatch import session as dispatch_session
    from pipeline.store.progress import Progress

    progress = Progress(run, total=4, already_done=4, failed_before=0, rejects=0, terminal=False)

    def dispatch(*args, **kwargs):
        progress.endpoints = endpoints
        return "complete"

    original, dispatch_session.dispatch_with_ray = dispatch_session.dispatch_with_ray, dispatch
    try:
        cfg = SimpleNamespace(metrics=None, images=None)
        fleet = SimpleNamespace(images=False)
        dispatch_session.run_dispatch(cfg, run, None, [], None, progress, SimpleNamespace(graceful=False), fleet)
    finally:
        dispatch_session.dispatch_with_ray = original
    progress.write("complete")


# --- 1. the card -------------------------------------------------------------------------------------------------
def test_the_card_says_auto_at_the_end_of_the_last_session_and_what_earlier_sessions_ended_at(tmp_path):
    """A resume starts auto again from 8: the card read only the last session ("auto reached 16") while the first
    held 24. It labels the last session's value and lists the earlier sessions' (status.json's
    `concurrency_sessions`, carried from session to session)."""
    run = RunDir(known_run(tmp_path / "run"))
    session(run, {"sgl": auto_stats(32, 24)})
    session(run, {"sgl": auto_stats(20, 16), "vllm-0": fixed_stats(16)})
    text = Path(card.write_card(run.path)).read_text()
    assert ("- sgl: concurrency auto (the server batches up to 64): 16 at the end of the last session (its highest "
            "20); earlier sessions ended at 24 (the run's highest 32)") in text, text
    assert "- vllm-0: concurrency 16 (set)\n" in text, text
    status = orjson.loads((run.path / "status.json").read_bytes())
    assert [s["endpoints"]["sgl"]["concurrency"] for s in status["concurrency_sessions"]] == [24]


def test_the_card_says_which_an_unset_concurrency_became_and_names_the_cap():
    """docs/preflight-and-fleet.md: the card says which an unset concurrency became (auto or 8)."""
    class Run:
        def read_status(self):
            return {"endpoints": {"sgl": auto_stats(24, 24, batch=256, cap=24, unset=True)}}

    assert card_concurrency.concurrency_lines(Run()) == [
        "- sgl: concurrency auto (not set, and the server batches up to 256; capped at 24 by concurrency_cap): 24 at "
        "the end of the last session", ""]


# --- 2. regen status ----------------------------------------------------------------------------------------------
def test_status_shows_a_set_concurrency_as_set_in_text_and_json(tmp_path):
    run = RunDir(known_run(tmp_path / "run"))
    session(run, {"vllm-0": fixed_stats(16)})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert print_status(run.path) == 0
    line = next(line for line in out.getvalue().splitlines() if line.strip().startswith("vllm-0"))
    assert line.endswith("  concurrency 16 (set)"), line
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert print_status(run.path, as_json=True) == 0
    stats = orjson.loads(out.getvalue())["endpoints"]["vllm-0"]
    assert (stats["concurrency"], stats["concurrency_mode"]) == (16, "fixed"), stats


def test_status_reads_an_older_status_json_with_float_counts_and_no_mode():
    older = {"concurrency": 16, "server_running": 15.0, "server_waiting": 0.0, "server_batch": 64}
    assert _auto(older) == "  concurrency auto 16 (server running 15, waiting 0, batch 64)"
    assert _auto({"state": "healthy"}) == ""  # an older regen's set number: nothing, as before


def test_the_metrics_leave_a_set_concurrency_out_as_documented():
    from pipeline.dispatch.metrics import RunMetrics

    metrics = RunMetrics("r", "m", "f")
    metrics.status({"endpoints": {"vllm-0": fixed_stats(16)}})
    assert metrics.registry.get_sample_value("regen_endpoint_capacity", {"run": "r", "endpoint": "vllm-0",
                                                                         "what": "concurrency"}) is None


# --- 3. the cap -------------------------------------------------------------------------------------------------
def test_a_limit_the_cap_clamps_has_the_reason_concurrency_cap_and_the_log_says_so(caplog):
    ctl = AutoConcurrency(cap=24, limits=Limits(max_running=64), start=8)
    seen: list[int] = []
    drive(ctl, FakeServer(64), 0.0, 60, seen)
    assert (ctl.limit, ctl.reason) == (24, "concurrency_cap"), (seen, ctl.reason)
    roomy = AutoConcurrency(cap=512, limits=Limits(max_running=64), start=8)
    drive(roomy, FakeServer(64), 0.0, 60, [])
    assert roomy.reason == "server keeps up" and roomy.limit == 67, roomy.reason  # the server's ceiling: not the cap

    auto = AutoLimit(client=None, label="sgl", cap=24)
    before = {**auto.stats(), "concurrency": 16, "concurrency_reason": "server keeps up"}
    auto.ctl, auto.gauges = ctl, parse_gauges(SERVER_15.replace("15", "16"), 1.0)
    with caplog.at_level(logging.INFO, logger="regen.dispatch"):
        log_concurrency("capped-0", before, auto.stats())
    assert ("endpoint capped-0: concurrency 16 -> 24 (capped by concurrency_cap 24; the server runs 16, 0 waiting, "
            "batches up to 64)") in caplog.text, caplog.text


def test_the_driver_names_the_cap_when_auto_is_bounded_below_the_servers_batch(caplog):
    async def scenario(**options) -> dict:
        auto = started(InfoServer(lambda n: BATCH_256), cap=24, **options)
        await poll_until(auto, lambda: auto.mode == "auto" and auto.ctl.limits.max_running is not None)
        auto.close()
        return auto.stats()

    unset, explicit = asyncio.run(scenario(fallback=8)), asyncio.run(scenario())
    with caplog.at_level(logging.INFO, logger="regen.dispatch"):
        log_concurrency("unset-0", {"concurrency": 8, "concurrency_mode": "deciding"}, unset)
        log_concurrency("explicit-0", {}, explicit)
        log_concurrency("explicit-0", explicit, explicit)  # the same batch again: said once
    assert ("endpoint unset-0: concurrency auto (not set, and the server batches up to 256; capped at 24 by "
            "concurrency_cap)") in caplog.text, caplog.text
    assert caplog.text.count("endpoint explicit-0: concurrency auto (the server batches up to 256; capped at 24 by "
                             "concurrency_cap)") == 1, caplog.text
    assert _auto(explicit).endswith("batch 256; capped at 24 by concurrency_cap)"), _auto(explicit)


# --- 4. counts as integers --------------------------------------------------------------------------------------
def test_the_log_line_prints_the_servers_counts_as_integers(caplog):
    stats = auto_stats(32, 24)
    with caplog.at_level(logging.INFO, logger="regen.dispatch"):
        log_concurrency("sgl", {**stats, "concurrency": 32, "concurrency_reason": "server keeps up"}, stats)
    assert "(server queue; the server runs 15, 0 waiting, batches up to 64)" in caplog.text, caplog.text
    assert ".0" not in caplog.text and stats["server_running"] == 15, caplog.text


# --- 5. regen simulate ------------------------------------------------------------------------------------------
def test_simulate_says_at_what_concurrency_it_predicted():
    from pipeline.tools.simulate import Prediction, concurrency_assumed

    def wall_line(concurrency: str) -> str:
        return next(line for line in Prediction(300, 200, 1.0, 3600.0, 5, 1, concurrency=concurrency)
                    .table().splitlines() if line.startswith("predicted wall time"))

    assert wall_line(concurrency_assumed("auto", True, 512, 256, None)) == (
        "predicted wall time   1.00 h (3600 s) at concurrency auto (not set), reaching about 256 per endpoint (the "
        "servers' batch, --batch 256)")
    assert wall_line(concurrency_assumed("auto", False, 24, 256, 16)).endswith(
        "at concurrency auto, reaching about 24 per endpoint (concurrency_cap 24); tok/s flat past --knee 16")
    assert wall_line(concurrency_assumed(16, False, 512, 256, None)).endswith("at concurrency 16 per endpoint")


# --- found by a review that set out to break the reporting -----------------------------------------------------

def test_a_nan_or_inf_gauge_is_no_reading_and_never_makes_the_actors_stats_raise():
    """Prometheus text may say NaN or +Inf. Taken as a count, round() raised in the actor's stats (every exchange
    failed, the actor restarted and met the same gauge): such a sample is no count."""
    for value in ("NaN", "+Inf", "-Inf"):
        assert parse_gauges(f"sglang:num_running_reqs {value}\nsglang:num_queue_reqs 0\n", 1.0) is None
        auto = AutoLimit(client=None, label="sgl", cap=64)
        auto.gauges = parse_gauges(f"sglang:num_running_reqs 3\nsglang:num_queue_reqs {value}\n"
                                   f"sglang:num_queue_reqs 2\nsglang:num_retracted_requests_total {value}\n", 1.0)
        stats = auto.stats()
        assert (stats["server_running"], stats["server_waiting"]) == (3, 2) and auto.gauges.retracted_total is None


# --- 2. the card drops an endpoint that is not in the last session ------------------------------------------------
def test_the_card_names_an_endpoint_that_ran_only_in_earlier_sessions(tmp_path):
    """Session 1 ran sgl and old-0 (removed, or renamed, before session 2). concurrency_sessions keeps old-0's
    figures, but the card iterates the last session's endpoints only: old-0, which made records, is not named."""
    run = RunDir(known_run(tmp_path / "run"))
    session(run, {"sgl": auto_stats(32, 24), "old-0": auto_stats(48, 40)})
    session(run, {"sgl": auto_stats(20, 16)})
    text = Path(card.write_card(run.path)).read_text()
    assert "- old-0:" in text, text


def test_the_card_keeps_earlier_sessions_when_the_last_one_reported_no_endpoint(tmp_path):
    """A resume that failed before any endpoint answered (Ray would not start, every actor lost) writes status.json
    with no endpoints but the carried `concurrency_sessions`; the card exported then has no concurrency line at
    all, though the first session's auto reached 32."""
    run = RunDir(known_run(tmp_path / "run"))
    session(run, {"sgl": auto_stats(32, 24)})
    session(run, {})
    assert RunDir(run.path).read_status()["concurrency_sessions"]  # the history is there
    text = Path(card.write_card(run.path)).read_text()
    assert "- sgl:" in text, text



def test_an_endpoint_in_the_last_session_without_a_figure_is_not_said_to_be_absent(tmp_path):
    """sgl took part in the last session, but its actor never reported a concurrency (it never answered): the card
    said `not in the last session`, which is false."""
    run = RunDir(known_run(tmp_path / "run"))
    session(run, {"sgl": auto_stats(32, 24)})
    session(run, {"sgl": {"state": "open", "in_flight": 0}})
    line = next(x for x in Path(card.write_card(run.path)).read_text().splitlines() if x.startswith("- sgl:"))
    assert "no figure from the last session" in line and "not in the last session" not in line, line

# --- 3. the doc's card example cannot be produced ---------------------------------------------------------------
def test_the_docs_card_example_is_what_the_card_prints():
    """docs/preflight-and-fleet.md: `... 64 at the end of the last session (its highest 96); earlier sessions ended
    at 128`. An earlier session that ended at 128 went higher than 96, so the card always adds `(the run's highest
    128)`: the documented line is never printed."""
    doc = " ".join((Path(__file__).resolve().parent.parent / "docs" / "preflight-and-fleet.md").read_text().split())
    shown = re.search(r"`(- node-a: concurrency auto \(not set.*?earlier sessions ended at 128[^`]*)`", doc).group(1)
    last = auto_stats(96, 64, batch=256, unset=True)
    earlier = auto_stats(128, 128, batch=256, unset=True)
    assert card_concurrency.concurrency_line("node-a", last, [earlier]) == shown


# --- 4. a retraction cuts below half the limit ------------------------------------------------------------------
def test_a_retraction_never_cuts_below_half_the_limit():
    """capacity.py (b843aa4): 'a retraction: never below half the limit'. The half is truncated by int() in _cut:
    a limit of 3 is cut to 1, of 5 to 2."""
    for limit in (3, 5, 7):
        ctl = AutoConcurrency(cap=512, limits=Limits(max_running=64), start=limit)
        ctl.on_gauges(Gauges(0, 0, 0.0, 0.0), 0, 0.0)
        ctl.on_gauges(Gauges(0, 0, 5.0, 10.0), 0, 10.0)  # a retraction; the server's running count shows 0
        assert ctl.reason == "retractions"
        assert ctl.limit >= limit / 2, (limit, ctl.limit)


# --- 5. a cap equal to the batch: the log blames the cap, status does not --------------------------------------
def test_a_cap_equal_to_the_servers_batch_is_named_alike_in_the_log_and_status():
    """cap == batch (48): the controller's `capped` compares the cap with batch + headroom, so the clamp's reason is
    `concurrency_cap` and the driver logs `capped by concurrency_cap 48 ... batches up to 48`; status and the card
    (store/status.py capped: cap < batch) say nothing of the cap. The two disagree for the same endpoint."""
    ctl = AutoConcurrency(cap=48, limits=Limits(max_running=48), start=8)  # 8, 16, 32, 64 -> 48
    drive(ctl, FakeServer(48), 0.0, 60, [])
    auto = AutoLimit(client=None, label="sgl", cap=48)
    auto.ctl = ctl
    stats = auto.stats()
    assert ctl.limit == 48
    assert (stats["concurrency_reason"] == "concurrency_cap") == bool(capped(stats)), (stats, _auto(stats))


# --- 6. the card, a record of a finished run, promises a future decision ----------------------------------------
def test_the_card_does_not_promise_a_decision_for_a_run_that_ended():
    """47c941a made the card read as `regen status`: an unset endpoint whose limits were never read now says
    `(not set; auto or 8 once the server's limits are read)` on the card of an ended run (it said `the server's
    limits were never read`)."""
    class Run:
        def read_status(self):
            return {"endpoints": {"sgl": {"concurrency": 8, "concurrency_mode": "deciding",
                                          "concurrency_unset": True}}}

    [line, _] = card_concurrency.concurrency_lines(Run())
    assert "once the server's limits are read" not in line, line


# --- 7. regen preflight: the capacity warning is left out when another endpoint fails ----------------------------
def test_a_failed_preflight_still_prints_the_capacity_warning_under_its_table(tmp_path, capsys):
    """docs/preflight-and-fleet.md: `regen preflight` prints the warning under its table. On a refusal the table is
    printed (PreflightError branch of run_preflight_command) but capacity_said is never asked: a healthy endpoint
    far below its server's batch goes unwarned exactly when the user is editing the config."""
    from pipeline.emulator import start_emulator
    from pipeline.endpoints.preflight import run_preflight_command
    from tests.test_preflight import write_config

    good, bad = start_emulator(preset="kimi-eagle3"), start_emulator(preset="kimi", reasoning_parser="none")
    try:
        path = write_config(tmp_path, [good.url, bad.url], thinking=True,
                            endpoints=[{"url": good.url, "concurrency": 1}, {"url": bad.url}])
        assert run_preflight_command(path) == 1
        out, err = capsys.readouterr()
        assert "REFUSED" in out
        assert "raise `concurrency`" in out, out
    finally:
        good.stop()
        bad.stop()
