"""The one place that reads a server's error text: `classify` maps an HTTP status and the server's message to a
class of the error taxonomy (core/errors.py), with the texts each engine's adapter lists; nothing else in regen
looks at error strings. Also what a lost connection, an error body and an exception outside the taxonomy are."""
from __future__ import annotations

import errno
import socket
from typing import Any

import aiohttp
import orjson

from ..core.errors import (
    RETRYABLE_STATUS, ConnectionDropped, ContractError, EndpointDown, EndpointFatal, RequestError, Retryable,
    TerminalForPrompt, Unexpected,
)
from .engines import OpenAIAdapter, error_texts

# Any engine: a 400 that names a model that does not exist (SGLang: "The model 'X' does not exist"; vLLM says so
# with a 404) is the endpoint's fault, not the prompt's.
_MODEL_MISSING = "does not exist"


def classify(status: int | None, message: str, endpoint: str = "", *, dropped: bool = False,
             engine: OpenAIAdapter | None = None) -> RequestError:
    """Map an HTTP status and the server's message to the error class that decides what happens.
    No status: the endpoint did not answer; `dropped` says the connection was lost after the request was sent.
    A 400's text is read with the endpoint's engine's error texts (every engine's while it is unknown)."""
    text = message.lower()
    kwargs = {"status": status, "endpoint": endpoint}
    if status is None:
        return ConnectionDropped(message, **kwargs) if dropped else EndpointDown(message, **kwargs)
    if status == 400:
        texts = error_texts(engine)
        if any(marker in text for marker in texts.retry):
            return Retryable(message, **kwargs)  # the retry gets a fresh request id
        if any(marker in text for marker in texts.contract):
            return ContractError(f"every request to this endpoint would be refused: {message}", **kwargs)
        if any(marker in text for marker in texts.endpoint_fatal) or ("model" in text and _MODEL_MISSING in text):
            return EndpointFatal(message, **kwargs)
        if any(marker in text for marker in texts.context_overflow):
            return TerminalForPrompt(f"context overflow: {message}", **kwargs)
        return TerminalForPrompt(f"invalid request: {message}", **kwargs)
    if status in (401, 403, 404):
        return EndpointFatal(message, **kwargs)
    if status in RETRYABLE_STATUS or status >= 500:
        return Retryable(message, **kwargs)
    return TerminalForPrompt(message, **kwargs)


def classify_stream_error(error: Any, endpoint: str = "", engine: OpenAIAdapter | None = None) -> RequestError:
    """An error SGLang raises after the first chunk arrives as an SSE event (serving_base.py,
    create_streaming_error_response): `data: {"error": {"object": "error", "message": ..., "type": ...,
    "param": null, "code": N}}`, N being the HTTP status it stands for (400 for a request it refuses, the abort's
    status otherwise). It is classified like an answer with that status; an event without a code as a 500."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    status = code if isinstance(code, int) and not isinstance(code, bool) and 100 <= code < 600 else 500
    return classify(status, error_message({"error": error}, f"an error event in the stream: {error!r}"), endpoint,
                    engine=engine)


def unexpected(exc: BaseException, endpoint: str = "") -> Unexpected:
    """An exception outside the taxonomy, named by its type and message: it becomes an outcome, never silence."""
    return Unexpected(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, endpoint=endpoint)


_NO_ROUTE = {errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}


def was_dropped(exc: BaseException) -> bool:
    """Was the connection lost after the request went out? One that was refused, or had no route or no address,
    never reached the server. Told by the exception chain's types (the HTTP library wraps the socket's error)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (aiohttp.ClientConnectorError, socket.gaierror, ConnectionRefusedError)):
            return False
        if isinstance(exc, OSError) and exc.errno in _NO_ROUTE:
            return False
        exc = exc.__cause__ or exc.__context__
    return True


def parse_body(payload: bytes) -> Any:
    """A body as JSON, or as text when it is not (a proxy's HTML page, a torn answer): never an exception."""
    try:
        return orjson.loads(payload) if payload else None
    except orjson.JSONDecodeError:
        return payload.decode(errors="replace")


def error_message(body: Any, fallback: str) -> str:
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
