"""The HTTP connections of the endpoint client: how long an idle one is kept, how many are kept."""
from __future__ import annotations

from typing import Any

# SGLang (SGLANG_TIMEOUT_KEEP_ALIVE) and vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) close a connection idle for 5 s; the
# SDK's pool kept one for 5 s too, so a request could go out on a connection the server was closing ("server
# disconnected": a dropped request). An idle connection is given up well before the server's 5 s; the pool keeps
# as many as `concurrency: auto` may hold in flight (the SDK's default kept 100).
KEEPALIVE_EXPIRY_S = 2.0
KEEPALIVE_CONNECTIONS = 1024


def connection_limits() -> Any:
    """The SDK's own connection limits (its httpx's Limits class, whichever its version uses), with ours."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    return type(DEFAULT_CONNECTION_LIMITS)(max_connections=max(1000, KEEPALIVE_CONNECTIONS),
                                           max_keepalive_connections=KEEPALIVE_CONNECTIONS,
                                           keepalive_expiry=KEEPALIVE_EXPIRY_S)
