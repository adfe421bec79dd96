"""Probing one endpoint: what it serves and how it was launched. Used by the fleet preflight and by the
circuit breaker, so that a recovered endpoint passes the full preflight before it gets work again.

  1. `/v1/models` (served ids, context), `/model_info` and `/server_info` (falling back to the deprecated
     `/get_model_info` and `/get_server_info`; SGLang only: a 404 on both means "not SGLang", e.g. the local
     llama.cpp fleet, and the checks that need them are skipped), and where /v1/models names vLLM or llama.cpp
     (`owned_by`), its /version or /props. The server's engine adapter (engines/) is chosen here, and the
     version checks are its: output ids, seeds;
  2. one tiny chat generation with the run's chat_template_kwargs: generation works (a /health 200 can lie),
     and when thinking is requested the reasoning is split out (a reasoning parser is running); a run that
     streams and stores token ids also gets one tiny streamed generation; a prompt set with images, on a server
     that does not say whether it takes them, a tiny image probe (image_probe.py).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.config import RunConfig
from .capacity import server_limits
from .classify import classify, error_message
from .client import EndpointClient
from ..core.errors import EndpointDown, RequestError, Retryable
from .engines import OpenAIAdapter, SGLangAdapter, engine_for, identity_path, owners
from .identity import INFO_TIMEOUT_S, get_info, info_path, read_sglang_info
from .image_probe import known_verdict, probe_images

PROBE_TIMEOUT_S = 30.0  # each tiny generation (8 chat tokens)
CHAT_PROBE_TOKENS = 8
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
    # SGLang's --tool-call-parser ("none": launched without one); else what the tool probe found ("took tools",
    # "refused tools") for a prompt set with tools; None: unknown
    tool_call_parser: str | None = None
    sglang_version: str | None = None
    sglang: bool | None = None  # True: SGLang info endpoints answer; False: 404 (e.g. llama.cpp); None: unknown
    speculative_algorithm: str | None = None
    engine: OpenAIAdapter | None = None  # the adapter the client uses for this endpoint
    deterministic: bool | None = None  # --enable-deterministic-inference (server_info); None: unknown
    preferred_sampling: Any = None  # /model_info preferred_sampling_params: server-side defaults
    images: bool | None = None  # takes image parts (SGLang's has_image_understanding, the image probe); None: unknown
    limits: Any = None  # capacity.Limits: what the server batches (SGLang /server_info, vLLM dev mode); None: unread
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
                         probe_timeout_s: float = PROBE_TIMEOUT_S, tools: bool = False,
                         images: bool = False) -> EndpointReport:
    """Every check of one endpoint. Never raises for the endpoint's faults: they are in the report.
    `tools`: the prompt set has prompts with tools, so the endpoint must return the target's calls in tool_calls.
    `images`: the prompt set has prompts with images, so the endpoint must take image parts.

    `report.ok` says whether the endpoint may get work; `report.reachable` False means it did not answer
    (or did not generate) and may come back; `report.problems` non-empty means it is misconfigured."""
    report = EndpointReport(label=client.label, url=client.url)
    models_r, (minfo_path, minfo_r), (sinfo_path, sinfo_r) = await asyncio.gather(
        get_info(client, "/v1/models", info_timeout_s),
        info_path(client, "model", info_timeout_s),
        info_path(client, "server", info_timeout_s),
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
        report.problems.append(f"/v1/models answered {status}: {error_message(body, 'no readable body')}")
        return report
    report.models = [str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict)]
    report.context = _context_of(body, cfg.model)

    # 2. The information endpoints (SGLang's; a vLLM in dev mode answers /server_info with its own keys), and
    # the engine's own identity path: they pick the adapter.
    answered: dict[str, dict[str, Any]] = {}
    for path, result in ((minfo_path, minfo_r), (sinfo_path, sinfo_r)):
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
        answered[path] = info
    identity = None
    path = identity_path(body)
    if path is not None:
        result = await get_info(client, path, info_timeout_s)
        if isinstance(result, EndpointDown) or result[0] != 200:
            report.warnings.append(f"{path} did not answer: the engine's version is unknown")
        else:
            identity = result[1]
    client.engine = report.engine = engine_for(body, answered.get(sinfo_path), identity)
    report.limits = await server_limits(client, report.engine.engine, answered.get(sinfo_path))
    server_info: dict[str, Any] | None = None
    if isinstance(report.engine, SGLangAdapter):
        server_info = read_sglang_info(report, answered.get(minfo_path), answered.get(sinfo_path))
    else:
        report.sglang = False if answered else report.sglang  # e.g. vLLM's dev-mode /server_info
    report.deterministic = report.engine.deterministic
    if type(report.engine) is OpenAIAdapter:
        named = ", ".join(sorted(owners(body))) or "nothing"
        report.warnings.append(
            f"its inference engine is unknown (/v1/models owned_by: {named}; no /version, /props or SGLang "
            "/server_info names one: a proxy in front?): regen reads every engine's spelling of the fields, asks "
            "for token ids only unstreamed, and cannot check that the fleet runs one engine, the engine's version, "
            "its reasoning parser or launch flags; records name engine 'openai'. Point regen at the servers "
            "themselves to have them checked")
    warning = report.engine.version_warning()
    if warning:
        report.warnings.append(warning)
    found = _Findings()
    thinking = bool(cfg.template_kwargs().get("thinking"))

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
        fix = report.engine.context_fix(needed)
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
    parser_reported = server_info is not None and "reasoning_parser" in server_info
    if not parser_reported and "thinking" not in cfg.template_kwargs():
        report.warnings.append(f"the server ({report.engine.describe()}) does not report its reasoning parser and the "
                               "config leaves thinking to the server's default: if the model thinks by default and "
                               "no parser splits it out, its reasoning ends up in content. Set `thinking:` (the "
                               "preflight then checks the split), or check the server's --reasoning-parser")
    if isinstance(report.engine, SGLangAdapter):
        _version_checks(report.engine, cfg, found)

    # 4. The tiny generations, concurrently.
    probes = [_chat_probe(client, cfg, report, found, probe_timeout_s)]
    if tools and cfg.tool_choice != "none":
        if server_info is not None and "tool_call_parser" in server_info:  # SGLang: it refuses no request
            if not server_info["tool_call_parser"]:
                found.other.append(tool_refusal(report.engine, "the server reports tool_call_parser: null, so it "
                                                "would leave the target's calls as text in content"))
        else:
            probes.append(_tool_probe(client, cfg, report, found, probe_timeout_s))
    if wants_output_ids(cfg) and cfg.stream:  # the ids on the run's own transport
        probes.append(_stream_ids_probe(client, cfg, report, found, probe_timeout_s))
    if images:
        probes.append(_images_check(client, cfg, report, found, probe_timeout_s))
    await asyncio.gather(*probes)
    report.reachable = not report.down_reason
    report.problems += _describe(found)
    return report


async def _chat_probe(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                      timeout_s: float) -> None:
    body: dict[str, Any] = {"model": cfg.model, "messages": PROBE_MESSAGES, "max_tokens": CHAT_PROBE_TOKENS,
                            "temperature": 0.0, client.engine.request_id_field: probe_rid()}
    if cfg.template_kwargs():
        body["chat_template_kwargs"] = cfg.template_kwargs()
    wants_ids = wants_output_ids(cfg) and not cfg.stream  # the probe itself does not stream
    body.update(client.settings.sampling().fields())
    body.update(client.engine.chat_extras(want_ids=wants_ids, stream=False))
    try:
        status, answer = await client.post_json("/v1/chat/completions", body, timeout_s=timeout_s)
    except EndpointDown as exc:
        report.down_reason = (f"answers /v1/models, but a tiny chat generation ({CHAT_PROBE_TOKENS} tokens) got no "
                              f"answer within {timeout_s:g}s ({exc.message}): generation hangs or the server is dying")
        return
    if status != 200:
        error = classify(status, error_message(answer, f"HTTP {status}"), client.label, engine=client.engine)
        if isinstance(error, Retryable):
            report.down_reason = f"a tiny chat generation failed ({status}: {error.message})"
        else:
            found.other.append(f"a tiny chat generation was refused ({status}: {error.message})")
        return
    try:
        choice = answer["choices"][0]
        message = choice.get("message") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        found.other.append("a tiny chat generation returned an unreadable answer (no choices[0].message)")
        return
    if wants_ids and "ids" not in found.evidence and not client.engine.output_ids(choice):
        if report.sglang:
            version = f"SGLang {report.sglang_version}" if report.sglang_version else "SGLang of unknown version"
            way_out = ("SGLang returns them from 0.5.17 on (choices[0].response_token_ids from 0.5.18): upgrade the "
                       "server, or set `return_token_ids: false` to run without exact token ids")
        else:
            version = f"the server is {report.engine.describe()}" if report.engine else "not an SGLang server"
            way_out = "set `return_token_ids: false` to run without exact token ids"
        found.other.append(f"returns no output token ids ({version}; the run asks for them with "
                           f"return_token_ids): {way_out}")
    if report.weight_version is None and isinstance(answer.get("metadata"), dict):
        report.weight_version = answer["metadata"].get("weight_version") or None
    if cfg.template_kwargs().get("thinking") and not client.engine.reasoning(message):
        found.add("parser", f"a tiny thinking probe ({CHAT_PROBE_TOKENS} tokens) came back with no "
                            f"{client.engine.reasoning_field}, "
                            f"its content is {str(message.get('content') or '')[:40]!r}")


async def _stream_ids_probe(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                            timeout_s: float) -> None:
    """A run that streams and stores token ids: one tiny streamed generation through the run's own client code,
    which must bring back output ids (whatever the engine: none is trusted to send them on a stream)."""
    settings = replace(client.settings, max_tokens=CHAT_PROBE_TOKENS, temperature=0.0, stream=True,
                       return_token_ids=True, timeout_s=timeout_s, stall_timeout_s=timeout_s,
                       engines={client.label: client.engine})
    streamed = EndpointClient(client.url, client.label, settings, client._api_key)
    try:
        completion = await streamed.chat(PROBE_MESSAGES, seed=None)
    except (EndpointDown, Retryable) as exc:
        report.down_reason = report.down_reason or f"a tiny streamed chat generation failed ({exc.message})"
        return
    except RequestError as exc:
        found.other.append(f"a tiny streamed chat generation was refused ({exc.message})")
        return
    finally:
        await streamed.close()
    if not completion.output_token_ids and "ids" not in found.evidence:
        engine = report.engine.describe() if report.engine else "unidentified"
        found.add("ids", f"a tiny streamed generation (the run streams) came back without them (the server is "
                         f"{engine}): set `stream: false` if it returns them unstreamed, or `return_token_ids: "
                         "false` to run without exact token ids")


PROBE_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The current time.",
                                              "parameters": {"type": "object", "properties": {}}}}


def tool_refusal(engine: OpenAIAdapter | None, why: str) -> str:
    fix = (engine or OpenAIAdapter()).tool_calls_fix()
    return f"the prompt set has tools, and this server cannot return the target's calls in tool_calls ({why}): {fix}"


async def _tool_probe(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                      timeout_s: float) -> None:
    """A prompt set with tools, on a server that does not report its tool-call parser: one tiny request with a
    tool and the run's tool_choice (vLLM refuses it with a 400 when launched without a parser)."""
    body: dict[str, Any] = {"model": cfg.model, "messages": PROBE_MESSAGES, "max_tokens": CHAT_PROBE_TOKENS,
                            "temperature": 0.0, "tools": [PROBE_TOOL], "tool_choice": cfg.tool_choice,
                            client.engine.request_id_field: probe_rid()}
    if cfg.template_kwargs():
        body["chat_template_kwargs"] = cfg.template_kwargs()
    try:
        status, answer = await client.post_json("/v1/chat/completions", body, timeout_s=timeout_s)
    except EndpointDown:
        return  # the chat probe reports a server that does not answer
    if status == 200:
        report.tool_call_parser = report.tool_call_parser or "took tools"
        return
    error = classify(status, error_message(answer, f"HTTP {status}"), client.label, engine=client.engine)
    if not isinstance(error, (Retryable, EndpointDown)):
        report.tool_call_parser = "refused tools"
        found.other.append(tool_refusal(report.engine, f"a tiny request with tools was refused: {status} "
                                                       f"{error_message(answer, '')}"))


