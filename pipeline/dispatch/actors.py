"""The endpoint actors of a run: the settings every request carries, and where each actor is placed.

An actor is started empty (`RayEndpointWorker`: its process up and regen's modules imported), and `begin` builds
its EndpointWorker once the preflight has settled the settings. So a run can start the first actors early, while it
reads the ledger and probes the fleet (startup.py), and nothing reaches an endpoint before `begin`."""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
from typing import TYPE_CHECKING, Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..core.config import Endpoint, RunConfig

if TYPE_CHECKING:
    from ..endpoints.client import ClientSettings
    from .worker import EndpointWorker

ACTOR_NAMESPACE = "regen"


def client_settings(cfg: RunConfig, weight_version: str | None = None,
                    engines: dict | None = None, run_engines: list[dict] | None = None,
                    tools: bool = False, images: bool = False) -> ClientSettings:
    """`engines`: each endpoint's engine adapter by label, as the preflight identified it; `run_engines`: the
    run's engines ([{"engine", "version"}], run.json), which a readmitted endpoint must run."""
    from ..endpoints.client import ClientSettings

    return ClientSettings(
        model=cfg.model,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
        chat_template_kwargs=cfg.template_kwargs(),
        timeout_s=cfg.request_timeout(),
        return_token_ids=cfg.return_token_ids,
        stream=cfg.stream,
        stall_timeout_s=cfg.stall_timeout_s,
        expected_weight_version=weight_version,
        **cfg.sampling.explicit(),
        engines=dict(engines or {}),
        run_engines=tuple((e["engine"], e.get("version")) for e in run_engines or [] if e.get("engine")),
        tool_choice=cfg.tool_choice,
        needs_tool_calls=tools,
        needs_images=images,
    )


class RayEndpointWorker:
    """The Ray actor of one endpoint: empty until `begin` builds its EndpointWorker with the run's settings (an
    `exchange` that comes first waits for it). It imports the worker's modules as it starts, so a started actor has
    paid them; its own module does not, so that the driver, which only starts actors, never imports the OpenAI SDK
    or aiohttp for them (0.5 s of CPU, seconds on a loaded machine, before the first actor could be asked for)."""

    def __init__(self) -> None:
        from ..endpoints.client import warm_up
        from . import worker  # noqa: F401 - imported now, not on the first `begin`

        self.worker: EndpointWorker | None = None
        self.failed: Exception | None = None
        self.begun = asyncio.Event()
        warm_up()

    async def ping(self) -> bool:
        return True

    async def begin(self, *args: Any, **kwargs: Any) -> None:
        from .worker import EndpointWorker

        try:
            self.worker = EndpointWorker(*args, **kwargs)
        except Exception as exc:  # the driver hears of it at its exchange, as of an actor that failed to start
            self.failed = exc
        self.begun.set()

    async def exchange(self, work: list, wait_s: float = 0.5):
        await self.begun.wait()
        if self.worker is None:
            raise RuntimeError(f"the endpoint worker did not start: {self.failed!r}")
        return await self.worker.exchange(work, wait_s)


@functools.cache
def _remote_class():
    return ray.remote(RayEndpointWorker)


def start_actor(cfg: RunConfig, e: Endpoint, n: int) -> ray.actor.ActorHandle:
    """An empty actor for endpoint `e` (the `n`th of this driver), placed as make_actor_factory says."""
    # Named, so an operator (or a test) can find the actor of an endpoint in the cluster.
    name = f"{cfg.run_name}:{os.getpid()}:{e.label}:{n}"
    if e.ray_resources or e.ray_labels:
        placement = {"resources": dict(e.ray_resources), "label_selector": dict(e.ray_labels)}
    else:
        nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[n % len(nodes)], soft=False)}
    return _remote_class().options(
        num_cpus=cfg.ray.actor_num_cpus, max_concurrency=4, max_restarts=0, name=name, namespace=ACTOR_NAMESPACE,
        **placement).remote()


def make_actor_factory(cfg: RunConfig, settings: ClientSettings, api_key: Callable[[Endpoint], str | None],
                       early: Any = None, run_uri: str | None = None):
    """`early`: the actors started before the preflight (startup.EarlyActors); an endpoint's first actor is its
    early one when there is one. `run_uri`: the run directory (local path or object-store URI), where the actors
    read the run's copied images (every node reaches it, as capture's actors reach RUN/capture).

    Actors are spread round-robin over the cluster's live nodes (Ray's SPREAD leaves zero-CPU actors on
    one node); an endpoint may pin its actor instead through Ray resources (e.g. `{"node:10.0.0.7": 0.01}`,
    or a custom resource given to `ray start --resources`) or node labels (`ray start --labels rack=b`).
    A replacement actor goes to a node still alive."""
    generation = itertools.count(early.count if early is not None else 0)

    def factory(e: Endpoint, start_open: bool) -> ray.actor.ActorHandle:
        handle = early.take(e) if early is not None else None
        if handle is None:
            handle = start_actor(cfg, e, next(generation))
        handle.begin.remote(
            e.url, e.label, e.concurrency, settings, api_key(e), cfg.mode, cfg.attempts_per_endpoint,
            cfg.circuit_failures, readmission=cfg, start_open=start_open, concurrency_cap=e.concurrency_cap,
            auto_by_default=e.auto_by_default, tool_reasoning_history=cfg.tool_reasoning_history,
            tool_result_match=cfg.tool_result_match,
            run_uri=run_uri, images_send_as=cfg.images.send_as,
        )
        return handle

    return factory


def local_worker_factory(cfg: RunConfig, settings: ClientSettings, api_key: Callable[[Endpoint], str | None],
                         **worker_options) -> Callable[[Endpoint, bool], EndpointWorker]:
    """EndpointWorkers in this process (for LocalTransport), built with the arguments the Ray actors get (`run_uri`
    among `worker_options`)."""
    from .worker import EndpointWorker

    def factory(e: Endpoint, start_open: bool) -> EndpointWorker:
        return EndpointWorker(e.url, e.label, e.concurrency, settings, api_key(e), cfg.mode, cfg.attempts_per_endpoint,
                              cfg.circuit_failures, readmission=cfg, start_open=start_open,
                              concurrency_cap=e.concurrency_cap, auto_by_default=e.auto_by_default,
                              tool_reasoning_history=cfg.tool_reasoning_history,
                              tool_result_match=cfg.tool_result_match, images_send_as=cfg.images.send_as,
                              **worker_options)

    return factory
