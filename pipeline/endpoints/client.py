"""One client per endpoint: OpenAI chat completions against SGLang (or any OpenAI-compatible server).

This is the only module that reads a server's error text: `classify` maps status + message to a class
of the error taxonomy, and nothing else in regen looks at error strings.
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
from ..core.errors import EndpointDown, EndpointFatal, RequestError, Retryable, TerminalForPrompt
from .engines import OpenAIAdapter, Sampling, StreamIds

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}

# The messages SGLang (and llama.cpp, for the local fleet) use to tell its 400s apart. The SGLang ones are read
# out of each checked version's wheel by tests/test_sglang_conformance.py: a renamed message fails there.
_CONTEXT_OVERFLOW = (
    "is longer than the model's context length",  # SGLang tokenizer_manager: prompt alone too long
    "exceeds the model's maximum context length",  # SGLang tokenizer_manager: prompt + max_tokens too long
    "exceeds the maximum allowed length",  # SGLang managers/utils.py (scheduler): "Input length (N tokens) ..."
    "max_completion_tokens is too large",  # SGLang serving_chat: max_tokens alone above the context
    "exceeds the available context size",  # llama.cpp
)
_DUPLICATE_RID = "duplicate request id"
_NO_HIDDEN_STATES = (
    "not configured to return hidden states",  # SGLang 0.5.17+ (the flags it names differ by version)
    "not configured to return the hidden states",  # SGLang 0.5.14
    "return_hidden_states mode exceeds the server maximum",  # SGLang 0.5.17+: `True` asked of a `last` server
)
_MODEL_MISSING = "does not exist"  # SGLang: 400 "The model `X` does not exist. The served model name is `Y`."


def classify(status: int | None, message: str, endpoint: str = "") -> RequestError:
    """Map an HTTP status and the server's message to the error class that decides what happens."""
    text = message.lower()
    kwargs = {"status": status, "endpoint": endpoint}
    if status is None:
        return EndpointDown(message, **kwargs)
    if status == 400:
        if _DUPLICATE_RID in text:
            return Retryable(message, **kwargs)  # the retry gets a fresh rid
        if any(marker in text for marker in _NO_HIDDEN_STATES) or ("model" in text and _MODEL_MISSING in text):
            return EndpointFatal(message, **kwargs)
        if any(marker.lower() in text for marker in _CONTEXT_OVERFLOW):
            return TerminalForPrompt(f"context overflow: {message}", **kwargs)
        return TerminalForPrompt(f"invalid request: {message}", **kwargs)
    if status in (401, 403, 404):
        return EndpointFatal(message, **kwargs)
    if status in RETRYABLE_STATUS or status >= 500:
        return Retryable(message, **kwargs)
    return TerminalForPrompt(message, **kwargs)


