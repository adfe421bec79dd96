"""One client per endpoint: OpenAI chat completions against SGLang, vLLM, llama.cpp (or any OpenAI-compatible
server); what each engine names differently is its adapter's (engines/).

What a server's error means is classify.py's: the only module that reads a server's error text.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson

from ..core.work import Completion
from ..core.errors import (  # noqa: F401 (RETRYABLE_STATUS: named here before it moved to core)
    RETRYABLE_STATUS, ConnectionDropped, ContractError, EndpointDown, EndpointFatal, RequestError, Retryable,
    TerminalForPrompt, Unexpected,
)
from .connections import KEEPALIVE_EXPIRY_S, MAX_CONCURRENCY, connection_limits
from .lookups import resolver
from .classify import classify, classify_stream_error, error_message, parse_body, was_dropped
from .engines import OpenAIAdapter, Sampling
from .toolcalls import ToolCallFragments, tool_calls_of

@dataclass(frozen=True)
class ClientSettings:
    """What every request of a run carries. Small and picklable, shipped to each endpoint actor."""

    model: str
    temperature: float
    top_p: float
    max_tokens: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0  # deadline of a non-streamed request
    return_token_ids: bool = True
    stream: bool = False
    stall_timeout_s: float = 60.0  # streamed: no token for this long is "no progress"
    # Pinned at preflight: an answer from another weight version is never mixed into the run.
    expected_weight_version: str | None = None
    # Sent explicitly on every request (the chat route would otherwise fill them from generation_config).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Each endpoint's engine adapter, by label, as the preflight identified it (absent: the neutral adapter).
    engines: dict[str, OpenAIAdapter] = field(default_factory=dict)
    # The (engine, version) pairs the run's preflight admitted: a readmitted endpoint must run one of them.
    run_engines: tuple[tuple[str, str | None], ...] = ()
    # Sent beside `tools`, only on a request whose prompt has tools (config `tool_choice`).
    tool_choice: str = "auto"
    # The run's prompt set has tools: an endpoint readmitted (or joining) must return tool_calls (the preflight's).
    needs_tool_calls: bool = False
    # The run's prompt set has images: an endpoint readmitted (or joining) must take them (the preflight's).
    needs_images: bool = False

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty)


def _usage_fields(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "cached_tokens": details.get("cached_tokens"),
        "reasoning_tokens": usage.get("reasoning_tokens", completion_details.get("reasoning_tokens")),
    }


def output_token_ids(choice: dict[str, Any], engine: OpenAIAdapter | None = None) -> list[int] | None:
    """The output ids of a chat choice, where the endpoint's engine (and version) puts them."""
    return (engine or OpenAIAdapter()).output_ids(choice)


def parse_chat(body: dict[str, Any], latency_s: float, request_id: str,
               engine: OpenAIAdapter | None = None) -> Completion:
    engine = engine or OpenAIAdapter()
    choice = body["choices"][0]
    message = choice.get("message") or {}
    metadata = body.get("metadata")
    return Completion(
        content=message.get("content") or "",
        reasoning_content=engine.reasoning(message),
        finish_reason=choice.get("finish_reason") or "unknown",
        model=body.get("model", ""),
        weight_version=(body.get("metadata") or {}).get("weight_version"),
        latency_s=latency_s,
        request_id=request_id,
        prompt_token_ids=engine.prompt_ids(body, choice),
        output_token_ids=engine.output_ids(choice),
        weight_versions=engine.weight_versions(metadata) or None,
        deterministic=engine.deterministic, engine=engine.engine, engine_version=engine.version,
        tool_calls=tool_calls_of(message), **_usage_fields(body.get("usage") or {}),
    )


