"""The engine-adapter seam: what one inference engine (and version) names or does differently.

The client, the probes and the capture route ask the endpoint's adapter; none of them tests an engine or a
version. `OpenAIAdapter` is the engine-neutral base, used until the preflight has identified the server (and for
a server it cannot identify): it reads every known spelling of a field and asks for nothing an unknown server
could misread. Engines subclass it: `sglang.SGLangAdapter` (by version); a vLLM and a llama.cpp adapter sit
beside it. Adapters are small frozen dataclasses: they travel to the Ray actors inside the client settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """Every sampling parameter a request carries, sent explicitly: the chat route of SGLang fills an unset one
    from the model's generation_config, /generate does not, so only explicit values mean the same everywhere."""

    temperature: float
    top_p: float
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def fields(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}


@dataclass(frozen=True)
class StreamIds:
    prompt_ids: list[int] | None
    output_ids: list[int] | None


@dataclass(frozen=True)
class OpenAIAdapter:
    """An OpenAI-compatible server of unknown make."""

    engine: str = "openai"
    version: str | None = None
    # From the server's launch arguments where it reports them; None: unknown.
    deterministic: bool | None = None

    # --- what the server can do ------------------------------------------------------------------
    @property
    def returns_output_ids(self) -> bool | None:
        """Whether a chat answer can carry the output token ids (None: unknown until a probe shows it)."""
        return None

    @property
    def stream_ids(self) -> bool:
        """Whether a stream can carry the token ids."""
        return False

    @property
    def stream_weight_version(self) -> bool:
        """Whether a stream names the weight version that produced it (without it, pinning is off)."""
        return False

    def info_paths(self, kind: str) -> tuple[str, ...]:
        """The paths of an information endpoint ("server" or "model"), preferred first."""
        return (f"/{kind}_info", f"/get_{kind}_info")

    # --- requests --------------------------------------------------------------------------------
    def chat_extras(self, *, want_ids: bool, stream: bool) -> dict[str, Any]:
        """The non-OpenAI fields of a chat request that asks for token ids (`want_ids`)."""
        if want_ids and not stream:
            return {"return_token_ids": True, "return_prompt_token_ids": True}
        return {}

    def generate_sampling(self, sampling: Sampling, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        """`sampling_params` of a native /generate request."""
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, **sampling.fields()}
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    # --- answers ---------------------------------------------------------------------------------
    def output_ids(self, choice: dict[str, Any]) -> list[int] | None:
        ids = choice.get("response_token_ids")
        return ids if ids is not None else choice.get("token_ids")

    def prompt_ids(self, body: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        ids = choice.get("prompt_token_ids")
        return ids if ids is not None else body.get("prompt_token_ids")

    def stream_chunk_ids(self, chunk: dict[str, Any]) -> StreamIds | None:
        """The token ids a stream chunk carries, if any (SGLang: the final `sglext` chunk)."""
        ext = chunk.get("sglext")
        if not isinstance(ext, dict) or (ext.get("input_ids") is None and ext.get("output_ids") is None):
            return None
        outputs = ext.get("output_ids")
        return StreamIds(ext.get("input_ids"), outputs[0] if isinstance(outputs, list) and outputs else None)

    def weight_versions(self, metadata: dict[str, Any] | None) -> list[str]:
        """The distinct weight versions that produced an answer, in order (SGLang's `weight_versions` spans;
        else its single `weight_version`). Two or more: the weights changed while it was generated."""
        if not isinstance(metadata, dict):
            return []
        spans = metadata.get("weight_versions")
        names: list[str] = []
        if isinstance(spans, list):
            for span in spans:
                version = span.get("version") if isinstance(span, dict) else None
                if version is not None and str(version) not in names:
                    names.append(str(version))
        if not names and metadata.get("weight_version") is not None:
            names.append(str(metadata["weight_version"]))
        return names

    # --- the preflight ---------------------------------------------------------------------------
    def describe(self) -> str:
        return self.engine + (f" {self.version}" if self.version else "")
