"""Fleet preflight: before any prompt is sent, every endpoint is asked what it serves.

An endpoint that answers but serves another model refuses the run, naming the endpoint. Endpoints
that do not answer are reported; the run waits for at least one (with backoff) up to the dead-fleet
deadline, then stops non-zero, still resumable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from .config import RunConfig
from .endpoints import EndpointClient
from .errors import EndpointDown, PreflightError, RequestError

log = logging.getLogger("regen.fleet")


@dataclass
class EndpointReport:
    label: str
    reachable: bool
    models: list[str]
    problem: str = ""


async def probe(client: EndpointClient, model: str) -> EndpointReport:
    try:
        models = await client.served_models()
    except EndpointDown as exc:
        return EndpointReport(client.label, False, [], f"unreachable: {exc.message}")
    except RequestError as exc:
        return EndpointReport(client.label, True, [], f"/v1/models failed: {exc.message}")
    problem = "" if model in models else f"serves {models or 'no model'}, not the configured model {model!r}"
    return EndpointReport(client.label, True, models, problem)


async def _probe_all(cfg: RunConfig, api_keys: dict[str, str | None]) -> list[EndpointReport]:
    from .dispatch import client_settings

    settings = client_settings(cfg)
    clients = [EndpointClient(e.url, e.label, settings, api_keys.get(e.label)) for e in cfg.all_endpoints()]
    try:
        return list(await asyncio.gather(*(probe(c, cfg.model) for c in clients)))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def preflight(cfg: RunConfig, api_keys: dict[str, str | None]) -> list[EndpointReport]:
    """Probe the fleet; wait for a reachable endpoint up to the dead-fleet deadline."""
    deadline = time.monotonic() + cfg.dead_fleet_deadline_s
    delay = 1.0
    while True:
        reports = asyncio.run(_probe_all(cfg, api_keys))
        wrong = [r for r in reports if r.reachable and r.problem]
        if wrong:
            raise PreflightError(
                "fleet preflight refused the run:\n" + "\n".join(f"  {r.label}: {r.problem}" for r in wrong)
            )
        if any(r.reachable for r in reports):
            for r in reports:
                if not r.reachable:
                    log.warning("endpoint %s is %s; it gets work once it answers", r.label, r.problem)
            return reports
        if time.monotonic() + delay > deadline:
            raise PreflightError(
                "no endpoint is reachable:\n" + "\n".join(f"  {r.label}: {r.problem}" for r in reports)
                + f"\nwaited {cfg.dead_fleet_deadline_s:.0f}s (dead_fleet_deadline_s); rerun to resume"
            )
        log.warning("no endpoint reachable yet; retrying in %.0fs", delay)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)