@dataclass
class StreamAccumulator:
    """Folds SSE chunks into one completion."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: str = "unknown"
    usage: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    request_id: str = ""
    engine: OpenAIAdapter = field(default_factory=OpenAIAdapter)
    prompt_ids: list[int] | None = None  # where the engine sends them on a stream (StreamIds)
    output_ids: list[int] | None = None
    endpoint: str = ""
    tool_calls: ToolCallFragments = field(default_factory=ToolCallFragments)

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("error"):  # SGLang reports a mid-stream error as a data event
            raise classify_stream_error(chunk["error"], self.endpoint, self.engine)
        self.model = chunk.get("model") or self.model
        self.request_id = chunk.get("id") or self.request_id
        self.usage = chunk.get("usage") or self.usage
        ids = self.engine.stream_chunk_ids(chunk)
        if ids is not None:
            self.prompt_ids = ids.prompt_ids if ids.prompt_ids is not None else self.prompt_ids
            if ids.output_ids is not None:
                self.output_ids = (self.output_ids or []) + list(ids.output_ids)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            reasoning = self.engine.reasoning(delta)
            if reasoning:
                self.reasoning.append(reasoning)
            if delta.get("tool_calls"):
                self.tool_calls.add(delta["tool_calls"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def completion(self, latency_s: float) -> Completion:
        return Completion(
            content="".join(self.content), reasoning_content="".join(self.reasoning) if self.reasoning else None,
            # no SGLang stream chunk model declares `metadata`: a streamed answer names no weight version
            finish_reason=self.finish_reason, model=self.model, weight_version=None,
            latency_s=latency_s, request_id=self.request_id, deterministic=self.engine.deterministic,
            engine=self.engine.engine, engine_version=self.engine.version, prompt_token_ids=self.prompt_ids,
            output_token_ids=self.output_ids, tool_calls=self.tool_calls.joined(), **_usage_fields(self.usage),
        )


def warm_up() -> None:
    """Pay the client's first-use costs (the SDK's lazily imported chat modules, its HTTP client) now, in an actor
    that waits for its settings, rather than on its first request: about 0.08 s of CPU, many times that on a
    loaded machine. Opens no connection."""
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0)
    _ = client.chat.completions.with_raw_response


def _untransformed(request: dict[str, Any]) -> dict[str, Any]:
    """The same request body, every field in `extra_body`, which the SDK merges into the JSON as it is: its typed
    parameters are walked field by field against their TypedDicts (`async_maybe_transform`), 15% of an endpoint
    actor's CPU in a profile of the scale case's dispatch (3 KB conversations), for plain JSON dicts it leaves as
    they were. `messages` stays the only parameter the SDK requires, given empty and overridden by extra_body."""
    body = {key: value for key, value in request.items() if key != "extra_body"}
    return {"model": body["model"], "messages": [], "extra_body": {**body, **request.get("extra_body", {})}}


class EndpointClient:
    """Async client of one endpoint. Raises only classes of the error taxonomy."""

    def __init__(self, url: str, label: str, settings: ClientSettings, api_key: str | None = None,
                 max_in_flight: int = MAX_CONCURRENCY):
        self.url, self.label, self.settings = url, label, settings
        self._api_key = api_key
        self.engine = settings.engines.get(label) or OpenAIAdapter()  # the preflight may set it
        self._openai = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=settings.timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(limits=connection_limits(max_in_flight)),
        )
        self._http: aiohttp.ClientSession | None = None

    async def chat(self, messages: list[dict[str, Any]], seed: int | None,
                   tools: list[dict[str, Any]] | None = None) -> Completion:
        """One generation. `tools`: the prompt's OpenAI tools list, sent with the run's `tool_choice`; None (or
        empty: vLLM refuses `tools: []`) sends neither field."""
        s = self.settings
        rid = uuid.uuid4().hex  # fresh on every attempt: SGLang refuses a rid that is still running
        sampling = s.sampling().fields()
        extra: dict[str, Any] = {self.engine.request_id_field: rid, "top_k": sampling["top_k"], "min_p": sampling["min_p"],
                                 "repetition_penalty": sampling["repetition_penalty"]}
        if s.chat_template_kwargs:
            extra["chat_template_kwargs"] = s.chat_template_kwargs
        extra.update(self.engine.chat_extras(want_ids=s.return_token_ids, stream=s.stream))
        request = dict(model=s.model, messages=messages, max_tokens=s.max_tokens, temperature=s.temperature,
                       top_p=s.top_p, seed=seed, extra_body=extra)
        if tools:
            request.update(tools=tools, tool_choice=s.tool_choice)
        started = time.monotonic()
        try:
            if s.stream:
                completion = await self._streamed(request, started, rid)
            else:
                raw = await self._openai.chat.completions.with_raw_response.create(**_untransformed(request))
                body = orjson.loads(raw.content)
                completion = parse_chat(body, time.monotonic() - started, body.get("id") or rid, self.engine)
        except openai.APIStatusError as exc:
            raise classify(exc.status_code, error_message(exc.body, exc.message), self.label,
                           engine=self.engine) from None
        except (openai.APITimeoutError, TimeoutError):
            raise Retryable(f"no progress (deadline {s.timeout_s:.0f}s, stall {s.stall_timeout_s:.0f}s)",
                            endpoint=self.label) from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise classify(None, f"connection failed: {cause or type(cause).__name__}", self.label,
                           dropped=was_dropped(exc)) from None
        except openai.APIError as exc:  # the SDK raises this for an error event in the middle of a stream
            raise classify_stream_error(exc.body if exc.body is not None else {"message": exc.message},
                                        self.label, self.engine) from None
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            raise Retryable(f"unreadable response ({exc!r})", endpoint=self.label) from None
        return self.check_completion(completion)

    async def _streamed(self, request: dict[str, Any], started: float, rid: str) -> Completion:
        """SSE: a request with no new chunk for stall_timeout_s made no progress and is cancelled."""
        stream = await self._openai.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True})
        folded = StreamAccumulator(request_id=rid, engine=self.engine, endpoint=self.label)
        chunks = stream.__aiter__()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(chunks.__anext__(), self.settings.stall_timeout_s)
                except StopAsyncIteration:
                    break
                folded.add(chunk.model_dump(exclude_unset=True))
        finally:
            await stream.close()
        return folded.completion(time.monotonic() - started)

    def check_completion(self, completion: Completion) -> Completion:
        """An `abort` finish is retryable; an answer from other weights than the run's is endpoint-fatal; an
        answer whose weights changed while it was generated (two weight-version spans) is retried."""
        if completion.finish_reason == "abort":
            raise Retryable("the server aborted the request", endpoint=self.label)
        if completion.weight_versions and len(completion.weight_versions) > 1:
            raise Retryable(f"the weights changed while the answer was generated (weight_versions spans name "
                            f"{', '.join(map(repr, completion.weight_versions))}): never committed, retried",
                            endpoint=self.label)
        expected = self.settings.expected_weight_version
        if expected is not None and completion.weight_version not in (None, expected):
            raise EndpointFatal(f"weight version changed during the run: pinned {expected!r}, "
                                f"the server now reports {completion.weight_version!r}", endpoint=self.label)
        return completion

    # --- information endpoints ---------------------------------------------------------------------
    async def get_json(self, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
        """GET an information endpoint. Returns (status, parsed body or None); raises EndpointDown."""
        try:
            async with self._session().get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, parse_body(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointDown(f"{path}: {exc or type(exc).__name__}", endpoint=self.label) from None

    async def get_text(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        """GET a text endpoint (/metrics). Returns (status, text); raises EndpointDown."""
        try:
            async with self._session().get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, (await resp.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointDown(f"{path}: {exc or type(exc).__name__}", endpoint=self.label) from None

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, Any]:
        """POST a probe (the preflight's tiny generations). Returns (status, parsed body); any failure to answer,
        a timeout included, is EndpointDown: the probe reports the endpoint as down."""
        session = self._session()
        try:
            async with session.post(self.url + path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, parse_body(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointDown(f"{path}: {exc or type(exc).__name__}", endpoint=self.label) from None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            # no connection cap of aiohttp's own (100): the worker's concurrency bounds the requests; the
            # resolver's lookups never hold a stopped driver; idle connections go before the server closes them
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S, resolver=resolver())
            self._http = aiohttp.ClientSession(headers=headers, connector=connector)
        return self._http

    async def healthy(self) -> bool:
        try:
            status, _ = await self.get_json("/health", timeout_s=5.0)
        except EndpointDown:
            return False
        return status == 200

    async def served_models(self) -> list[str]:
        status, body = await self.get_json("/v1/models")
        if status != 200 or not isinstance(body, dict):
            raise classify(status, error_message(body, f"/v1/models answered {status}"), self.label,
                           engine=self.engine)
        return [str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict)]

    async def close(self) -> None:
        await self._openai.close()
        if self._http is not None:
            await self._http.close()
