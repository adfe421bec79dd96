"""Which engine an endpoint runs, from its information endpoints: /v1/models (`owned_by`), /server_info (and
/model_info: SGLang's, falling back to the deprecated /get_* aliases) and the identity path the engine names
(vLLM's /version, llama.cpp's /props). The probes (probes.py) and the tools that need the engine but not the
whole preflight (bench-endpoints) read it here."""
from __future__ import annotations

import asyncio
from typing import Any

from ..core.errors import EndpointDown
from .client import EndpointClient
from .engines import OpenAIAdapter, engine_for, identity_path

INFO_TIMEOUT_S = 5.0  # each information endpoint


async def get_info(client: EndpointClient, path: str, timeout_s: float) -> tuple[int, Any] | EndpointDown:
    try:
        return await client.get_json(path, timeout_s=timeout_s)
    except EndpointDown as exc:
        return exc


async def info_path(client: EndpointClient, kind: str,
                    timeout_s: float) -> tuple[str, tuple[int, Any] | EndpointDown]:
    """An information endpoint by its current path, else its deprecated alias (which 0.5.23 logs a warning
    for on every call): (the path that answered, its result)."""
    paths = client.engine.info_paths(kind)
    for path in paths:
        result = await get_info(client, path, timeout_s)
        if isinstance(result, EndpointDown) or result[0] != 404 or path == paths[-1]:
            return path, result
    raise AssertionError("unreachable")


async def identify(client: EndpointClient, timeout_s: float = INFO_TIMEOUT_S) -> OpenAIAdapter:
    """The endpoint's engine adapter from /v1/models, /server_info and the engine's identity path, set on the
    client (for tools that need the engine but not the whole preflight, e.g. bench-endpoints)."""
    models, (_, info) = await asyncio.gather(get_info(client, "/v1/models", timeout_s),
                                          info_path(client, "server", timeout_s))
    body = models[1] if not isinstance(models, EndpointDown) and models[0] == 200 else None
    server_info = info[1] if not isinstance(info, EndpointDown) and info[0] == 200 else None
    identity, path = None, identity_path(body)
    if path is not None:
        result = await get_info(client, path, timeout_s)
        identity = result[1] if not isinstance(result, EndpointDown) and result[0] == 200 else None
    client.engine = engine_for(body, server_info if isinstance(server_info, dict) else None, identity)
    return client.engine


def read_sglang_info(report: Any, model_info: dict | None, server_info: dict | None) -> dict | None:
    """What SGLang's /model_info and /server_info tell, onto `report` (an EndpointReport); returns the
    server_info (None if it did not answer)."""
    if model_info is not None:
        report.model_path = model_info.get("model_path") or None
        report.preferred_sampling = model_info.get("preferred_sampling_params")
        report.weight_version = model_info.get("weight_version") or report.weight_version
        if "reasoning_parser" in model_info:
            report.reasoning_parser = model_info.get("reasoning_parser")
        if isinstance(model_info.get("has_image_understanding"), bool):  # every checked version (http_server.py)
            report.images = model_info["has_image_understanding"]
    if server_info is None:
        return None
    info = server_info
    report.sglang_version = str(info["version"]) if info.get("version") is not None else None
    report.speculative_algorithm = info.get("speculative_algorithm")
    report.reasoning_parser = info.get("reasoning_parser", report.reasoning_parser)
    if "tool_call_parser" in info:
        report.tool_call_parser = info["tool_call_parser"] or "none"
    report.model_path = report.model_path or info.get("model_path") or None
    report.weight_version = report.weight_version or info.get("weight_version") or None
    if report.context is None and isinstance(info.get("context_length"), int):
        report.context = info["context_length"]
    return info
