"""Regression tests for the dispatch and worker defects of issue 13. Each failed on the code before its fix:

3. a worker coroutine died on any exception outside RequestError (the run hung);
4. an actor dying on every start never tripped the dead-fleet deadline;
4b. a prompt that killed its actor was charged nothing and restarted it without backoff, for ever;
6. all_turns counted successful turns against max_attempts;
7. an error event inside an SSE stream bypassed the classifier (a 400 was retried);
8. a prompt that made the server drop the connection was retried forever;
13. endpoints unreachable at the preflight started "healthy".
The narrow windows of dispatch are in test_tail_hedging.py (a hedged copy failing), test_fleet_changes.py (a torn
endpoints file) and test_crash_blame.py (a crash charged to its prompt), and the property test of supervision in
test_supervision.py.
"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import RunConfig
from pipeline.core.errors import EndpointFatal, Retryable, RunFatal, TerminalForPrompt
from pipeline.core.work import DONE, RETRY, WorkItem
from pipeline.dispatch.worker import EndpointWorker
from pipeline.endpoints.client import ClientSettings, StreamAccumulator
from tests.helpers import (
    committed_ids, data_parts, emulators, free_port, run_regen, write_config, write_prompts, write_source,
)
from tests.local_dispatch import make_cfg, run_local, work_item

MODEL = "moonshotai/Kimi-K2.5"

SETTINGS = ClientSettings(model=MODEL, temperature=0.0, top_p=1.0, max_tokens=16)


def rows_of(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def failures_of(run: Path) -> list[dict]:
    return [r for p in sorted((run / "failures").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def prompt_text(run: Path, prompt_id: str) -> str:
    prompts = pq.read_table(sorted((run / "prompts").glob("prompts-*.parquet"))[-1]).to_pylist()
    return next(p["messages"][-1]["content"] for p in prompts if p["prompt_id"] == prompt_id)


def status_of(run: Path) -> dict:
    return orjson.loads((run / "status.json").read_bytes())


def endpoints_of(servers, concurrency: int = 4) -> list[dict]:
    return [{"url": s.url, "concurrency": concurrency, "name": f"emu-{i}"} for i, s in enumerate(servers)]


def item(prompt_id: str, text: str = "Name one fact about owls.") -> WorkItem:
    return WorkItem(prompt_id, orjson.dumps([{"role": "user", "content": text}]), None)


# --- 3. no exception ends a worker silently --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with emulators(1, preset="kimi") as servers:
        yield servers[0]


async def _exchange_until(worker: EndpointWorker, work: list[WorkItem], n: int, timeout_s: float = 60.0) -> list:
    outcomes = list((await worker.exchange(work, wait_s=0.2)).outcomes)
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < n and time.monotonic() < deadline:
        outcomes += (await worker.exchange([], wait_s=0.2)).outcomes
    return outcomes


@pytest.mark.parametrize("error", [KeyError("choices"), ValueError("malformed error body"), RuntimeError("boom"),
                                   AttributeError("'NoneType' object has no attribute 'get'"), ZeroDivisionError(),
                                   OSError(5, "Input/output error"), asyncio.CancelledError()],
                         ids=lambda e: type(e).__name__)
def test_an_exception_of_any_type_at_the_client_becomes_an_outcome(server, error):
    """One worker coroutine (concurrency 1): before the fix the exception ended it, its prompt never came back and
    every later prompt waited forever in its inbox."""
    async def scenario():
        worker = EndpointWorker(server.url, "emu", 1, SETTINGS, attempts_per_endpoint=1)
        real_chat, calls = worker.client.chat, []

        async def chat(messages, seed, tools=None):
            calls.append(1)
            if len(calls) == 1:
                raise error
            return await real_chat(messages, seed)

        worker.client.chat = chat
        try:
            outcomes = await _exchange_until(worker, [item("p1"), item("p2")], 2)
            return outcomes, worker.stats()
        finally:
            await worker.close()

    outcomes, stats = asyncio.run(scenario())
    by_prompt = {o.prompt_id: o for o in outcomes}
    assert set(by_prompt) == {"p1", "p2"}, "every prompt comes back"
    failed = by_prompt["p1"]
    assert failed.kind == RETRY and failed.attempts == 1, "counted as an attempt, retried (elsewhere)"
    assert failed.message.startswith(type(error).__name__), failed.message
    assert by_prompt["p2"].kind == DONE, "the worker coroutine lives on"
    assert stats["errors"]["unexpected"] == 1 and type(error).__name__ in stats["last_error"]


# --- 4. an actor that dies on every start -------------------------------------------------------------------
def test_an_actor_that_dies_on_every_start_trips_the_dead_fleet_deadline(ray_cluster):
    """Before the fix each restart reset the actor's start time: it always looked new, and the run never stopped."""
    import ray

    from pipeline.dispatch.dispatcher import Dispatcher

    @ray.remote(num_cpus=0)
    class DiesOnStart:
        def __init__(self):
            raise RuntimeError("this actor cannot start")

        def exchange(self, work, wait_s):
            raise AssertionError("never reached")

    from ray._private import ray_constants

    cfg = RunConfig.model_validate({"run_name": "crashy", "model": MODEL, "sources": [{"spec": "unused.yaml"}],
                                    "endpoints": [{"url": f"http://127.0.0.1:{free_port()}", "name": "crashy"}],
                                    "dead_fleet_deadline_s": 4})
    ray_constants.ENABLE_RAY_CLUSTER = False  # a loopback driver (Ray was imported before the fixture's switch)
    ray.init(address=ray_cluster["address"])
    try:
        made: list = []
        stopped, stop = spinning_or_endless(time.monotonic(), lambda: made[0] if made else None, max_restarts=10)
        dispatcher = Dispatcher(cfg, [item("p")], lambda o, a: None, lambda s: None, stop,
                                lambda e, start_open: DiesOnStart.remote())
        made.append(dispatcher)
        fatal = None
        try:
            dispatcher.run()
        except RunFatal as exc:
            fatal = exc
        finally:
            dispatcher.shutdown()
        assert stopped == [], f"the test stopped the run: {stopped}"
        assert fatal is not None and "no healthy endpoint" in str(fatal)
        assert 1 <= dispatcher.actor_restarts <= 10, "restarts back off instead of spinning"
    finally:
        ray.shutdown()