async def _images_check(client: EndpointClient, cfg: RunConfig, report: EndpointReport, found: _Findings,
                        timeout_s: float) -> None:
    """A prompt set with images: what the engine or the server says, else the tiny image probe."""
    verdict = known_verdict(report.engine, report.images) or await probe_images(client, cfg, probe_rid, timeout_s)
    report.images = verdict.takes if verdict.takes is not None else report.images
    if verdict.problem:
        found.other.append(verdict.problem)
    elif verdict.down:
        report.down_reason = report.down_reason or verdict.down


def wants_output_ids(cfg: RunConfig) -> bool:
    """What the run's chat requests ask for."""
    return cfg.return_token_ids


def _version_checks(engine: SGLangAdapter, cfg: RunConfig, found: _Findings) -> None:
    """What this SGLang version can and cannot do for the run, read from its version and launch arguments."""
    if wants_output_ids(cfg):
        problem = engine.output_ids_problem()
        if problem is None and cfg.stream:
            problem = engine.stream_ids_problem()
        if problem:
            found.add("ids", problem)


def _describe(found: _Findings) -> list[str]:
    """One user-facing sentence per fault, with its evidence and the launch flag that fixes it."""
    out: list[str] = []
    ev = found.evidence

    def why(kind: str) -> str:
        return "; ".join(ev[kind])

    if "ids" in ev:
        out.append(f"returns no output token ids, and the run asks for them (return_token_ids): {why('ids')}")
    if "parser" in ev:
        out.append("thinking is requested (chat_template_kwargs thinking: true) but the server splits no "
                   f"reasoning out: {why('parser')}. Launch the server with --reasoning-parser kimi_k2")
    return out + found.other
