"""Fleet preflight: before any prompt is sent, every endpoint shows what it serves and how it was launched.

Per endpoint (all endpoints concurrently, every probe with a short timeout):
  1. `/v1/models` (served ids, context), `/get_model_info` and `/get_server_info` (SGLang only: a 404 there
     means "not SGLang", e.g. the local llama.cpp fleet, and the checks that need them are skipped);
  2. one tiny chat generation with the run's chat_template_kwargs: generation works (a /health 200 can lie),
     and when thinking is requested the reasoning is split out (a reasoning parser is running);
  3. with hidden states: `/generate` with `return_hidden_states` on a short probe, twice. The vector width must
     equal `hidden_states.expected_width` (7168 instead of 21504 is EAGLE instead of EAGLE3), and the prefill
     rows must cover the whole prompt both times (a shortfall the second time is the radix cache).
Across the fleet: one model, one weight version.

A refusal names each endpoint and mismatch in words a user can act on (which flag to launch with). Endpoints
that do not answer while others are fine are warnings: they get work once they answer. With no endpoint
answering at all, the preflight waits with backoff up to `dead_fleet_deadline_s`, then stops non-zero
(the run stays resumable).

Public API:
    preflight(cfg, api_keys) -> list[EndpointReport]          raises PreflightError (with .reports)
    preflight_async(cfg, api_keys) -> list[EndpointReport]     the same, inside a running event loop
    check_endpoint(client, cfg) -> EndpointReport              one endpoint, all checks (circuit-breaker re-admission)
    fleet_problems(reports, cfg) -> list[str]                  cross-endpoint checks (pure)
    pinned_weight_version(reports) -> str | None               the fleet's weight version, to pin for the run
    run_preflight_command(config_path) -> int                  `regen preflight CONFIG`
"""
from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .config import RunConfig
from .endpoints import ClientSettings, EndpointClient, _error_message, classify
from .errors import ConfigError, EndpointDown, EndpointFatal, PreflightError, Retryable

log = logging.getLogger("regen.fleet")

INFO_TIMEOUT_S = 5.0  # each information endpoint
PROBE_TIMEOUT_S = 30.0  # each tiny generation (8 chat tokens, 4 /generate tokens)
CHAT_PROBE_TOKENS = 8
HIDDEN_PROBE_TOKENS = 4
KIMI_LAYER_WIDTH = 7168
PROBE_RID_PREFIX = "regen-preflight-"  # probes are told apart from prompts in the servers' logs


def probe_rid() -> str:
    return PROBE_RID_PREFIX + uuid.uuid4().hex


PROBE_MESSAGES = [{"role": "user", "content": "Reply with the single word: ready."}]


@dataclass
class EndpointReport:
    """What one endpoint serves and how it was launched, with what is wrong (problems refuse the run)."""

    label: str
    url: str = ""
    reachable: bool = False  # answered /v1/models and generated; False: down, starting, or hung
    models: list[str] = field(default_factory=list)  # served model ids (/v1/models)
    model_path: str | None = None  # /get_model_info (SGLang)
    weight_version: str | None = None
    context: int | None = None  # tokens: /v1/models max_model_len, else /get_server_info context_length
    reasoning_parser: str | None = None  # meaningful only when `sglang` is True
    hidden_width: int | None = None  # width of the vectors /generate returned (None: not probed)
    radix_cache: bool | None = None  # True: on (bad for hidden states); None: unknown
    sglang_version: str | None = None
    sglang: bool | None = None  # True: SGLang info endpoints answer; False: 404 (e.g. llama.cpp); None: unknown
    speculative_algorithm: str | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    down_reason: str = ""  # why it is unreachable

    @property
    def ok(self) -> bool:
        """Fit to get work: answering, generating, and nothing wrong."""
        return self.reachable and not self.problems

    @property
    def status(self) -> str:
        if not self.reachable and not self.problems:
            return "unreachable"
        return "REFUSED" if self.problems else "ok"


# --- one endpoint -------------------------------------------------------------------------------------
async def _get(client: EndpointClient, path: str, timeout_s: float) -> tuple[int, Any] | EndpointDown:
    try:
        return await client.get_json(path, timeout_s=timeout_s)
    except EndpointDown as exc:
        return exc


def _context_of(models_body: dict, model: str) -> int | None:
    """max_model_len (SGLang, vLLM) or meta.n_ctx (llama.cpp) of the configured model's entry."""
    entries = [m for m in models_body.get("data", []) if isinstance(m, dict)]
    entries.sort(key=lambda m: m.get("id") != model)  # the configured model's entry first
    for entry in entries:
        for value in (entry.get("max_model_len"), (entry.get("meta") or {}).get("n_ctx")):
            if isinstance(value, int) and value > 0:
                return value
    return None


