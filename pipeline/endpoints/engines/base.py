"""The engine-adapter seam: what one inference engine (and version) names or does differently.

The client, the probes and the capture route ask the endpoint's adapter; none of them tests an engine or a
version. `OpenAIAdapter` is the engine-neutral base, used until the preflight has identified the server (and for
a server it cannot identify): it reads every known spelling of a field and asks for nothing an unknown server
could misread. Engines subclass it: `sglang.SGLangAdapter` (by version), `vllm.VLLMAdapter` and
`llamacpp.LlamaCppAdapter`. Each also names its own error texts (`ErrorTexts`), which the one classifier
(classify.classify) reads. Adapters are small frozen dataclasses: they travel to the Ray actors inside the client
settings.
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
    """The ids one stream chunk carries: the prompt's, and output ids to append (SGLang sends all of them in
    one final chunk, vLLM a few in every chunk)."""

    prompt_ids: list[int] | None
    output_ids: list[int] | None


@dataclass(frozen=True)
class ErrorTexts:
    """Lower-case fragments of one engine's 400 messages, by what they mean to the classifier."""

    context_overflow: tuple[str, ...] = ()  # the prompt (or prompt + max_tokens) exceeds the context
    retry: tuple[str, ...] = ()  # a fresh attempt may pass (e.g. a request id still running)
    endpoint_fatal: tuple[str, ...] = ()  # the endpoint cannot serve this run (launch flags, model name)
    contract: tuple[str, ...] = ()  # the endpoint refuses the shape of every request regen sends it

    def __add__(self, other: "ErrorTexts") -> "ErrorTexts":
        return ErrorTexts(self.context_overflow + other.context_overflow, self.retry + other.retry,
                          self.endpoint_fatal + other.endpoint_fatal, self.contract + other.contract)


@dataclass(frozen=True)
class OpenAIAdapter:
    """An OpenAI-compatible server of unknown make."""

    engine: str = "openai"
    version: str | None = None
    # From the server's launch arguments where it reports them; None: unknown.
    deterministic: bool | None = None

    @property
    def error_texts(self) -> ErrorTexts:
        """The texts of this engine's errors (the neutral adapter: none; engines/__init__ joins every engine's)."""
        return ErrorTexts()

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
    @property
    def request_id_field(self) -> str:
        """The request field naming the request id regen chose (SGLang's `rid`)."""
        return "rid"

    def chat_extras(self, *, want_ids: bool, stream: bool) -> dict[str, Any]:
        """The non-OpenAI fields of a chat request that asks for token ids (`want_ids`)."""
        if want_ids and not stream:
            return {"return_token_ids": True, "return_prompt_token_ids": True}
        return {}

    # --- answers ---------------------------------------------------------------------------------
    def output_ids(self, choice: dict[str, Any]) -> list[int] | None:
        ids = choice.get("response_token_ids")
        return ids if ids is not None else choice.get("token_ids")

    @property
    def reasoning_field(self) -> str:
        return "reasoning_content"

    def reasoning(self, message: dict[str, Any]) -> str | None:
        """The reasoning a message (or stream delta) carries: `reasoning_content` (SGLang) or `reasoning` (vLLM)."""
        value = message.get("reasoning_content")
        return value if value is not None else message.get("reasoning")

    def prompt_ids(self, body: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        ids = choice.get("prompt_token_ids")
        return ids if ids is not None else body.get("prompt_token_ids")

    def stream_chunk_ids(self, chunk: dict[str, Any]) -> StreamIds | None:
        """The token ids a stream chunk carries, if any: SGLang's final `sglext` chunk, or vLLM's ids per chunk."""
        return self._sglext_ids(chunk) or self._per_chunk_ids(chunk)

    @staticmethod
    def _per_chunk_ids(chunk: dict[str, Any]) -> StreamIds | None:
        """vLLM: the prompt ids at the top level of the first chunk, each chunk's new ids in its choice."""
        pieces = [c.get("token_ids") for c in chunk.get("choices") or [] if isinstance(c, dict)]
        output = [i for piece in pieces if isinstance(piece, list) for i in piece]
        prompt = chunk.get("prompt_token_ids")
        if prompt is None and not any(isinstance(piece, list) for piece in pieces):
            return None
        return StreamIds(prompt, output)

    @staticmethod
    def _sglext_ids(chunk: dict[str, Any]) -> StreamIds | None:
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

    def context_fix(self, needed: int) -> str:
        """How to give the server a context of `needed` tokens."""
        return f"launch it with a context of {needed} tokens or more"

    def version_warning(self) -> str | None:
        return None

    def tool_calls_fix(self) -> str:
        """How to launch the server so that it returns the model's calls in `tool_calls`."""
        return "launch it with its tool-call parser on, so that it returns the model's calls in tool_calls"

    # --- images ------------------------------------------------------------------------------------
    @property
    def takes_images(self) -> bool | None:
        """Whether the engine can take image parts at all: False never (the preflight refuses an image prompt set
        at once); None: the server says (SGLang's /model_info) or a tiny image probe shows it."""
        return None

    def image_url_extras(self, sha256: str) -> dict[str, Any]:
        """The fields of a request's `image_url` object beside `url`, for an image of this sha256 (SGLang's
        `content_hash` where its version declares it); none for an engine that declares none."""
        return {}

    def images_fix(self) -> str:
        """How to launch the server so that it takes the prompt set's images."""
        return "serve a vision-language model on it (one that takes image_url parts)"