def crashing_fleet(ray, cfg: RunConfig, crashes_on: bytes):
    """An actor factory: real EndpointWorkers in Ray actors whose process exits (a crash: RayActorError) when
    handed a prompt containing `crashes_on`, after answering its first, empty exchange like any actor."""
    class CrashesOnPrompt(EndpointWorker):
        async def exchange(self, work, wait_s=0.5):
            if any(crashes_on in w.messages_json for w in work):
                os._exit(1)
            return await super().exchange(work, wait_s)

    remote = ray.remote(CrashesOnPrompt)
    return lambda e, start_open: remote.options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(
        e.url, e.label, e.concurrency, SETTINGS, None, "last_turn", 1, 5, backoff_initial_s=0.05)


SAFETY_NET_S = 400  # the run never ended: only a broken build reaches it; an event ends every passing run


def spinning_or_endless(started: float, dispatcher_of, max_restarts: int) -> tuple[list[str], object]:
    """A stop check that ends a run gone wrong (more actor restarts than the run may cause, or no end at all) and
    says so: the tests wait for the run's own end, not for a budget of seconds."""
    stopped: list[str] = []

    def stop() -> bool:
        dispatcher = dispatcher_of()
        if dispatcher is not None and dispatcher.actor_restarts > max_restarts:
            stopped.append(f"{dispatcher.actor_restarts} actor restarts, more than this run may cause ({max_restarts})")
        elif time.monotonic() - started > SAFETY_NET_S:
            stopped.append(f"no end after {SAFETY_NET_S}s")
        return bool(stopped)

    return stopped, stop


def restart_delays(records) -> list[tuple[int, float, float | None]]:
    """From the dispatcher's log: (actors lost in a row, the delay it logs before the next actor starts, the
    seconds until it logs that start, or None where the run ended first)."""
    delays = []
    for i, record in enumerate(records):
        found = re.search(r"a new actor starts in ([0-9.]+)s \((\d+) lost in a row\)", record.getMessage())
        if found:
            start = next((later.created for later in records[i + 1:] if "actor restarted (" in later.getMessage()),
                         None)
            delays.append((int(found[2]), float(found[1]), None if start is None else start - record.created))
    return delays