class _Findings:
    """Problems keyed by kind, so two pieces of evidence of one fault (flag read from /get_server_info, and
    the probe's behaviour) give one message with both."""

    def __init__(self) -> None:
        self.evidence: dict[str, list[str]] = {}
        self.other: list[str] = []

    def add(self, kind: str, evidence: str) -> None:
        self.evidence.setdefault(kind, []).append(evidence)


async def check_endpoint(client: EndpointClient, cfg: RunConfig, *, info_timeout_s: float = INFO_TIMEOUT_S,
                         probe_timeout_s: float = PROBE_TIMEOUT_S) -> EndpointReport:
    """Every check of one endpoint. Never raises for the endpoint's faults: they are in the report.

    `report.ok` says whether the endpoint may get work; `report.reachable` False means it did not answer
    (or did not generate) and may come back; `report.problems` non-empty means it is misconfigured."""
    report = EndpointReport(label=client.label, url=client.url)
    models_r, minfo_r, sinfo_r = await asyncio.gather(
        _get(client, "/v1/models", info_timeout_s),
        _get(client, "/get_model_info", info_timeout_s),
        _get(client, "/get_server_info", info_timeout_s),
    )
    # 1. /v1/models: is anything there?
    if isinstance(models_r, EndpointDown):
        report.down_reason = f"no answer ({models_r.message})"
        return report
    status, body = models_r
    if status == 503:
        report.down_reason = "not ready: /v1/models answered 503 (starting or overloaded)"
        return report
    report.reachable = True  # it answers; the generation probes below may still find it hung
    if status in (401, 403):
        report.problems.append(f"refuses our requests ({status} on /v1/models): check the API key "
                               "(the endpoint's api_key_env)")
        return report
    if status != 200 or not isinstance(body, dict):
        report.problems.append(f"/v1/models answered {status}: {_error_message(body, 'no readable body')}")
        return report
    report.models = [str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict)]
    report.context = _context_of(body, cfg.model)

    # 2. SGLang information endpoints (404: not SGLang).
    server_info: dict[str, Any] | None = None
    for path, result in (("/get_model_info", minfo_r), ("/get_server_info", sinfo_r)):
        if isinstance(result, EndpointDown):
            report.warnings.append(f"{path} did not answer ({result.message}); the checks that need it are skipped")
            continue
        status, info = result
        if status == 404:
            report.sglang = bool(report.sglang)  # False unless the other path answered
            continue
        if status != 200 or not isinstance(info, dict):
            report.warnings.append(f"{path} answered {status}; the checks that need it are skipped")
            continue
        report.sglang = True
        if path == "/get_model_info":
            report.model_path = info.get("model_path") or None
            report.weight_version = info.get("weight_version") or report.weight_version
            if "reasoning_parser" in info:
                report.reasoning_parser = info.get("reasoning_parser")
        else:
            server_info = info
            report.sglang_version = str(info["version"]) if info.get("version") is not None else None
            report.speculative_algorithm = info.get("speculative_algorithm")
            report.reasoning_parser = info.get("reasoning_parser", report.reasoning_parser)
            report.model_path = report.model_path or info.get("model_path") or None
            report.weight_version = report.weight_version or info.get("weight_version") or None
            if report.context is None and isinstance(info.get("context_length"), int):
                report.context = info["context_length"]
            if "disable_radix_cache" in info:
                report.radix_cache = not bool(info["disable_radix_cache"])

    found = _Findings()
    thinking = bool(cfg.template_kwargs().get("thinking"))
    hidden = cfg.hidden_states.enabled

    # 3. What the information endpoints already tell.
    if cfg.model not in report.models:
        served = ", ".join(repr(m) for m in report.models) or "no model"
        report.problems.append(f"serves {served}, not the configured model {cfg.model!r} "
                               "(set `model:` to the served name, or launch the server with "
                               f"--served-model-name {cfg.model})")
        return report  # generation would only fail on the model name
    needed = cfg.sampling.max_tokens + cfg.min_prompt_tokens
    if report.context is None:
        report.warnings.append(f"context length unknown (no max_model_len in /v1/models, no /get_server_info): "
                               f"cannot check it holds max_tokens + min_prompt_tokens = {needed} tokens")
    elif report.context < needed:
        fix = (f"launch with --context-length {needed} or more" if report.sglang is not False
               else "give the server a larger context (local_fleet.ctx_per_slot for the local fleet)")
        report.problems.append(
            f"context is {report.context} tokens, shorter than sampling.max_tokens ({cfg.sampling.max_tokens}) "
            f"+ min_prompt_tokens ({cfg.min_prompt_tokens}) = {needed}: {fix}, or lower sampling.max_tokens")
    if server_info is not None:
        no_parser = "reasoning_parser" in server_info and not server_info.get("reasoning_parser")
        if thinking and no_parser:
            found.add("parser", "the server reports reasoning_parser: null")
        elif no_parser and "thinking" not in cfg.template_kwargs():
            report.warnings.append("the server runs without a reasoning parser and the config leaves thinking to "
                                   "the server's default (Kimi thinks by default): its reasoning would end up in "
                                   "content. Set `thinking:` or launch with --reasoning-parser kimi_k2")
        if hidden and server_info.get("enable_return_hidden_states") is False:
            found.add("hidden_off", "the server reports enable_return_hidden_states: false")
        if hidden and server_info.get("disable_radix_cache") is False:
            found.add("radix", "the server reports disable_radix_cache: false")

    # 4. The tiny generations, concurrently.
    probes = [_chat_probe(client, cfg, report, found, probe_timeout_s)]
    if hidden:
        probes.append(_hidden_probe(client, cfg, report, found, probe_timeout_s, server_info))
    await asyncio.gather(*probes)
    report.reachable = not report.down_reason
    report.problems += _describe(found, cfg, report, server_info)
    return report


