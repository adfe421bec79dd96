"""Supervision: no exception of any type ends a worker coroutine silently.

Exceptions of every kind (ones regen raises, and ones it never does: ValueError, KeyError, a stray CancelledError,
...) are injected at the client boundary (EndpointClient.chat), into the real Dispatcher and real EndpointWorkers
(in this process, no Ray) against real SGLang emulators. Whatever the plan, every prompt ends done or failed
exactly once, every injected exception comes back as an outcome for its prompt naming its type, and each run ends:
it completes, or it stops with RunFatal (every endpoint endpoint-fatal) and the resume finishes the rest.

The plans are a seeded enumeration: each exception type at three of the first calls; then random mixes of types. SystemExit and KeyboardInterrupt raised inside a worker (a library's
sys.exit()) are errors of the prompt too: the driver's signals never reach a worker, and asyncio would stop the
actor's event loop on them (before the fix the run hung).
"""
from __future__ import annotations

import asyncio
import errno
import random
from dataclasses import dataclass, field

import orjson
import pytest

from pipeline.core import errors
from pipeline.core.work import DONE, Outcome
from pipeline.dispatch.actors import client_settings, local_worker_factory
from pipeline.dispatch.transport import LocalTransport
from pipeline.endpoints.client import EndpointClient
from tests.helpers import emulators
from tests.local_dispatch import make_cfg, run_local, work_item

N_PROMPTS = 10


class NeverSeenBefore(Exception):
    """An exception type no part of regen knows."""


class LibrarysOwnBaseException(BaseException):
    """Some libraries derive their own signals from BaseException: asyncio would end a task on it silently."""


# Each entry makes a fresh exception. The taxonomy's own classes go through as they are; the rest become
# Unexpected (retryable), named by type.
CATALOGUE = {
    "ValueError": lambda: ValueError("a malformed error body"),
    "KeyError": lambda: KeyError("choices"),
    "IndexError": lambda: IndexError("list index out of range"),
    "TypeError": lambda: TypeError("'NoneType' object is not subscriptable"),
    "AttributeError": lambda: AttributeError("'str' object has no attribute 'get'"),
    "RuntimeError": lambda: RuntimeError("Event loop is closed"),
    "ZeroDivisionError": lambda: ZeroDivisionError("division by zero"),
    "RecursionError": lambda: RecursionError("maximum recursion depth exceeded"),
    "MemoryError": lambda: MemoryError(),
    "UnicodeDecodeError": lambda: UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
    "JSONDecodeError": lambda: orjson.JSONDecodeError("unexpected character", "{", 0),
    "OSError": lambda: OSError(errno.EIO, "Input/output error"),
    "ConnectionResetError": lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "TimeoutError": lambda: TimeoutError(),
    "CancelledError": lambda: asyncio.CancelledError(),  # a stray one: the worker's own task is not cancelled
    "NeverSeenBefore": lambda: NeverSeenBefore("whatever this is"),
    "LibrarysOwnBaseException": lambda: LibrarysOwnBaseException("not an Exception at all"),
    "SystemExit": lambda: SystemExit(3),  # a library's sys.exit(3)
    "KeyboardInterrupt": lambda: KeyboardInterrupt("raised by a library"),
    "Retryable": lambda: errors.Retryable("503 The request queue is full.", status=503),
    "EndpointDown": lambda: errors.EndpointDown("connection failed: refused"),
    "ConnectionDropped": lambda: errors.ConnectionDropped("connection failed: peer closed the connection"),
    "TerminalForPrompt": lambda: errors.TerminalForPrompt("invalid request: messages: field required", status=400),
    "EndpointFatal": lambda: errors.EndpointFatal("The model `x` does not exist.", status=404),
    "StorageError": lambda: errors.StorageError("cannot write data/part-x.parquet: no space left on device"),
}
POSITIONS = ("client",)


@dataclass
class Plan:
    """Which call at which position raises what: {position: {call number: exception name}}."""

    faults: dict[str, dict[int, str]]
    calls: dict[str, int] = field(default_factory=lambda: {p: 0 for p in POSITIONS})
    run: int = 1  # the harness counts the runs (a RunFatal stop, then the resume)
    injected: list[tuple[str, str, str, int]] = field(default_factory=list)  # (position, name, prompt text, run)

    def fire(self, position: str, prompt_text: str) -> None:
        self.calls[position] += 1
        name = self.faults.get(position, {}).get(self.calls[position])
        if name is not None:
            self.injected.append((position, name, prompt_text, self.run))
            raise CATALOGUE[name]()


@pytest.fixture(scope="module")
def servers():
    with emulators(2, preset="kimi") as running:
        yield running


@pytest.fixture
def inject(monkeypatch):
    """Install a plan at the client boundary; yields a setter."""
    holder: dict[str, Plan] = {}
    real_chat = EndpointClient.chat

    async def chat(self, messages, seed, tools=None):
        holder["plan"].fire("client", messages[-1]["content"])
        return await real_chat(self, messages, seed)

    monkeypatch.setattr(EndpointClient, "chat", chat)
    yield lambda plan: holder.__setitem__("plan", plan)


TEXT_OF = {f"p{i}": f"Supervised question {i}: name one fact about owls." for i in range(N_PROMPTS)}


