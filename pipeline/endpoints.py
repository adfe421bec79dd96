"""One client per endpoint: OpenAI chat completions against SGLang (or any OpenAI-compatible server).

This is the only module that reads a server's error text: `classify` maps status + message to a class
of the error taxonomy, and nothing else in regen looks at error strings.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson

from .errors import EndpointDown, EndpointFatal, RequestError, Retryable, TerminalForPrompt

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}

# The messages SGLang (and llama.cpp, for the local fleet) use to tell its 400s apart.
_CONTEXT_OVERFLOW = (
    "is longer than the model's context length",  # SGLang: prompt alone too long
    "exceeds the model's maximum context length",  # SGLang: prompt + max_tokens too long
    "exceeds the available context size",  # llama.cpp
)
_DUPLICATE_RID = "duplicate request id"
_NO_HIDDEN_STATES = "not configured to return hidden states"
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
        if _NO_HIDDEN_STATES in text or ("model" in text and _MODEL_MISSING in text):
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
    """SGLang sends {"message": ...} (OpenAI style) or {"error": {"message": ...}} (native)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
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
    timeout_s: float = 600.0


@dataclass
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    model: str
    weight_version: str | None
    latency_s: float
    request_id: str


def parse_chat(body: dict[str, Any], latency_s: float, request_id: str) -> Completion:
    choice = body["choices"][0]
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    reasoning_tokens = usage.get("reasoning_tokens", completion_details.get("reasoning_tokens"))
    return Completion(
        content=message.get("content") or "",
        reasoning_content=message.get("reasoning_content"),
        finish_reason=choice.get("finish_reason") or "unknown",
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=details.get("cached_tokens"),
        reasoning_tokens=reasoning_tokens,
        model=body.get("model", ""),
        weight_version=(body.get("metadata") or {}).get("weight_version"),
        latency_s=latency_s,
        request_id=request_id,
    )


class EndpointClient:
    """Async client of one endpoint. Raises only classes of the error taxonomy."""

    def __init__(self, url: str, label: str, settings: ClientSettings, api_key: str | None = None):
        self.url, self.label, self.settings = url, label, settings
        self._api_key = api_key
        self._openai = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=settings.timeout_s
        )
        self._http: aiohttp.ClientSession | None = None

    async def chat(self, messages: list[dict[str, str]], seed: int | None) -> Completion:
        s = self.settings
        rid = uuid.uuid4().hex  # fresh on every attempt: SGLang refuses a rid that is still running
        extra: dict[str, Any] = {"rid": rid}
        if s.chat_template_kwargs:
            extra["chat_template_kwargs"] = s.chat_template_kwargs
        started = time.monotonic()
        try:
            raw = await self._openai.chat.completions.with_raw_response.create(
                model=s.model,
                messages=messages,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                seed=seed,
                extra_body=extra,
            )
            body = orjson.loads(raw.content)
        except openai.APIStatusError as exc:
            raise classify(exc.status_code, _error_message(exc.body, exc.message), self.label) from None
        except openai.APITimeoutError:
            raise Retryable(f"no progress within {s.timeout_s:.0f}s", endpoint=self.label) from None
        except openai.APIConnectionError as exc:
            raise classify(None, f"connection failed: {exc.__cause__ or exc}", self.label) from None
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise Retryable(f"unreadable response: {exc}", endpoint=self.label) from None
        try:
            completion = parse_chat(body, time.monotonic() - started, body.get("id") or rid)
        except (KeyError, IndexError, TypeError) as exc:
            raise Retryable(f"malformed response ({exc!r})", endpoint=self.label) from None
        if completion.finish_reason == "abort":
            raise Retryable("the server aborted the request", endpoint=self.label)
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
        session = self._session()
        try:
            async with session.post(self.url + path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                payload = await resp.read()
                try:
                    return resp.status, orjson.loads(payload) if payload else None
                except orjson.JSONDecodeError:
                    return resp.status, payload.decode(errors="replace")
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