async def _chat_probe(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                      timeout_s: float) -> None:
    body: dict[str, Any] = {"model": cfg.model, "messages": PROBE_MESSAGES, "max_tokens": CHAT_PROBE_TOKENS,
                            "temperature": 0.0, "rid": probe_rid()}
    if cfg.template_kwargs():
        body["chat_template_kwargs"] = cfg.template_kwargs()
    try:
        status, answer = await client.post_json("/v1/chat/completions", body, timeout_s=timeout_s)
    except EndpointDown as exc:
        report.down_reason = (f"answers /v1/models, but a tiny chat generation ({CHAT_PROBE_TOKENS} tokens) got no "
                              f"answer within {timeout_s:g}s ({exc.message}): generation hangs or the server is dying")
        return
    if status != 200:
        error = classify(status, _error_message(answer, f"HTTP {status}"), client.label)
        if isinstance(error, Retryable):
            report.down_reason = f"a tiny chat generation failed ({status}: {error.message})"
        else:
            found.other.append(f"a tiny chat generation was refused ({status}: {error.message})")
        return
    try:
        message = answer["choices"][0].get("message") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        found.other.append("a tiny chat generation returned an unreadable answer (no choices[0].message)")
        return
    if report.weight_version is None and isinstance(answer.get("metadata"), dict):
        report.weight_version = answer["metadata"].get("weight_version") or None
    if cfg.template_kwargs().get("thinking") and not message.get("reasoning_content"):
        found.add("parser", f"a tiny thinking probe ({CHAT_PROBE_TOKENS} tokens) came back with no reasoning_content, "
                            f"its content is {str(message.get('content') or '')[:40]!r}")


def _probe_text() -> str:
    # A fresh nonce first, so no earlier request shares a prefix with the first probe.
    return f"[{uuid.uuid4().hex}] regen preflight probe: name three colours of the rainbow."