def assert_restarts_back_off(delays: list[tuple[int, float, float | None]]) -> None:
    """The first loss restarts at once; each further loss in a row waits twice as long, to the maximum: as logged,
    and as the next start's time shows."""
    from pipeline.dispatch import dispatcher

    for lost, logged, waited in delays:
        expected = 0.0 if lost == 1 else min(dispatcher.RESTART_BACKOFF_MAX_S,
                                             dispatcher.RESTART_BACKOFF_S * 2 ** (lost - 2))
        assert abs(logged - expected) < 0.05, f"after {lost} lost in a row the delay is {logged}s, not {expected}s"
        assert waited is None or waited >= expected - 0.05, \
            f"after {lost} lost in a row the next actor started after {waited:.2f}s, not {expected}s"


def dispatch_on_ray(ray_cluster, cfg: RunConfig, items: list[WorkItem], crashes_on: bytes, max_restarts: int):
    """(dispatcher, outcomes by prompt, the RunFatal that ended the run or None, why the test stopped it or [])."""
    import ray
    from ray._private import ray_constants

    from pipeline.dispatch.dispatcher import Dispatcher

    ray_constants.ENABLE_RAY_CLUSTER = False  # a loopback driver (Ray was imported before the fixture's switch)
    ray.init(address=ray_cluster["address"])
    finished: dict[str, list] = {}
    made: list = []
    stopped, stop = spinning_or_endless(time.monotonic(), lambda: made[0] if made else None, max_restarts)
    dispatcher = Dispatcher(cfg, items, lambda o, a: finished.setdefault(o.prompt_id, []).append(o),
                            lambda s: None, stop, crashing_fleet(ray, cfg, crashes_on))
    made.append(dispatcher)
    try:
        dispatcher.run()
        return dispatcher, finished, None, stopped
    except RunFatal as exc:
        return dispatcher, finished, exc, stopped
    finally:
        dispatcher.shutdown()
        ray.shutdown()


def test_a_prompt_that_kills_its_actor_is_terminal_and_restarts_back_off(ray_cluster, caplog):
    """The actor's process dies whenever it is handed the poison prompt. Before the fix the replacement answered
    its empty exchange, which reset its backoff, the prompt was charged nothing, and it killed actor after actor
    without end (577 restarts in 12 s): the run never ended."""
    with emulators(1, preset="kimi") as (server,):
        cfg = RunConfig.model_validate({"run_name": "poison", "model": MODEL, "sources": [{"spec": "unused.yaml"}],
                                        "endpoints": [{"url": server.url, "name": "emu", "concurrency": 4}],
                                        # an actor's start takes half a minute on a loaded machine, and the
                                        # endpoint is down meanwhile: no deadline is what this test is about
                                        "max_connection_drops": 3, "dead_fleet_deadline_s": 3600})
        items = [item("poison", "[kill-actor] Name one fact.")] + [item(f"p{i}", f"Fact {i}?") for i in range(5)]
        with caplog.at_level("INFO", logger="regen.dispatch"):
            # at most two crashes among others, then three alone
            dispatcher, finished, fatal, stopped = dispatch_on_ray(ray_cluster, cfg, items, b"[kill-actor]", 6)
    assert stopped == [] and fatal is None, f"the run did not end on its own: {stopped or fatal}"
    assert {pid: [o.kind for o in outs] for pid, outs in finished.items()} == \
        {"poison": ["terminal"], **{f"p{i}": [DONE] for i in range(5)}}
    assert finished["poison"][0].message.startswith("the actor serving it died 3 times")
    delays = restart_delays(caplog.records)
    # one line a loss (the last may end the run before its restart); the poison alone: losses in a row
    assert dispatcher.actor_restarts <= len(delays) <= dispatcher.actor_restarts + 1
    assert max(lost for lost, *_ in delays) >= 2
    assert_restarts_back_off(delays)