class RecordingTransport(LocalTransport):
    """Every outcome an endpoint worker sent back, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[Outcome] = []

    def result(self, call):
        exchange = super().result(call)
        self.outcomes += exchange.outcomes
        return exchange


@dataclass
class Runs:
    final: dict[str, list[Outcome]]  # each prompt's final outcomes, over all runs
    seen: list[Outcome]  # every outcome a worker sent back
    count: int
    # Runs that stopped (RunFatal) or dropped an endpoint: outcomes still in such a worker's outbox are never
    # collected (the prompts go back to the queue, or stay pending for the resume).
    lossy: set[int]
    fatal: dict[int, str] = field(default_factory=dict)  # run number -> the RunFatal it stopped with


def run_until_complete(servers, plan: Plan) -> Runs:
    """Runs and resumes (as a user reruns the command) until nothing is pending."""
    cfg = make_cfg([{"url": s.url, "name": f"emu-{i}", "concurrency": 3} for i, s in enumerate(servers)],
                   attempts_per_endpoint=1, max_attempts=3, max_connection_drops=2, circuit_failures=4,
                   dead_fleet_deadline_s=15, hedge_tail=False, sampling={"temperature": 0.0, "max_tokens": 6})
    runs = Runs({pid: [] for pid in TEXT_OF}, [], 0, set())
    for number in range(1, 7):
        plan.run = runs.count = number
        pending = [work_item(pid, TEXT_OF[pid], cfg) for pid in TEXT_OF if not runs.final[pid]]
        transport, finished = RecordingTransport(), {}
        try:
            result = run_local(cfg, pending, time_limit_s=90, transport=transport,
                               finished=finished)
        except errors.RunFatal as exc:
            result = None
            runs.lossy.add(number)
            runs.fatal[number] = str(exc)
        runs.seen += transport.outcomes
        for pid, outcomes in finished.items():  # also what a stopped run finished before it stopped
            runs.final[pid] += [o for o, _ in outcomes]
        if result is not None:
            assert not result.stopped_at_limit, "the run hung: it ended only at the test's time limit"
            if result.dispatcher.fleet_changes:
                runs.lossy.add(number)
            if all(runs.final.values()):
                return runs
    raise AssertionError(f"still pending after {runs.count} runs: {[p for p, o in runs.final.items() if not o]}")


def check(plan: Plan, runs: Runs) -> None:
    kinds = {pid: [o.kind for o in outcomes] for pid, outcomes in runs.final.items()}
    assert all(len(k) == 1 for k in kinds.values()), f"each prompt ends exactly once: {kinds}"
    assert all(k[0] in (DONE, "terminal") for k in kinds.values()), kinds
    pid_of = {text: pid for pid, text in TEXT_OF.items()}
    for position, name, text, number in plan.injected:
        theirs = [o for o in runs.seen if o.prompt_id == pid_of.get(text) and o.kind != DONE]
        if name in TAXONOMY:  # the dispatcher may have rewritten a last failure: "attempts exhausted (3): ..."
            came_back = any(CATALOGUE[name]().message in o.message for o in theirs)
        else:
            came_back = any(o.message.startswith(name) or f": {name}" in o.message for o in theirs)
        assert came_back or number in runs.lossy, (position, name, [(o.kind, o.message) for o in theirs])


TAXONOMY = {"Retryable", "EndpointDown", "ConnectionDropped", "TerminalForPrompt", "EndpointFatal"}
ENUMERATED = [(name, position) for name in CATALOGUE for position in POSITIONS]


@pytest.mark.parametrize("name, position", ENUMERATED, ids=[f"{n}@{p}" for n, p in ENUMERATED])
def test_each_exception_type_at_each_position_becomes_an_outcome(servers, inject, name, position):
    plan = Plan({position: {1: name, 3: name, 4: name}})
    inject(plan)
    runs = run_until_complete(servers, plan)
    assert len(plan.injected) == 3, "all three faults were reached"
    check(plan, runs)


@pytest.mark.parametrize("seed", range(8))
def test_random_mixes_of_exceptions_never_lose_double_or_hang(servers, inject, seed):
    rng = random.Random(seed)
    names = sorted(CATALOGUE)
    faults = {position: {call: rng.choice(names) for call in range(1, 25) if rng.random() < 0.35}
              for position in POSITIONS}
    plan = Plan(faults)
    inject(plan)
    runs = run_until_complete(servers, plan)
    check(plan, runs)
    assert plan.injected


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=lambda e: e.__name__)
def test_an_interrupt_raised_inside_a_worker_comes_back_as_the_prompts_error(servers, stop):
    """A library raises SystemExit / KeyboardInterrupt inside a worker coroutine, on every request of one prompt
    and on the first request of another. Before the fix it propagated, asyncio stopped the workers' event loop,
    and the run waited until its time limit."""
    cfg = make_cfg([{"url": servers[0].url, "name": "emu", "concurrency": 2}], attempts_per_endpoint=1,
                   max_attempts=2, dead_fleet_deadline_s=5, hedge_tail=False)
    calls: dict[str, int] = {}
    real_chat = EndpointClient.chat

    async def chat(self, messages, seed, tools=None):
        text = messages[-1]["content"]
        calls[text] = calls.get(text, 0) + 1
        if text == "always" or (text == "once" and calls[text] == 1):
            raise CATALOGUE[stop.__name__]()
        return await real_chat(self, messages, seed)

    base = local_worker_factory(cfg, client_settings(cfg), cfg.api_key, backoff_initial_s=0.05)

    def factory(endpoint, start_open):
        worker = base(endpoint, start_open)
        worker.client.chat = chat.__get__(worker.client)
        return worker

    result = run_local(cfg, [work_item(p, p, cfg) for p in ("always", "once", "never")], time_limit_s=60,
                       factory=factory)
    assert not result.stopped_at_limit, "the run hung: only the test's time limit ended it"
    assert result.kinds() == {"always": ["terminal"], "once": [DONE], "never": [DONE]}
    assert result.finished["always"][0][0].message == f"attempts exhausted (2): {stop.__name__}" + \
        (": raised by a library" if stop is KeyboardInterrupt else ": 3")