async def _hidden_probe(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                        timeout_s: float, server_info: dict | None) -> None:
    text = _probe_text()
    body = {"text": text, "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": HIDDEN_PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    rows: list[tuple[int, int]] = []  # (n_prefill, prompt_tokens) per probe
    for attempt in (1, 2):  # the same text twice: the second finds it in a radix cache if one is on
        try:
            status, answer = await client.post_json("/generate", {**body, "rid": probe_rid()}, timeout_s=timeout_s)
        except EndpointDown as exc:
            report.down_reason = report.down_reason or (
                f"answers /v1/models, but a tiny /generate ({HIDDEN_PROBE_TOKENS} tokens) got no answer within "
                f"{timeout_s:g}s ({exc.message})")
            return
        if status == 404:
            found.other.append("hidden states are requested (hidden_states.enabled) but the server has no "
                               "/generate (404): hidden states need an SGLang server")
            return
        if status != 200:
            error = classify(status, _error_message(answer, f"HTTP {status}"), client.label)
            if isinstance(error, EndpointFatal) and status == 400:  # /generate names no model: hidden states off
                found.add("hidden_off", f"/generate with return_hidden_states answered 400 {error.message!r}")
            elif isinstance(error, Retryable):
                report.down_reason = report.down_reason or f"/generate failed ({status}: {error.message})"
            else:
                found.other.append(f"/generate with return_hidden_states was refused ({status}: {error.message})")
            return
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        states = meta.get("hidden_states") if isinstance(meta, dict) else None
        prompt_tokens = meta.get("prompt_tokens") if isinstance(meta, dict) else None
        if not states or not isinstance(states, list):
            found.other.append("/generate with return_hidden_states returned no hidden states "
                               "(meta_info.hidden_states is empty)")
            return
        first = states[0]
        if not (isinstance(first, list) and first and isinstance(first[0], list)):
            found.other.append("/generate returned hidden states whose first element is not the 2-D block of "
                               "prefill rows: not SGLang's full-sequence layout")
            return
        widths = {len(first[0])} | {len(v) for v in states[1:] if isinstance(v, list)}
        if len(widths) > 1:
            found.other.append(f"/generate returned hidden states of mixed widths {sorted(widths)}")
            return
        report.hidden_width = len(first[0])
        if isinstance(prompt_tokens, int):
            rows.append((len(first), prompt_tokens))
        else:
            found.other.append("/generate returned no meta_info.prompt_tokens: cannot check the prefill rows")
            return
        if attempt == 1 and report.hidden_width != cfg.hidden_states.expected_width:
            break  # wrong width already refuses; no need for the cache probe
    if rows and rows[0][0] < rows[0][1]:
        found.add("prefill", f"a fresh probe got hidden-state rows for only {rows[0][0]} of its {rows[0][1]} "
                            "prompt tokens")
    elif len(rows) == 2 and rows[1][0] < rows[1][1]:
        found.add("radix", f"sent twice, the same probe got hidden-state rows for only {rows[1][0]} of its "
                           f"{rows[1][1]} prompt tokens the second time")
        report.radix_cache = True
    elif len(rows) == 2 and report.radix_cache is None:
        report.radix_cache = False


def _describe(found: _Findings, cfg: RunConfig, report: EndpointReport, server_info: dict | None) -> list[str]:
    """One user-facing sentence per fault, with its evidence and the launch flag that fixes it."""
    out: list[str] = []
    ev = found.evidence

    def why(kind: str) -> str:
        return "; ".join(ev[kind])

    if "parser" in ev:
        out.append("thinking is requested (chat_template_kwargs thinking: true) but the server splits no "
                   f"reasoning out: {why('parser')}. Launch SGLang with --reasoning-parser kimi_k2")
    if "hidden_off" in ev:
        out.append("hidden states are requested (hidden_states.enabled) but the server is not configured to "
                   f"return them: {why('hidden_off')}. Launch it with --enable-return-hidden-states")
    width, expected = report.hidden_width, cfg.hidden_states.expected_width
    if cfg.hidden_states.enabled and width is not None and width != expected:
        text = f"returns {width}-wide hidden states, expected {expected} (hidden_states.expected_width)"
        if width == KIMI_LAYER_WIDTH and expected == 3 * KIMI_LAYER_WIDTH:
            flags = ""
            if server_info is not None:
                flags = (f" (it reports speculative_algorithm: {server_info.get('speculative_algorithm')}, "
                         f"enable_return_aux_hidden_states: {server_info.get('enable_return_aux_hidden_states')})")
            text += (f": {width} is a single layer, not EAGLE-3's three auxiliary layers (3 x {KIMI_LAYER_WIDTH}). "
                     "The server probably runs --speculative-algorithm EAGLE instead of EAGLE3, or lacks "
                     f"--enable-return-aux-hidden-states{flags}")
        else:
            text += ": check the server's model and hidden-state flags, or set hidden_states.expected_width"
        out.append(text)
    if "radix" in ev:
        out.append(f"the radix (prefix) cache is on, so prompt tokens served from the cache get no hidden-state "
                   f"row: {why('radix')}. Launch it with --disable-radix-cache")
    if "prefill" in ev:
        out.append(f"hidden states do not cover the whole prompt: {why('prefill')}. Launch it with "
                   "--disable-radix-cache and a --chunked-prefill-size larger than the longest prompt")
    return out + found.other


# --- across endpoints ----------------------------------------------------------------------------------
def _groups(pairs: list[tuple[str, str]]) -> str:
    by_value: dict[str, list[str]] = {}
    for label, value in pairs:
        by_value.setdefault(value, []).append(label)
    return "; ".join(f"{', '.join(labels)}: {value}" for value, labels in by_value.items())


def fleet_problems(reports: list[EndpointReport], cfg: RunConfig) -> list[str]:
    """Cross-endpoint refusals among the endpoints that answered: one model, one weight version."""
    live = [r for r in reports if r.reachable or r.models]
    out: list[str] = []
    served = [(r.label, ", ".join(sorted(r.models)) or "no model") for r in live]
    if len({v for _, v in served}) > 1:
        out.append(f"endpoints serve different models ({_groups(served)}): every endpoint must serve "
                   f"{cfg.model!r}")
    paths = [(r.label, r.model_path) for r in live if r.model_path]
    if len({v for _, v in paths}) > 1:
        out.append(f"endpoints serve different models under the name {cfg.model!r} (model_path {_groups(paths)}): "
                   "one run must come from one checkpoint")
    versions = [(r.label, r.weight_version) for r in live if r.weight_version]
    if len({v for _, v in versions}) > 1:
        out.append(f"endpoints run different weight versions ({_groups(versions)}): one run must not mix "
                   "them; update the stale servers or leave them out")
    return out


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
                          max_tokens=cfg.sampling.max_tokens, chat_template_kwargs=cfg.template_kwargs())