def test_an_actor_that_dies_on_every_prompt_trips_the_dead_fleet_deadline_and_its_restarts_back_off(caplog,
                                                                                                        monkeypatch):
    """An endpoint whose actor dies on any prompt it is given (it answers empty exchanges): before the fix it
    counted as healthy after each empty answer, and the run never stopped. In this process (an exception out of
    the exchange is a lost actor, as a Ray actor's death is): a replacement starts at once, so on a loaded machine
    the deadline cannot trip before the restarts show, as it did while a Ray actor took half a minute to start."""
    from pipeline.dispatch import dispatcher
    from pipeline.dispatch.actors import client_settings, local_worker_factory

    # a backoff capped below the deadline: only the endpoint's down time can end the run, never a long delay
    monkeypatch.setattr(dispatcher, "RESTART_BACKOFF_MAX_S", 1.0)
    with emulators(1, preset="kimi") as (server,):
        cfg = make_cfg([{"url": server.url, "name": "emu", "concurrency": 4}], dead_fleet_deadline_s=10)
        base = local_worker_factory(cfg, client_settings(cfg), cfg.api_key)

        def factory(endpoint, start_open):
            worker = base(endpoint, start_open)
            answer = worker.exchange

            async def dies_on_every_prompt(work, wait_s=0.5):
                if work:
                    raise RuntimeError("the actor's process died")
                return await answer(work, wait_s)

            worker.exchange = dies_on_every_prompt
            return worker

        items = [work_item(f"p{i}", f"Fact {i}?", cfg) for i in range(12)]
        fatal = None
        with caplog.at_level("INFO", logger="regen.dispatch"):
            try:
                run_local(cfg, items, time_limit_s=60, factory=factory)
            except RunFatal as exc:
                fatal = exc
    delays = restart_delays(caplog.records)
    assert [lost for lost, *_ in delays][:4] == [1, 2, 3, 4], \
        "the replacements count as lost in a row: none ran a prompt"
    assert_restarts_back_off(delays)  # 0, 0.5, 1, then the cap (1 where 2 would be)
    assert fatal is not None and "no healthy endpoint" in str(fatal), \
        "the endpoint, down since its first loss, never tripped the dead-fleet deadline"


# --- 6. all_turns: only failed attempts count -------------------------------------------------------------------
def write_conversations(path: Path, n: int, poison: str) -> None:
    """n conversations of 3 user turns; conversation 0's last turn carries the poison text."""
    lines = []
    for i in range(n):
        turns = []
        for k in range(3):
            text = f"Conversation {i}, question {k}: tell me about topic {i * 3 + k}."
            turns += [{"from": "human", "value": text + (f" {poison}" if (i, k) == (0, 2) else "")},
                      {"from": "gpt", "value": f"answer {k} of {i}"}]
        lines.append(orjson.dumps({"id": f"c{i}", "conversations": turns}))
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_all_turns_counts_only_failed_attempts_and_retries_elsewhere(tmp_path, ray_cluster):
    """Each server fails the third turn of conversation 0 once (503). Before the fix the two turns that had
    succeeded counted as attempts too: 2 + 1 reached max_attempts=3 at the first failure, terminal at once."""
    poison = "[503-once]"
    with emulators(2, preset="kimi", poison_text=poison, poison_fault="503", poison_times=1) as servers:
        write_conversations(tmp_path / "c.jsonl", 4, poison)
        config = write_config(tmp_path, endpoints_of(servers), [write_source(tmp_path, tmp_path / "c.jsonl",
                                                                             fmt="sharegpt")],
                              model=MODEL, mode="all_turns", max_attempts=3, attempts_per_endpoint=1,
                              sampling={"temperature": 0.0, "max_tokens": 8},
                              hedge_tail=False)  # a hedged copy on the idle server would be an attempt that works
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "out" / "t"
    assert not failures_of(run), failures_of(run)
    rows = rows_of(run)
    assert len(rows) == 12, "4 conversations x 3 turns"
    poisoned = [r for r in rows if r["n_turns"] == 3 and poison in r["messages"][-1]["content"]]
    assert len(poisoned) == 1 and poisoned[0]["attempts"] == 3, "two failed attempts, then the one that worked"
    assert {r["attempts"] for r in rows if r not in poisoned and r["prompt_id"] != poisoned[0]["prompt_id"]} == {1}


# --- 7. error events inside a stream ---------------------------------------------------------------------------
def sglang_stream_error(message: str, status: int, err_type: str) -> dict:
    """serving_base.create_streaming_error_response of SGLang 0.5.17, 0.5.18 and 0.5.23: {"error": ErrorResponse}."""
    return {"error": {"object": "error", "message": message, "type": err_type, "param": None, "code": status}}


@pytest.mark.parametrize("event, expected", [
    (sglang_stream_error("The input (300000 tokens) is longer than the model's context length (262144 tokens).",
                         400, "BAD_REQUEST"), TerminalForPrompt),
    (sglang_stream_error("Requested token count exceeds the model's maximum context length of 8 tokens.", 400,
                         "BadRequestError"), TerminalForPrompt),  # a ValueError after the stream started
    (sglang_stream_error("The model `x` does not exist.", 404, "NOT_FOUND"), EndpointFatal),
    (sglang_stream_error("Internal server error", 500, "INTERNAL_SERVER_ERROR"), Retryable),
    (sglang_stream_error("Request waiting timeout reached.", 503, "SERVICE_UNAVAILABLE"), Retryable),
    ({"error": {"message": "no code at all"}}, Retryable),
])
def test_stream_error_events_are_classified_by_their_code_and_message(event, expected):
    from pipeline.endpoints.classify import classify_stream_error

    error = classify_stream_error(event["error"], "e0")
    assert type(error) is expected and error.endpoint == "e0"
    with pytest.raises(expected):
        StreamAccumulator(endpoint="e0").add(event)