def _error_message(body: Any, fallback: str) -> str:
    """SGLang sends {"message": ...} (OpenAI style), {"error": {"message": ...}} (native) or {"error": "..."}
    (/generate contract errors and a missing API key)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str) and inner:
            return inner
        if body.get("message"):
            return str(body["message"])
    return fallback


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
        reasoning_content=message.get("reasoning_content"),
        finish_reason=choice.get("finish_reason") or "unknown",
        model=body.get("model", ""),
        weight_version=(body.get("metadata") or {}).get("weight_version"),
        latency_s=latency_s,
        request_id=request_id,
        prompt_token_ids=engine.prompt_ids(body, choice),
        output_token_ids=engine.output_ids(choice),
        weight_versions=engine.weight_versions(metadata) or None,
        deterministic=engine.deterministic,
        **_usage_fields(body.get("usage") or {}),
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
    weight_version: str | None = None
    engine: OpenAIAdapter = field(default_factory=OpenAIAdapter)
    ids: StreamIds | None = None  # from the final sglext chunk, where the server sends one

    def add(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:  # SGLang reports a mid-stream error as a data event
            error = chunk["error"]
            status = error.get("code") if isinstance(error, dict) else None
            raise classify(int(status) if isinstance(status, int) else 500, _error_message(chunk, "stream error"))
        self.model = chunk.get("model") or self.model
        self.request_id = chunk.get("id") or self.request_id
        self.weight_version = (chunk.get("metadata") or {}).get("weight_version", self.weight_version)
        self.usage = chunk.get("usage") or self.usage
        self.ids = self.engine.stream_chunk_ids(chunk) or self.ids
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def completion(self, latency_s: float) -> Completion:
        return Completion(
            content="".join(self.content), reasoning_content="".join(self.reasoning) if self.reasoning else None,
            finish_reason=self.finish_reason, model=self.model, weight_version=self.weight_version,
            latency_s=latency_s, request_id=self.request_id, deterministic=self.engine.deterministic,
            prompt_token_ids=self.ids.prompt_ids if self.ids else None,
            output_token_ids=self.ids.output_ids if self.ids else None, **_usage_fields(self.usage),
        )


class EndpointClient:
    """Async client of one endpoint. Raises only classes of the error taxonomy."""

    def __init__(self, url: str, label: str, settings: ClientSettings, api_key: str | None = None):
        self.url, self.label, self.settings = url, label, settings
        self._api_key = api_key
        self.engine = settings.engines.get(label) or OpenAIAdapter()  # the preflight may set it
        self._openai = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=settings.timeout_s
        )
        self._http: aiohttp.ClientSession | None = None

    async def chat(self, messages: list[dict[str, str]], seed: int | None) -> Completion:
        s = self.settings
        rid = uuid.uuid4().hex  # fresh on every attempt: SGLang refuses a rid that is still running
        sampling = s.sampling().fields()
        extra: dict[str, Any] = {"rid": rid, "top_k": sampling["top_k"], "min_p": sampling["min_p"],
                                 "repetition_penalty": sampling["repetition_penalty"]}
        if s.chat_template_kwargs:
            extra["chat_template_kwargs"] = s.chat_template_kwargs
        extra.update(self.engine.chat_extras(want_ids=s.return_token_ids, stream=s.stream))
        request = dict(model=s.model, messages=messages, max_tokens=s.max_tokens, temperature=s.temperature,
                       top_p=s.top_p, seed=seed, extra_body=extra)
        started = time.monotonic()
        try:
            if s.stream:
                completion = await self._streamed(request, started, rid)
            else:
                raw = await self._openai.chat.completions.with_raw_response.create(**request)
                body = orjson.loads(raw.content)
                completion = parse_chat(body, time.monotonic() - started, body.get("id") or rid, self.engine)
        except openai.APIStatusError as exc:
            raise classify(exc.status_code, _error_message(exc.body, exc.message), self.label) from None
        except (openai.APITimeoutError, TimeoutError):
            raise Retryable(f"no progress (deadline {s.timeout_s:.0f}s, stall {s.stall_timeout_s:.0f}s)",
                            endpoint=self.label) from None
        except openai.APIConnectionError as exc:
            raise classify(None, f"connection failed: {exc.__cause__ or exc}", self.label) from None
        except openai.APIError as exc:  # e.g. an error event in the middle of a stream
            raise Retryable(f"stream error: {_error_message(exc.body, exc.message)}", endpoint=self.label) from None
        except (ValueError, KeyError, IndexError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            raise Retryable(f"unreadable response ({exc!r})", endpoint=self.label) from None
        return self.check_completion(completion)

    async def _streamed(self, request: dict[str, Any], started: float, rid: str) -> Completion:
        """SSE: a request with no new chunk for stall_timeout_s made no progress and is cancelled."""
        stream = await self._openai.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True})
        folded = StreamAccumulator(request_id=rid, engine=self.engine)
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
                payload = await resp.read()
                try:
                    return resp.status, orjson.loads(payload) if payload else None
                except orjson.JSONDecodeError:
                    return resp.status, payload.decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointDown(f"{path}: {exc or type(exc).__name__}", endpoint=self.label) from None

    async def post_json(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, Any]:
        """POST to a native endpoint (e.g. /generate). Returns (status, parsed body); raises EndpointDown."""
        status, payload = await self.post_raw(path, body, timeout_s)
        try:
            return status, orjson.loads(payload) if payload else None
        except orjson.JSONDecodeError:
            return status, payload.decode(errors="replace")

    async def post_raw(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, bytes]:
        """POST and return the body's bytes unparsed (hidden states are parsed at the byte level)."""
        session = self._session()
        try:
            async with session.post(self.url + path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointDown(f"{path}: {exc or type(exc).__name__}", endpoint=self.label) from None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._http = aiohttp.ClientSession(headers=headers)
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
            raise classify(status, _error_message(body, f"/v1/models answered {status}"), self.label)
        return [str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict)]

    async def close(self) -> None:
        await self._openai.close()
        if self._http is not None:
            await self._http.close()
