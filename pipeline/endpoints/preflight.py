"""Fleet preflight: before any prompt is sent, every endpoint is probed (probes.py) and the fleet is
checked as a whole: one model, one weight version.

A refusal names each endpoint and mismatch in words a user can act on (which flag to launch with). Endpoints
that do not answer while others are fine are warnings: they get work once they answer. With no endpoint
answering at all, the preflight waits with backoff up to `dead_fleet_deadline_s`, then stops non-zero
(the run stays resumable).
"""
from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from typing import Any, Callable

from ..core import exits
from ..core.config import RunConfig
from .capacity import capacity_line, far_below, shown_concurrency
from .client import ClientSettings, EndpointClient
from ..core.errors import ConfigError, PreflightError, RegenError
from .engines import OpenAIAdapter, SGLangAdapter
from .probes import PROBE_RID_PREFIX, EndpointReport, check_endpoint

__all__ = ["PROBE_RID_PREFIX", "EndpointReport", "check_endpoint", "engine_refusal", "fleet_deterministic", "fleet_engines",
           "fleet_notes",
           "fleet_problems", "pinned_weight_version",
           "preflight", "preflight_async", "probe_fleet", "run_preflight_command"]

log = logging.getLogger("regen.fleet")

# --- across endpoints ----------------------------------------------------------------------------------
def _groups(pairs: list[tuple[str, str]]) -> str:
    by_value: dict[str, list[str]] = {}
    for label, value in pairs:
        by_value.setdefault(value, []).append(label)
    return "; ".join(f"{', '.join(labels)}: {value}" for value, labels in by_value.items())


def fleet_problems(reports: list[EndpointReport], cfg: RunConfig) -> list[str]:
    """Cross-endpoint refusals among the endpoints that answered: one engine, one model, one weight version."""
    live = [r for r in reports if r.reachable or r.models]
    out: list[str] = []
    engines = [(r.label, r.engine.engine) for r in live if r.engine is not None]
    if len({v for _, v in engines}) > 1:
        out.append(f"endpoints run different inference engines ({_groups(engines)}): one run must come from one "
                   "engine (their token ids, reasoning split and sampling differ); run each engine's fleet as its "
                   "own run")
    served = [(r.label, ", ".join(sorted(r.models)) or "no model") for r in live]
    if len({v for _, v in served}) > 1:
        out.append(f"endpoints serve different models ({_groups(served)}): every endpoint must serve "
                   f"{cfg.model!r}")
    paths = [(r.label, r.model_path) for r in live if r.model_path and cfg.model in r.models]  # another name: above
    if len({v for _, v in paths}) > 1:
        out.append(f"endpoints serve different models under the name {cfg.model!r} (model_path {_groups(paths)}): "
                   "one run must come from one checkpoint")
    versions = [(r.label, r.weight_version) for r in live if r.weight_version]
    if len({v for _, v in versions}) > 1:
        out.append(f"endpoints run different weight versions ({_groups(versions)}): one run must not mix "
                   "them; update the stale servers or leave them out")
    return out


def engine_refusal(engine: OpenAIAdapter | None, run_engines: tuple[tuple[str, str | None], ...]) -> str | None:
    """Why an endpoint running `engine` may not join a run whose preflight admitted `run_engines` ((engine,
    version) pairs); None: it may. Another engine, or a version of it the run does not name, would mix the run
    and leave run.json's `engines` untrue."""
    if engine is None or not run_engines:
        return None
    admitted = ", ".join(f"{name} {version}" if version else f"{name} (version unknown)" for name, version in run_engines)
    if engine.engine not in {name for name, _ in run_engines}:
        return (f"it now runs {engine.describe()}, not the run's engine ({admitted}): one run must come from one "
                "engine, so it stays out of this run")
    if (engine.engine, engine.version) not in run_engines:
        return (f"it now runs {engine.describe()}, a version the run's preflight did not admit ({admitted}): it "
                "gets no work while it does; rerun to resume with it (the preflight records its version)")
    return None


# Who fills an unset sampling value from the model's generation_config, by engine.
_DEFAULTS_APPLIED_BY = {"sglang": "SGLang's chat route (its /generate applies none)",
                        "vllm": "vLLM (--generation-config auto, its default)"}


