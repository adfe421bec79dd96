"""The HTTP connections of the endpoint client: how long an idle one is kept, how many are kept."""
from __future__ import annotations

from typing import Any

from ..core.config_sections import MAX_CONCURRENCY

# SGLang (SGLANG_TIMEOUT_KEEP_ALIVE) and vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) close a connection idle for 5 s; the
# SDK's pool kept one for 5 s too, so a request could go out on a connection the server was closing ("server
# disconnected": a dropped request). An idle connection is given up well before the server's 5 s, by the SDK's
# pool and by the aiohttp session of /health, /metrics, /server_info and the probes alike. The SDK's pool holds as
# many connections as the endpoint may have requests in flight (its default kept 100, at most 1000 open): a
# request past the pool's size would wait in it, counted in flight by regen but not sent.
KEEPALIVE_EXPIRY_S = 2.0


def connection_limits(max_in_flight: int = MAX_CONCURRENCY) -> Any:
    """The SDK's own connection limits (its httpx's Limits class, whichever its version uses): a connection for
    each request the endpoint may have in flight (`concurrency`, or auto's `concurrency_cap`)."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    # never fewer than the SDK's own 1000 open: a cancelled request's connection may still be closing
    return type(DEFAULT_CONNECTION_LIMITS)(max_connections=max(DEFAULT_CONNECTION_LIMITS.max_connections or 0,
                                                               max_in_flight),
                                           max_keepalive_connections=max_in_flight,
                                           keepalive_expiry=KEEPALIVE_EXPIRY_S)
