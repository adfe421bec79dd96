"""Goodput: every generated token is accounted for by what became of it, and the first records of a run are
checked against the quality thresholds, so a run that wastes its tokens is caught in minutes. One shared run on
two SGLang emulators (Kimi preset: thinking on; the emulator's natural answer is 0.2-1.5x max_tokens, so about a
third are cut at max_tokens): first with `quality_gate: stop` (it stops after the first records, exit 5), then
resumed with only the gate changed to `warn` (it resumes the same run and completes)."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from types import SimpleNamespace

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.core import exits
from pipeline.core.work import Completion, Outcome
from pipeline.dispatch.waste import ThrownAway
from pipeline.export.card import write_card
from pipeline.export.jsonl import export_run
from pipeline.store.status import print_status
from pipeline.store.goodput import purpose_of
from tests.helpers import committed_ids, emulators, prompt_source, run_regen, write_config

MODEL = "moonshotai/Kimi-K2.5"
PROMPTS = 120
GATE_RECORDS = 30


def records(run: Path) -> list[dict]:
    rows = []
    for part in sorted((run / "data").glob("part-*.parquet")):
        rows += pq.read_table(part, columns=["prompt_id", "content", "finish_reason", "flags",
                                             "completion_tokens"]).to_pylist()
    return rows


@pytest.fixture(scope="module")
def gated(tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("goodput")
    with emulators(2, preset="kimi") as servers:
        endpoints = [{"url": s.url, "concurrency": 2, "name": f"emu-{i}"} for i, s in enumerate(servers)]
        source = prompt_source(tmp, PROMPTS)
        common = dict(model=MODEL, sampling={"temperature": 0.0, "max_tokens": 24}, progress_log_interval_s=0.2,
                      quality_gate_records=GATE_RECORDS)
        config = write_config(tmp, endpoints, [source], quality_gate="stop", **common)
        run = tmp / "out" / "t"
        stopped = run_regen("generate", "--config", str(config))
        after_stop = SimpleNamespace(status=orjson.loads((run / "status.json").read_bytes()),
                                     committed=len(committed_ids(run)), manifest=(run / "run.json").read_bytes(),
                                     status_cli=run_regen("status", str(run)))
        # only the gate differs (its action, a threshold, its sample: more than the session has left, so it is
        # checked when the dispatch ends): the same run resumes
        config = write_config(tmp, endpoints, [source], quality_gate="warn", quality_thresholds={"truncated": 0.2},
                              **{**common, "quality_gate_records": 1000})
        resumed = run_regen("generate", "--config", str(config))
    # in this process (the commands' own functions), to keep the module short: regen status, card, export
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_status(run)
    write_card(run)
    export = export_run(run, "specforge", tmp / "sf.jsonl")
    return SimpleNamespace(run=run, tmp=tmp, stopped=stopped, after_stop=after_stop, resumed=resumed,
                           status=orjson.loads((run / "status.json").read_bytes()), status_out=out.getvalue(),
                           export=export, log=(run / "logs" / "regen.log").read_text())


def test_the_gate_stops_a_run_cut_at_max_tokens_after_its_first_records_with_its_own_exit_code(gated):
    assert gated.stopped.returncode == exits.QUALITY_GATE.code == 5, gated.stopped.stderr[-2000:]
    # the console names the setting to change and what it would cost
    console = gated.stopped.stderr
    assert "QUALITY GATE" in console and "cut at max_tokens" in console, console[-3000:]
    assert re.search(r"sampling\.max_tokens 48 would cost up to \d+% more tokens", console), console[-3000:]
    assert "quality_gate: warn" in console  # how to go on anyway
    # it stopped early and kept what it committed: resumable
    assert GATE_RECORDS <= gated.after_stop.committed < PROMPTS
    assert gated.after_stop.status["state"] == "stopped_by_quality_gate"
    verdict = gated.after_stop.status["quality_gate"]
    assert verdict["records"] == GATE_RECORDS and not verdict["passed"]
    assert "truncated" in {f["measure"] for f in verdict["findings"]}
    assert "QUALITY GATE (stop):" in gated.after_stop.status_cli.stdout


def test_a_config_differing_only_in_the_gate_resumes_the_same_run(gated):
    assert gated.resumed.returncode == 0, gated.resumed.stderr[-2000:]
    assert not (gated.tmp / "out" / "t-r2").exists()
    assert (gated.run / "run.json").read_bytes() == gated.after_stop.manifest  # identity untouched
    rows = records(gated.run)
    assert sorted(r["prompt_id"] for r in rows) == sorted(committed_ids(gated.run)) and len(rows) == PROMPTS
    # `warn` goes on; the session, smaller than the gate's sample, is checked when its dispatch ends
    err = gated.resumed.stderr
    assert "QUALITY GATE" in err and "found at the end of the session's dispatch" in err, err[-3000:]
    assert f"this session made {PROMPTS - gated.after_stop.committed} records, fewer than quality_gate_records=1000" \
        in gated.log
    assert gated.status["quality_gate"]["records"] == PROMPTS - gated.after_stop.committed


def test_every_committed_token_is_counted_once_by_what_the_default_export_made_of_it(gated):
    goodput = gated.status["goodput"]
    rows = records(gated.run)
    by_purpose: dict[str, int] = {}
    for row in rows:
        by_purpose[purpose_of(row)] = by_purpose.get(purpose_of(row), 0) + row["completion_tokens"]
    committed = {p: goodput["tokens"][p] for p in ("training", "flagged", "truncated_thinking", "truncated",
                                                   "empty")}
    assert committed == {p: by_purpose.get(p, 0) for p in committed}, (committed, by_purpose)
    assert committed["truncated"] + committed["truncated_thinking"] > 0
    assert goodput["generated_tokens"] == sum(goodput["tokens"].values()) >= sum(r["completion_tokens"] for r in rows)
    # "became training data" is exactly what the default export wrote
    written = [orjson.loads(line) for line in (gated.tmp / "sf.jsonl").read_bytes().splitlines()]
    tokens = {r["prompt_id"]: r["completion_tokens"] for r in rows}
    assert gated.export.records_exported == len(written)
    assert goodput["training_tokens"] == sum(tokens[w["id"].split("#")[0]] for w in written) > 0
    assert goodput["share"] == pytest.approx(goodput["training_tokens"] / goodput["generated_tokens"], abs=1e-4)
    assert goodput["share"] < 0.9


def test_the_share_shows_in_status_the_log_and_the_card(gated):
    share = f"goodput {100 * gated.status['goodput']['share']:.1f}% of {gated.status['goodput']['generated_tokens']:,}"
    assert share in gated.status_out, gated.status_out
    progress = [line for line in gated.log.splitlines() if "progress: " in line]
    assert progress and all("; goodput" in line for line in progress), progress[:2]
    assert re.search(r"goodput \d+\.\d% of [\d,]+ generated tokens became training data \(not: .*truncated \d",
                     progress[-1]), progress[-1]
    assert any(share in line for line in gated.log.splitlines()[-3:])  # the run's last lines
    card = (gated.run / "README.md").read_text()
    assert "## Goodput" in card and f"{100 * gated.status['goodput']['share']:.1f}% of the " in card


def test_copies_thrown_away_are_counted_measured_or_estimated():
    """The dispatch's side: a late copy's tokens are measured; a copy still running when the run ends is
    estimated from the mean tokens of a prompt; turns before a failure are a retry's or a failure's."""
    def done(pid: str, tokens: int) -> Outcome:
        return Outcome(pid, "done", "e", 1, completions=[Completion("a", None, "stop", 1, tokens, None, None, "m",
                                                                    None, 1.0, "r")])

    waste = ThrownAway()
    waste.done(done("a", 100))
    waste.late(done("a", 90))
    waste.failed(Outcome("b", "retryable", "e", 1, discarded_tokens=40), terminal=False)
    waste.failed(Outcome("c", "terminal", "e", 1, discarded_tokens=7), terminal=True)
    import time
    waste.cancelled([("a", time.monotonic() - 10.0), ("d", time.monotonic())], unfinished={"d"}, mean_latency=1.0)
    tokens = waste.goodput.tokens
    assert (tokens["duplicate"], tokens["retry"], tokens["failed"], tokens["hedge_cancelled"]) == (90, 40, 7, 100)


@pytest.mark.parametrize("fault, times, purpose", [("500", 2, "retry"), ("400", 0, "failed")])
def test_turns_generated_before_a_later_turn_fails_are_counted_as_a_retrys_or_a_failures(fault, times, purpose):
    """all_turns: the second turn fails after the first was generated; the prompt is run again whole (a retryable
    error, twice on this endpoint) or fails for good (400): the first turn's tokens were thrown away, and the
    dispatch counts exactly them. The real Dispatcher and EndpointWorkers (tests/local_dispatch.py)."""
    from pipeline.core.work import WorkItem
    from tests.local_dispatch import make_cfg, run_local

    conversation = [{"role": "user", "content": "Name one fact about owls."}, {"role": "assistant", "content": "Owls."},
                    {"role": "user", "content": "[second] And one about cats?"}]
    with emulators(1, preset="kimi", poison_text="[second]", poison_fault=fault, poison_times=times) as (server,):
        cfg = make_cfg([{"url": server.url, "name": "emu", "concurrency": 1}], mode="all_turns", hedge_tail=False)
        run = run_local(cfg, [WorkItem("p", orjson.dumps(conversation), None)])
    (outcome, _attempts), = run.finished["p"]
    waste = run.dispatcher.waste.goodput
    if purpose == "retry":  # run again whole: its first turn is generated again, the same at temperature 0
        assert outcome.kind == "done"
        assert waste.tokens == {"retry": outcome.completions[0].completion_tokens}
    else:
        assert outcome.kind == "terminal" and outcome.discarded_tokens > 0
        assert waste.tokens == {"failed": outcome.discarded_tokens}


def test_the_gate_names_the_setting_for_empty_and_repeating_records_and_passes_a_clean_sample():
    """The measures the emulator does not produce, on records flagged by the real quality flags."""
    from pipeline.store.gate import GateSample
    from pipeline.store.quality import quality_flags

    def row(content: str, reasoning: str | None, finish: str, tokens: int) -> dict:
        return {"content": content, "finish_reason": finish, "completion_tokens": tokens,
                "flags": quality_flags(content, reasoning, finish, tokens, 512)}

    loop = " ".join(["the cat sat on the mat"] * 40)
    rows = ([row("A fine answer.", None, "stop", 40)] * 16 + [row("", None, "stop", 1)] * 2
            + [row(loop, None, "stop", 500)] * 2)
    thresholds = {"truncated": 0.1, "truncated_thinking": 0.05, "empty": 0.02, "repetition": 0.05}
    sample = GateSample(size=20)
    assert sample.add(rows)
    findings = {f.measure: f for f in sample.check(thresholds, 512)}
    assert sorted(findings) == ["empty", "repetition"]
    assert "sampling.repetition_penalty" in findings["repetition"].message(20)
    assert "2 of the first 20 records (10.0%" in findings["empty"].message(20)
    clean = GateSample(size=16)
    clean.add(rows[:16])
    assert clean.check(thresholds, 512) == []


def test_the_gate_settings_are_not_part_of_the_run_identity(tmp_path):
    from pipeline.core.config import load_config

    base = dict(model=MODEL, sampling={"temperature": 0.0, "max_tokens": 24})
    source = prompt_source(tmp_path, 1)
    endpoints = [{"url": "http://127.0.0.1:1", "name": "e"}]
    plain = load_config(write_config(tmp_path, endpoints, [source], **base))
    gated = load_config(write_config(tmp_path, endpoints, [source], quality_gate="stop", quality_gate_records=5,
                                     quality_thresholds={"truncated": 0.5, "empty": 0.0}, **base))
    assert gated.quality_gate == "stop"
    assert (gated.identity(), gated.fingerprint()) == (plain.identity(), plain.fingerprint())



@pytest.fixture(scope="module")
def killed_all_turns(tmp_path_factory, ray_cluster):
    """An all_turns run (16 three-turn conversations; about a third of the turns cut at max_tokens) whose driver is
    SIGKILLed after its third commit, then resumed to the end. status.json's interval is an hour: only the counts
    written right after a commit can carry them to the next session."""
    import os
    import signal
    import time

    from tests.helpers import start_regen, wait_for

    tmp = tmp_path_factory.mktemp("all_turns")
    conversations = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me about topic {i}."}, {"from": "gpt", "value": "ok"},
        {"from": "human", "value": f"And more on {i}?"}, {"from": "gpt", "value": "ok"},
        {"from": "human", "value": f"Last question on {i}."}]} for i in range(16)]
    (tmp / "c.jsonl").write_bytes(b"".join(orjson.dumps(c) + b"\n" for c in conversations))
    spec = tmp / "c.yaml"
    spec.write_text(f"name: c\nkind: jsonl\npath: {tmp / 'c.jsonl'}\nformat: sharegpt\nid_field: id\n")
    run = tmp / "out" / "t"
    with emulators(1, preset="kimi", tok_per_s=400) as (server,):
        config = write_config(tmp, [{"url": server.url, "concurrency": 2, "name": "emu"}], [spec], model=MODEL,
                              mode="all_turns", sampling={"temperature": 0.0, "max_tokens": 24}, quality_gate="off",
                              flush_records=1, status_interval_s=3600)
        driver = start_regen("generate", "--config", str(config))
        try:
            wait_for(lambda: len(list((run / "data").glob("part-*.parquet"))) >= 3, 120, what="three commits")
            for _ in range(20):  # stop it where no commit is half counted (the status write follows the part's)
                os.kill(driver.pid, signal.SIGSTOP)
                newest = max(p.stat().st_mtime_ns for p in (run / "data").glob("part-*.parquet"))
                if (run / "status.json").stat().st_mtime_ns >= newest:
                    break
                os.kill(driver.pid, signal.SIGCONT)
                time.sleep(0.05)
        finally:
            driver.kill()
            driver.wait(timeout=30)
        killed = SimpleNamespace(status=orjson.loads((run / "status.json").read_bytes()), rows=all_turns_records(run))
        resumed = run_regen("generate", "--config", str(config))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    write_card(run)
    export = export_run(run, "specforge", tmp / "sf.jsonl")
    return SimpleNamespace(run=run, tmp=tmp, killed=killed, export=export, rows=all_turns_records(run),
                           status=orjson.loads((run / "status.json").read_bytes()))


def all_turns_records(run: Path) -> list[dict]:
    rows = []
    for part in sorted((run / "data").glob("part-*.parquet")):
        rows += pq.read_table(part, columns=["prompt_id", "turn_index", "content", "finish_reason", "flags",
                                             "completion_tokens", "tool_calls"]).to_pylist()
    return rows


def test_all_turns_counts_as_training_only_the_turns_the_whole_conversation_export_writes(killed_all_turns):
    """A turn cut at max_tokens mid-conversation is dropped by the default (whole-conversation) SpecForge export, and
    so is every later turn of that conversation (their history holds the cut turn). The share that became training
    data, in status.json and in the card, is exactly the tokens of the turns the export wrote."""
    run = killed_all_turns
    assert run.export.counts()["dropped"].get("follows_dropped_or_missing_turn"), run.export.counts()  # the case
    tokens = {(r["prompt_id"], r["turn_index"]): r["completion_tokens"] for r in run.rows}
    written = 0
    for line in (run.tmp / "sf.jsonl").read_bytes().splitlines():
        row = orjson.loads(line)
        turns = sum(m["role"] == "assistant" for m in row["conversations"])
        written += sum(tokens[(row["id"].split("#")[0], k)] for k in range(turns))
    goodput = run.status["goodput"]
    assert goodput["training_tokens"] == written > 0, (goodput, written)
    assert goodput["tokens"]["follows_dropped_or_missing_turn"] > 0
    card = (run.run / "README.md").read_text()
    assert f"{100 * written / goodput['generated_tokens']:.1f}% of the {goodput['generated_tokens']} " in card, card


def test_a_driver_killed_with_sigkill_loses_no_committed_records_count_and_the_resume_counts_none_twice(
        killed_all_turns):
    """status.json carries the counts from one session to the next: it is written as soon as a commit is counted
    (not only every status_interval_s), so a SIGKILL right after a commit loses nothing, and the resumed run's
    committed counts are exactly the parts'."""
    from pipeline.store.goodput import COMMITTED, Goodput

    def counted(status: dict) -> dict[str, int]:
        return {p: status["goodput"]["tokens"][p] for p in COMMITTED if status["goodput"]["tokens"][p]}

    def in_parts(rows: list[dict]) -> dict[str, int]:
        goodput = Goodput()
        goodput.add_records(rows, whole_conversations=True)
        return {p: goodput.tokens[p] for p in COMMITTED if goodput.tokens[p]}

    run = killed_all_turns
    assert 3 <= len({r["prompt_id"] for r in run.killed.rows}) < 16
    assert counted(run.killed.status) == in_parts(run.killed.rows), "the committed records' counts survive a SIGKILL"
    assert len(run.rows) == 3 * 16
    assert counted(run.status) == in_parts(run.rows), "nothing counted twice or lost across the two sessions"