async def probe_fleet(cfg: RunConfig, api_keys: dict[str, str | None], **timeouts: float) -> list[EndpointReport]:
    """One round: every endpoint checked concurrently."""
    settings = _settings(cfg)
    clients = [EndpointClient(e.url, e.label, settings, api_keys.get(e.label)) for e in cfg.all_endpoints()]
    try:
        return list(await asyncio.gather(*(check_endpoint(c, cfg, **timeouts) for c in clients)))
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def _refuse(message: str, reports: list[EndpointReport], fleet: list[str]) -> PreflightError:
    error = PreflightError(message)
    error.reports, error.fleet_problems = reports, fleet  # for the table of `regen preflight`
    return error


async def preflight_async(cfg: RunConfig, api_keys: dict[str, str | None], **timeouts: float) -> list[EndpointReport]:
    """`preflight` for callers already inside an event loop."""
    deadline = time.monotonic() + cfg.dead_fleet_deadline_s
    delay = 1.0
    while True:
        reports = await probe_fleet(cfg, api_keys, **timeouts)
        fleet = fleet_problems(reports, cfg)
        if fleet or any(r.problems for r in reports):
            raise _refuse(refusal_text(reports, fleet), reports, fleet)
        if any(r.reachable for r in reports):
            for r in reports:
                if not r.reachable:
                    log.warning("endpoint %s is unreachable (%s); it gets work once it answers and passes "
                                "this preflight", r.label, r.down_reason)
                for w in r.warnings:
                    log.warning("endpoint %s: %s", r.label, w)
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


def preflight(cfg: RunConfig, api_keys: dict[str, str | None], **timeouts: float) -> list[EndpointReport]:
    """Check the fleet before any prompt is sent.

    Raises PreflightError naming each endpoint and mismatch; waits with backoff up to
    cfg.dead_fleet_deadline_s while no endpoint answers. Unreachable endpoints among working ones are
    warnings (logged, and in the reports). `timeouts`: info_timeout_s, probe_timeout_s."""
    return asyncio.run(preflight_async(cfg, api_keys, **timeouts))


# --- `regen preflight CONFIG` ---------------------------------------------------------------------------
def run_preflight_command(config_path: str) -> int:
    """Load the config, check secrets, run the preflight and print the table. 0: passed; 1: refused; 2: bad config.

    A config with `local_fleet` gets its llama.cpp servers started for the check (running ones are reused)."""
    from .config import load_config
    from .preflight_table import render_table

    try:
        cfg = load_config(config_path)
        cfg.check_secrets()
        api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
    except ConfigError as exc:
        print(f"regen: error: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg.local_fleet is not None:
            reports = _with_local_fleet(cfg, api_keys)
        else:
            reports = preflight(cfg, api_keys)
    except PreflightError as exc:
        reports = getattr(exc, "reports", None)
        if reports:
            print(render_table(reports, cfg, getattr(exc, "fleet_problems", [])))
        print(f"regen: error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"regen: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - e.g. a local fleet that will not start (RunFatal)
        print(f"regen: error: {exc}", file=sys.stderr)
        return 1
    print(render_table(reports, cfg, []))
    ready = sum(r.ok for r in reports)
    print(f"preflight passed: {ready} of {len(reports)} endpoints ready for {cfg.model}")
    return 0


def _with_local_fleet(cfg: RunConfig, api_keys: dict[str, str | None]) -> list[EndpointReport]:
    import tempfile
    from pathlib import Path

    from .localfleet import LocalFleetProcesses

    with tempfile.TemporaryDirectory(prefix="regen-preflight-") as logs:
        with LocalFleetProcesses(cfg.local_fleet, Path(logs)):
            return preflight(cfg, api_keys)