def fleet_notes(reports: list[EndpointReport], cfg: RunConfig) -> list[str]:
    """What the user must know about the whole fleet, said once: the sampling values regen sends in place of
    the server's defaults, seeds that reproduce nothing, and weight pinning in stream mode."""
    live = [r for r in reports if r.reachable]
    sent = ", ".join(f"{k}={v}" for k, v in {"temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                                                **cfg.sampling.explicit()}.items())
    who = sorted({_DEFAULTS_APPLIED_BY.get(r.engine.engine, "the server") for r in live if r.engine is not None})
    notes = [f"every request sends {sent} explicitly: they override the model's generation_config defaults "
             f"that {' and '.join(who or ['the server'])} would otherwise apply"]
    for r in live:
        if r.preferred_sampling:
            notes.append(f"{r.label} was launched with preferred_sampling_params {r.preferred_sampling}: "
                         "regen's explicit values override them")
    warnings = {w for r in live if isinstance(r.engine, SGLangAdapter)
                for w in [r.engine.seed_warning(cfg.sampling.temperature)] if w}
    notes += sorted(warnings)
    if cfg.stream and any(isinstance(r.engine, SGLangAdapter) for r in live):
        notes.append("stream: true: SGLang's stream chunks carry no weight version, so weight pinning is off for "
                     "the answers (the preflight and every readmission still check the version the server reports)")
    return notes


def fleet_deterministic(reports: list[EndpointReport]) -> bool | None:
    """True only if every endpoint that may get work runs --enable-deterministic-inference; None: unknown."""
    flags = [r.deterministic for r in reports if r.ok]
    if not flags or any(f is False for f in flags):
        return False if flags else None
    return True if all(flags) else None


def fleet_engines(reports: list[EndpointReport]) -> list[dict[str, str | None]]:
    """The engines (and versions) of the endpoints that may get work, once each: [{"engine", "version"}]."""
    seen: list[dict[str, str | None]] = []
    for r in reports:
        if r.ok and r.engine is not None:
            entry = {"engine": r.engine.engine, "version": r.engine.version}
            if entry not in seen:
                seen.append(entry)
    return seen


def pinned_weight_version(reports: list[EndpointReport]) -> str | None:
    """The single weight version the healthy endpoints report (None if none reports one)."""
    versions = {r.weight_version for r in reports if r.ok and r.weight_version}
    return versions.pop() if len(versions) == 1 else None


def refusal_text(reports: list[EndpointReport], fleet: list[str]) -> str:
    lines = [f"  {r.label}: {p}" for r in reports for p in r.problems] + [f"  fleet: {p}" for p in fleet]
    return "fleet preflight refused the run:\n" + "\n".join(lines)


# --- the whole fleet ------------------------------------------------------------------------------------
def _settings(cfg: RunConfig) -> ClientSettings:
    return ClientSettings(model=cfg.model, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                          max_tokens=cfg.sampling.max_tokens, chat_template_kwargs=cfg.template_kwargs(),
                          tool_choice=cfg.tool_choice, **cfg.sampling.explicit())


async def probe_fleet(cfg: RunConfig, api_keys: dict[str, str | None], **options: Any) -> list[EndpointReport]:
    """One round: every endpoint checked concurrently. `options`: check_endpoint's keywords."""
    settings = _settings(cfg)
    clients = [EndpointClient(e.url, e.label, settings, api_keys.get(e.label)) for e in cfg.all_endpoints()]
    try:
        return list(await asyncio.gather(*(check_endpoint(c, cfg, **options) for c in clients)))
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def _refuse(message: str, reports: list[EndpointReport], fleet: list[str]) -> PreflightError:
    error = PreflightError(message)
    error.reports, error.fleet_problems = reports, fleet  # for the table of `regen preflight`
    return error


async def preflight_async(cfg: RunConfig, api_keys: dict[str, str | None], announce: bool = True,
                          start_with_passing: bool = False, **timeouts: Any) -> list[EndpointReport]:
    """`preflight` for callers already inside an event loop. `announce`: log the fleet notes and each endpoint's
    warnings once it passes (False: the caller prints them itself, as `regen preflight` does in its table).
    `start_with_passing`: an endpoint with problems of its own is held out (named loudly) instead of refusing the
    run, as long as another passes; the fleet checks then apply to the others."""
    deadline = time.monotonic() + cfg.dead_fleet_deadline_s
    delay = 1.0
    while True:
        reports = await probe_fleet(cfg, api_keys, **timeouts)
        held = [r for r in reports if r.problems] if start_with_passing else []
        rest = [r for r in reports if not (start_with_passing and r.problems)]
        fleet = fleet_problems(rest, cfg)
        if fleet or any(r.problems for r in rest):
            raise _refuse(refusal_text(reports, fleet) + _passing_hint(reports, cfg), reports, fleet)
        if held and not any(r.reachable for r in rest):
            raise _refuse(refusal_text(reports, []) + "\nno endpoint passes it, so --start-with-passing has none to "
                          "start with", reports, fleet)
        if any(r.reachable for r in rest):
            if announce:
                announce_reports(reports, cfg, start_with_passing)
            return reports
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _refuse(
                "no endpoint is reachable:\n" + "\n".join(f"  {r.label}: {r.down_reason}" for r in reports)
                + f"\nwaited {cfg.dead_fleet_deadline_s:.0f}s (dead_fleet_deadline_s); start the servers and "
                "rerun to resume", reports, fleet)
        pause = min(delay * random.uniform(0.8, 1.2), remaining)
        log.warning("no endpoint is reachable yet (%s); probing again in %.1fs, giving up in %.0fs",
                    "; ".join(f"{r.label}: {r.down_reason}" for r in reports), pause, remaining)
        await asyncio.sleep(pause)
        delay = min(delay * 2, 30.0)


def announce_reports(reports: list[EndpointReport], cfg: RunConfig, start_with_passing: bool = False) -> None:
    """Log what a passed preflight found: the endpoints held out, the fleet notes, each endpoint's warnings."""
    held = [r for r in reports if r.problems] if start_with_passing else []
    held_labels = {r.label for r in held}
    for r in held:
        log.error("endpoint %s failed the preflight: %s. --start-with-passing: the run starts without it; it "
                  "joins once it passes the preflight (checked again with backoff)", r.label, "; ".join(r.problems))
    if held:
        log.warning("starting with %d of %d endpoints (--start-with-passing); held out: %s",
                    len(reports) - len(held), len(reports), ", ".join(r.label for r in held))
    for note in fleet_notes(reports, cfg):
        log.warning("fleet: %s", note)
    for r in reports:
        if r.label in held_labels:
            continue
        if not r.reachable:
            log.warning("endpoint %s is unreachable (%s); it gets work once it answers and passes "
                        "this preflight", r.label, r.down_reason)
        for w in r.warnings:
            log.warning("endpoint %s: %s", r.label, w)
        announce_capacity(r, cfg)


def announce_capacity(r: EndpointReport, cfg: RunConfig) -> None:
    """The capacity line: how the configured concurrency compares with the server's batch (capacity.py)."""
    said = capacity_said(r, cfg)
    if said is not None:
        log.log(logging.WARNING if said[0] else logging.INFO, "%s", said[1])


def capacity_said(r: EndpointReport, cfg: RunConfig) -> tuple[bool, str] | None:
    """(a warning, the line) of an endpoint whose server's limits were read; a warning where the concurrency is far
    below the server's batch."""
    e = next((e for e in cfg.all_endpoints() if e.label == r.label), None)
    if e is None or r.limits is None or not r.reachable:
        return None
    concurrency = shown_concurrency(e, r.limits)
    line = f"endpoint {r.label}: {capacity_line(concurrency, r.limits)}"
    if far_below(concurrency, r.limits):
        return True, f"{line}; raise `concurrency` (or set it to auto) to use the server's batch"
    return False, line


def _passing_hint(reports: list[EndpointReport], cfg: RunConfig) -> str:
    """The way on when only some endpoints are misconfigured and the others agree with each other."""
    passing = [r for r in reports if r.ok]
    failing = [r for r in reports if r.problems]
    if not passing or not failing or fleet_problems(passing, cfg):
        return ""
    return (f"\n{len(passing)} of {len(reports)} endpoints pass: `regen generate --start-with-passing` starts the run "
            f"with them, and the {len(failing)} refused above join{'s' if len(failing) == 1 else ''} once fixed (each "
            "is checked again with this preflight)")


def preflight(cfg: RunConfig, api_keys: dict[str, str | None], announce: bool = True,
              start_with_passing: bool = False, **timeouts: Any) -> list[EndpointReport]:
    """Check the fleet before any prompt is sent.

    Raises PreflightError naming each endpoint and mismatch; waits with backoff up to
    cfg.dead_fleet_deadline_s while no endpoint answers. Unreachable endpoints among working ones are
    warnings (logged, and in the reports); so are endpoints with problems under `start_with_passing` (their
    reports keep the problems). `timeouts`: info_timeout_s, probe_timeout_s, and `tools=True` for a prompt set with
    tools, `images=True` for one with images (check_endpoint's keywords)."""
    return asyncio.run(preflight_async(cfg, api_keys, announce, start_with_passing, **timeouts))


# --- `regen preflight CONFIG` ---------------------------------------------------------------------------
def run_preflight_command(config_path: str, needs_of: Callable[[RunConfig], Any] | None = None) -> int:
    """Load the config, check secrets, run the preflight and print the table. 0: passed; 1: refused; 2: bad config.

    `needs_of(cfg)`: what the prompt set needs of the fleet (dispatch/prompt_needs.py PromptNeeds: `tools`,
    `images`, `line()`, `context_warning`), judged as `regen generate` judges it; None: a text prompt set is assumed.
    A config with `local_fleet` gets its llama.cpp servers started for the check (a port in use is refused)."""
    from ..core.config import load_config
    from .preflight_table import render_table

    try:
        cfg = load_config(config_path)
        cfg.check_secrets()
        api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
        needs = needs_of(cfg) if needs_of is not None else None
    except RegenError as exc:  # a bad config, or a source that cannot be read
        print(f"regen: error: {exc}", file=sys.stderr)
        return exits.for_error(exc)
    if needs is not None:
        print(needs.line())
    wants = {"tools": needs.tools, "images": needs.images} if needs is not None else {}
    try:
        if cfg.local_fleet is not None:
            reports = _with_local_fleet(cfg, api_keys, **wants)
        else:
            reports = preflight(cfg, api_keys, announce=False, **wants)  # the table and the lines below say it all
    except PreflightError as exc:
        reports = getattr(exc, "reports", None)
        if reports:
            _context_warnings(reports, cfg, needs)
            print(render_table(reports, cfg, getattr(exc, "fleet_problems", [])))
            _print_capacity_warnings(reports, cfg)
        print(f"regen: error: {exc}", file=sys.stderr)
        return exits.FAILED.code
    except ConfigError as exc:
        print(f"regen: error: {exc}", file=sys.stderr)
        return exits.CONFIG.code
    except Exception as exc:  # noqa: BLE001 - e.g. a local fleet that will not start (RunFatal)
        print(f"regen: error: {exc}", file=sys.stderr)
        return exits.FAILED.code
    _context_warnings(reports, cfg, needs)
    print(render_table(reports, cfg, []))
    for note in fleet_notes(reports, cfg):
        print(f"  fleet: {note}")
    _print_capacity_warnings(reports, cfg)
    ready = sum(r.ok for r in reports)
    print(f"preflight passed: {ready} of {len(reports)} endpoints ready for {cfg.model}")
    return exits.OK.code


def _print_capacity_warnings(reports: list[EndpointReport], cfg: RunConfig) -> None:
    for warning, line in filter(None, (capacity_said(r, cfg) for r in reports)):
        if warning:  # the table's batch column has the rest
            print(f"  {line}")


def _context_warnings(reports: list[EndpointReport], cfg: RunConfig, needs: Any) -> None:
    """A server whose context cannot hold the longest prompt and max_tokens: warned (those prompts fail there)."""
    for r in reports if needs is not None else []:
        warning = needs.context_warning(r.context, cfg.sampling.max_tokens)
        if warning:
            r.warnings.append(warning)


def _with_local_fleet(cfg: RunConfig, api_keys: dict[str, str | None], **wants: bool) -> list[EndpointReport]:
    """The servers' logs go to a temporary directory, kept (and named in the error) if a server fails to start."""
    import shutil
    import tempfile
    from pathlib import Path

    from ..core.errors import RunFatal
    from .localfleet import LocalFleetProcesses

    logs = Path(tempfile.mkdtemp(prefix="regen-preflight-"))
    try:
        with LocalFleetProcesses(cfg.local_fleet, logs):
            reports = preflight(cfg, api_keys, announce=False, **wants)
    except RunFatal:
        if not any(logs.iterdir()):  # e.g. a port in use: nothing started, nothing to keep
            shutil.rmtree(logs, ignore_errors=True)
        raise  # the message names the log, which stays
    except BaseException:
        shutil.rmtree(logs, ignore_errors=True)
        raise
    shutil.rmtree(logs, ignore_errors=True)
    return reports