def test_a_session_smaller_than_the_gate_sample_is_checked_when_its_dispatch_ends(caplog):
    """A 40-prompt smoke run never reaches quality_gate_records=300: its records are checked at the end, with a
    warning (there is nothing left to stop); too few records to say anything are only noted."""
    from pipeline.store.gate import SMALLEST_SAMPLE, QualityGate

    cut = {"content": "x", "finish_reason": "length", "completion_tokens": 24, "flags": []}
    fine = {"content": "A fine answer.", "finish_reason": "stop", "completion_tokens": 10, "flags": []}
    thresholds = {"truncated": 0.1, "truncated_thinking": 0.05, "empty": 0.02, "repetition": 0.05}
    gate = QualityGate("stop", 300, thresholds, max_tokens=24)
    for i in range(40):
        gate.observe([cut if i % 2 else fine])
    assert gate.verdict == {}, "not checked before the sample is full"
    with caplog.at_level("INFO", logger="regen.quality"):
        gate.finish()  # no QualityGateStopped: the session is over
    assert gate.verdict["records"] == 40 and not gate.verdict["passed"]
    assert [f["measure"] for f in gate.verdict["findings"]] == ["truncated"]
    assert "20 of the first 40 records (50.0%" in caplog.text and "fewer than quality_gate_records=300" in caplog.text
    tiny = QualityGate("warn", 300, thresholds, max_tokens=24)
    tiny.observe([cut] * (SMALLEST_SAMPLE - 1))
    with caplog.at_level("INFO", logger="regen.quality"):
        tiny.finish()
    assert tiny.verdict == {} and "too few to check (fewer than 20)" in caplog.text
    # a quality_gate_records under 20 is the user's choice: the message names it, not 20
    small = QualityGate("warn", 12, thresholds, max_tokens=24)
    small.observe([cut] * 11)
    with caplog.at_level("INFO", logger="regen.quality"):
        small.finish()
    assert small.verdict == {} and "this session made 11 records, too few to check (fewer than 12)" in caplog.text


def test_warn_goes_on_after_a_full_sample_and_says_how_to_stop_instead(caplog):
    from pipeline.store.gate import QualityGate

    cut = {"content": "x", "finish_reason": "length", "completion_tokens": 24, "flags": []}
    thresholds = {"truncated": 0.1, "truncated_thinking": 0.05, "empty": 0.02, "repetition": 0.05}
    gate = QualityGate("warn", 20, thresholds, max_tokens=24)
    with caplog.at_level("INFO", logger="regen.quality"):
        gate.observe([cut] * 25)  # no QualityGateStopped: `warn`
    assert not gate.verdict["passed"] and gate.verdict["records"] == 20
    assert "QUALITY GATE: 20 of the first 20 records" in caplog.text
    assert "the run goes on (quality_gate: warn); `quality_gate: stop` stops it here" in caplog.text