def test_the_emulator_sends_sglangs_stream_error_event():
    import urllib.request

    with emulators(1, preset="kimi", poison_text="[400]", poison_fault="400") as (bad,):
        request = urllib.request.Request(bad.url + "/v1/chat/completions", data=orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi [400]"}], "max_tokens": 20,
             "stream": True}), headers={"Content-Type": "application/json"})
        events = [line[6:] for line in urllib.request.urlopen(request, timeout=10).read().split(b"\n")
                  if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    assert orjson.loads(events[-2]) == sglang_stream_error("Invalid request (emulated fault).", 400, "BAD_REQUEST")


def test_a_400_inside_a_stream_is_a_failure_after_one_attempt(tmp_path, ray_cluster):
    """Before the fix the event became Retryable: the 400 was sent max_attempts times, each a failure of a
    healthy endpoint's breaker."""
    write_prompts(tmp_path / "p.jsonl", 12)
    with emulators(1, preset="kimi", poison_text="(#3)", poison_fault="400") as servers:
        config = write_config(tmp_path, endpoints_of(servers), [write_source(tmp_path, tmp_path / "p.jsonl")],
                              model=MODEL, stream=True, sampling={"temperature": 0.0, "max_tokens": 16})
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "out" / "t"
    failures = failures_of(run)
    assert len(failures) == 1 and failures[0]["attempts"] == 1
    assert failures[0]["message"] == "invalid request: Invalid request (emulated fault)."
    assert len(committed_ids(run)) == 11
    errors = status_of(run)["endpoints"]["emu-0"]["errors"]
    assert errors == {"terminal": 1}, errors


# --- 8. a poison prompt that drops the connection --------------------------------------------------------------
def test_a_prompt_that_drops_the_connection_is_terminal_after_the_bound(tmp_path, ray_cluster):
    """Every server drops the connection mid-answer on prompt #5. Before the fix that cost no attempt: the prompt
    went from endpoint to endpoint forever, opening their breakers, and the run never ended."""
    write_prompts(tmp_path / "p.jsonl", 20)
    with emulators(2, preset="kimi", poison_text="(#5)", poison_fault="reset") as servers:
        config = write_config(tmp_path, endpoints_of(servers), [write_source(tmp_path, tmp_path / "p.jsonl")],
                              model=MODEL, sampling={"temperature": 0.0, "max_tokens": 16}, dead_fleet_deadline_s=60)
        try:
            result = run_regen("generate", "--config", str(config), timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the run never ended: the poison prompt was retried forever")
        assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "out" / "t"
    failures = failures_of(run)
    assert len(failures) == 1 and "(#5)" in prompt_text(run, failures[0]["prompt_id"])
    assert failures[0]["message"].startswith("the server dropped the connection on this prompt 3 times")
    assert len(committed_ids(run)) == 19


# --- 13. smaller defects ---------------------------------------------------------------------------------------
def test_an_endpoint_unreachable_at_the_preflight_gets_no_work(tmp_path, ray_cluster):
    """Before the fix it started "healthy": it was sent work that failed until its breaker opened."""
    write_prompts(tmp_path / "p.jsonl", 30)
    with emulators(1, preset="kimi", tok_per_s=100) as servers:
        dead = {"url": f"http://127.0.0.1:{free_port()}", "concurrency": 8, "name": "dead"}
        config = write_config(tmp_path, endpoints_of(servers) + [dead],
                              [write_source(tmp_path, tmp_path / "p.jsonl")], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16})
        result = run_regen("generate", "--config", str(config))
        assert result.returncode == 0, result.stderr[-2000:]
    status = status_of(tmp_path / "out" / "t")
    assert status["endpoints"]["dead"]["state"] == "open"
    assert status["endpoints"]["dead"]["requests"] == 0 and status["requeued"] == 0, status
    assert len(committed_ids(tmp_path / "out" / "t")) == 30
