"""Engine adapters: one per inference engine, holding what it (and each of its versions) does differently.
The client and the probes ask the adapter; nothing else tests an engine or a version (see base.py).

    identity_path(models_body) -> the path that names the engine's version (/version, /props), if any
    engine_for(models_body, server_info, identity) -> the adapter for what the preflight found
"""
from __future__ import annotations

from typing import Any

from .base import ErrorTexts, OpenAIAdapter, Sampling, StreamIds
from .llamacpp import LlamaCppAdapter
from .sglang import SGLangAdapter
from .vllm import VLLMAdapter

__all__ = ["ErrorTexts", "LlamaCppAdapter", "OpenAIAdapter", "SGLangAdapter", "Sampling", "StreamIds",
           "VLLMAdapter", "engine_for", "error_texts", "identity_path", "owners"]

ENGINES = (SGLangAdapter, VLLMAdapter, LlamaCppAdapter)


def error_texts(engine: OpenAIAdapter | None) -> ErrorTexts:
    """The error texts the classifier reads for an endpoint: its engine's, or every engine's while (or where) the
    engine is unknown."""
    if engine is not None and type(engine) is not OpenAIAdapter:
        return engine.error_texts
    joined = ErrorTexts()
    for adapter in ENGINES:
        joined = joined + adapter().error_texts
    return joined


def owners(models_body: Any) -> set[str]:
    """The `owned_by` values of /v1/models."""
    if not isinstance(models_body, dict):
        return set()
    return {str(m.get("owned_by")) for m in models_body.get("data") or [] if isinstance(m, dict) and m.get("owned_by")}


def identity_path(models_body: Any) -> str | None:
    """Where the engine /v1/models names tells its version: vLLM's /version, llama.cpp's /props (SGLang's is in
    /server_info, read anyway)."""
    found = owners(models_body)
    return "/version" if "vllm" in found else ("/props" if "llamacpp" in found else None)


def engine_for(models_body: Any, server_info: dict[str, Any] | None, identity: Any = None) -> OpenAIAdapter:
    """vLLM for `owned_by: vllm` (its version from /version: a vLLM with VLLM_SERVER_DEV_MODE=1 answers
    /server_info too, with {vllm_config, vllm_env, system_env}), llama.cpp for `owned_by: llamacpp` (`identity`:
    the body of identity_path), SGLang when /server_info answers with SGLang's own keys (or /v1/models says
    `owned_by: sglang`); else the neutral adapter."""
    found = owners(models_body)
    if "vllm" in found:
        return VLLMAdapter.from_version(identity)
    if "llamacpp" in found:
        return LlamaCppAdapter.from_props(identity)
    if SGLangAdapter.is_server_info(server_info):
        return SGLangAdapter.from_server_info(server_info)
    if "sglang" in found:
        return SGLangAdapter()
    return OpenAIAdapter()
