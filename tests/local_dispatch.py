"""The real Dispatcher and real EndpointWorkers in this process (LocalTransport: no Ray), against real servers.
For tests that must reach narrow windows of dispatch: a hedged copy failing, a torn endpoints file, injected
exceptions of any type."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from pipeline.core.config import RunConfig
from pipeline.core.work import Outcome, WorkItem, affinity_key
from pipeline.dispatch.actors import client_settings, local_worker_factory
from pipeline.dispatch.dispatcher import Dispatcher
from pipeline.dispatch.transport import LocalTransport

MODEL = "moonshotai/Kimi-K2.5"


def make_cfg(endpoints: list[dict], **overrides: Any) -> RunConfig:
    raw = {"run_name": "local", "model": MODEL, "sources": [{"spec": "unused.yaml"}], "endpoints": endpoints,
           "sampling": {"temperature": 0.0, "max_tokens": 16}, "dead_fleet_deadline_s": 20}
    raw.update(overrides)
    return RunConfig.model_validate(raw)


def work_item(prompt_id: str, text: str, cfg: RunConfig, seed: int | None = None) -> WorkItem:
    messages = [{"role": "user", "content": text}]
    return WorkItem(prompt_id, orjson.dumps(messages), seed, affinity_key(messages, cfg.prefix_affinity_chars))


@dataclass
class LocalRun:
    """What a run's driver would have committed: every final outcome, by prompt, with its attempts."""

    dispatcher: Dispatcher
    finished: dict[str, list[tuple[Outcome, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    seconds: float = 0.0
    stopped_at_limit: bool = False  # the test's time limit stopped it (a hang), not the run's own end

    def kinds(self) -> dict[str, list[str]]:
        return {pid: [o.kind for o, _ in outs] for pid, outs in self.finished.items()}


def run_local(cfg: RunConfig, items: list[WorkItem], time_limit_s: float = 60.0,
              fleet_watch: Callable | None = None, unreachable: set[str] = frozenset(),
              factory: Callable | None = None, transport: LocalTransport | None = None,
              finished: dict | None = None, probed: set[str] | None = None, **worker_options: Any) -> LocalRun:
    """Dispatch `items` until every one has a final outcome, or time_limit_s (then the run stops, as on SIGINT, and
    `stopped_at_limit` says so: a safety net, which a test asserts was not what ended the run).
    Raises what the dispatcher raises (RunFatal): `finished`, if given, still holds what was finished before.
    `LocalRun.seconds` is the wall time."""
    worker_options = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, **worker_options}
    factory = factory or local_worker_factory(cfg, client_settings(cfg), cfg.api_key, **worker_options)
    transport = transport or LocalTransport()
    started = time.monotonic()
    result: LocalRun | None = None

    committed = collections.defaultdict(list) if finished is None else finished

    def on_outcome(outcome: Outcome, attempts: int) -> None:
        committed.setdefault(outcome.prompt_id, []).append((outcome, attempts))

    def at_limit() -> bool:
        if time.monotonic() - started > time_limit_s:
            result.stopped_at_limit = True
        return result.stopped_at_limit

    dispatcher = Dispatcher(cfg, items, on_outcome, lambda _status: None, at_limit, factory, fleet_watch=fleet_watch,
                            unreachable=unreachable, transport=transport, probed=probed)
    result = LocalRun(dispatcher, committed)
    try:
        dispatcher.run()
    finally:
        dispatcher.shutdown()
        transport.close()
        result.seconds = time.monotonic() - started
    return result
