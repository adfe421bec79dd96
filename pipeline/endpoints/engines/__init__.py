"""Engine adapters: one per inference engine, holding what it (and each of its versions) does differently.
The client and the probes ask the adapter; nothing else tests an engine or a version (see base.py).

    engine_for(models_body, server_info) -> the adapter for what the preflight found
"""
from __future__ import annotations

from typing import Any

from .base import OpenAIAdapter, Sampling, StreamIds
from .sglang import SGLangAdapter

__all__ = ["OpenAIAdapter", "SGLangAdapter", "Sampling", "StreamIds", "engine_for"]


def engine_for(models_body: Any, server_info: dict[str, Any] | None) -> OpenAIAdapter:
    """SGLang when its server_info answers (or /v1/models says `owned_by: sglang`); else the neutral adapter."""
    owners = {m.get("owned_by") for m in (models_body or {}).get("data", []) if isinstance(m, dict)} \
        if isinstance(models_body, dict) else set()
    if isinstance(server_info, dict):
        return SGLangAdapter.from_server_info(server_info)
    if "sglang" in owners:
        return SGLangAdapter()
    return OpenAIAdapter()
