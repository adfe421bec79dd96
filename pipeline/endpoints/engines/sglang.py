"""SGLang, by version: every difference regen depends on, read from SGLang's own wheels (0.5.14, 0.5.17,
0.5.18, 0.5.23; tests/test_sglang_conformance.py checks each against that version's code).

| what                                   | 0.5.14 | 0.5.17      | 0.5.18+              | 0.5.23                    |
|----------------------------------------|--------|-------------|----------------------|---------------------------|
| chat `return_prompt_token_ids`         | yes    | yes         | yes                  | yes                       |
| chat `return_token_ids`, output ids in | -      | `token_ids` | `response_token_ids` | `response_token_ids`      |
| stream ids (`return_*_ids_in_sglext`)  | -      | -           | -                    | final `sglext` chunk      |
| `metadata.weight_versions` spans       | -      | -           | -                    | yes                       |
| `/generate` sampling_params contract   | -      | -           | -                    | unknown field: 400        |
| chat `image_url.content_hash`          | -      | -           | yes                  | yes                       |
| image parts to a text-only model: 400  | -      | yes         | yes                  | yes                       |
`/server_info` and `/model_info` exist in all four; 0.5.23 logs a deprecation warning on every call to the
`/get_*` aliases. Stream chunks never carry a weight version. Every version's /model_info says
`has_image_understanding` (http_server.py; from model_config.is_image_understandable_model: the checkpoint has a
vision tower and multimodal is on, and from 0.5.18 the server does not run language-only; 0.5.23's
--language-model-only turns it off). `content_hash` is `sha256:<hex>` of the image's bytes as the server reads them
(0.5.23 multimodal/cache/identity.py snapshot_media: the decoded bytes of a data: URL, a file's bytes); a version
without the field ignores it unread (pydantic's default), so it is sent only where declared.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from .base import ErrorTexts, OpenAIAdapter

CHECKED_VERSIONS = ("0.5.14", "0.5.17", "0.5.18", "0.5.23")
OUTPUT_IDS_FROM = (0, 5, 17)  # return_token_ids
RESPONSE_TOKEN_IDS_FROM = (0, 5, 18)  # renamed from token_ids
STREAM_IDS_FROM = (0, 5, 23)  # return_input_ids_in_sglext / return_output_ids_in_sglext
CONTENT_HASH_FROM = (0, 5, 18)  # ChatCompletionMessageContentImageURL.content_hash
SERVER_INFO_KEYS = frozenset({"model_path", "tp_size"})  # ServerArgs fields every version's /server_info has

# Its 400 texts, read out of each checked version's wheel by tests/test_sglang_conformance.py: a renamed message
# fails there.
ERRORS = ErrorTexts(
    context_overflow=(
        "is longer than the model's context length",  # tokenizer_manager: the prompt alone is too long
        "exceeds the model's maximum context length",  # tokenizer_manager: prompt + max_tokens too long
        "exceeds the maximum allowed length",  # managers/utils.py (scheduler): "Input length (N tokens) ..."
    ),
    # 400s every request regen sends this endpoint would get, whatever the prompt: its version or its launch
    # refuses the request's shape (ContractError: the endpoint leaves the fleet, the prompt goes elsewhere).
    contract=(
        "max_completion_tokens is too large",  # serving_chat: the run's max_tokens alone above the context
        "is not supported with streaming",  # serving_chat: return_token_ids / return_prompt_token_ids on a stream
        "unknown field `",  # 0.5.23 api/v1/api_types.py (serde's text): a field the version does not declare
        "model only supports text input",  # 0.5.17+ serving_chat: image parts to a model that is not multimodal
    ),
    retry=("duplicate request id",),  # the retry gets a fresh rid
)


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    """"0.5.23" -> (0, 5, 23); a suffix such as "rc1" or ".post1" is ignored. None: no version."""
    if not version:
        return None
    numbers = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        numbers.append(int(digits or 0))
    return tuple(numbers)


@dataclass(frozen=True)
class SGLangAdapter(OpenAIAdapter):
    engine: str = "sglang"

    @staticmethod
    def is_server_info(info: Any) -> bool:
        """SGLang's /server_info: its ServerArgs (model_path, tp_size, ...) and its version, unlike vLLM's dev-mode
        /server_info ({vllm_config, vllm_env, system_env})."""
        return isinstance(info, dict) and SERVER_INFO_KEYS <= info.keys()

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> "SGLangAdapter":
        version = info.get("version")
        deterministic = info.get("enable_deterministic_inference")
        return cls(version=str(version) if version is not None else None,
                   deterministic=deterministic if isinstance(deterministic, bool) else None)

    @property
    def error_texts(self) -> ErrorTexts:
        return ERRORS

    def reasoning(self, message: dict[str, Any]) -> str | None:
        return message.get("reasoning_content")

    def stream_chunk_ids(self, chunk: dict[str, Any]):
        return self._sglext_ids(chunk)

    def _at_least(self, floor: tuple[int, ...]) -> bool:
        version = version_tuple(self.version)
        return version is not None and version >= floor

    @property
    def checked(self) -> bool:
        """Within the range regen was checked against (a version between two checked ones counts)."""
        version = version_tuple(self.version)
        return version is not None and version_tuple(CHECKED_VERSIONS[0]) <= version <= version_tuple(
            CHECKED_VERSIONS[-1])

    # --- capabilities ----------------------------------------------------------------------------
    @property
    def returns_output_ids(self) -> bool | None:
        return None if self.version is None else self._at_least(OUTPUT_IDS_FROM)

    @property
    def output_ids_field(self) -> str | None:
        if not self.returns_output_ids:
            return None
        return "response_token_ids" if self._at_least(RESPONSE_TOKEN_IDS_FROM) else "token_ids"

    @property
    def stream_ids(self) -> bool:
        return self._at_least(STREAM_IDS_FROM)

    # --- requests --------------------------------------------------------------------------------
    def chat_extras(self, *, want_ids: bool, stream: bool) -> dict[str, Any]:
        if not want_ids:
            return {}
        if stream:  # token ids are refused on a stream; the final sglext chunk carries them instead
            return {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True} if self.stream_ids \
                else {}
        extras: dict[str, Any] = {"return_prompt_token_ids": True}
        if self.returns_output_ids is not False:  # a field the version does not declare would be ignored
            extras["return_token_ids"] = True
        return extras

    # --- answers ---------------------------------------------------------------------------------
    def output_ids(self, choice: dict[str, Any]) -> list[int] | None:
        if self.version is None:  # unknown version: either spelling
            return super().output_ids(choice)
        field = self.output_ids_field
        return choice.get(field) if field else None

    # --- the preflight ---------------------------------------------------------------------------
    def output_ids_problem(self) -> str | None:
        """The refusal when the run needs output ids (return_token_ids, the default) and this version has none."""
        if self.returns_output_ids is not False:  # None: an unknown version is probed instead
            return None
        return (f"SGLang {self.version} returns no output token ids (return_token_ids exists from SGLang 0.5.17 "
                "on; 0.5.18+ answers in choices[0].response_token_ids): upgrade the server to 0.5.17 or later, "
                "or set `return_token_ids: false` to run without exact token ids")

    def tool_calls_fix(self) -> str:
        return "launch it with --tool-call-parser NAME (kimi_k2 for Kimi-K2.5)"

    def image_url_extras(self, sha256: str) -> dict[str, Any]:
        return {"content_hash": f"sha256:{sha256}"} if self._at_least(CONTENT_HASH_FROM) else {}

    def images_fix(self) -> str:
        return ("serve a vision-language model (Kimi-K2.5 takes images), without --language-model-only; a model whose "
                "multimodal SGLang turns off by default needs --enable-multimodal")

    def context_fix(self, needed: int) -> str:
        return f"launch with --context-length {needed} or more"

    def stream_ids_problem(self) -> str | None:
        """The refusal when the run streams and needs token ids, and this version sends none on a stream."""
        if self.stream_ids:
            return None
        who = (f"SGLang {self.version} sends no token ids on a stream" if self.version else
               "the server reports no SGLang version, so regen cannot tell that its stream carries token ids")
        return (f"{who} (0.5.23 sends them in the final sglext chunk): set `stream: false`, upgrade the server, or "
                "set `return_token_ids: false`")

    def version_warning(self) -> str | None:
        if self.version is None:
            return ("the server reports no SGLang version: regen reads either spelling of the output ids, asks for "
                    "none on a stream, and gives 0.5.23's launch flags")
        if not self.checked:
            return (f"SGLang {self.version} is outside the versions regen was checked against "
                    f"({CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]})")
        return None

    def seed_warning(self, temperature: float) -> str | None:
        if temperature <= 0 or self.deterministic:
            return None
        state = "runs without it" if self.deterministic is False else "does not say whether it runs with it"
        return ("SGLang ignores seed and sampling_seed unless launched with --enable-deterministic-inference; this "
                f"server {state}, so its records are not reproducible from their seed (each record says so in "
                "`deterministic`)")
