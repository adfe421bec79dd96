"""SGLang, by version: every difference regen depends on, read from SGLang's own wheels (0.5.14, 0.5.17,
0.5.18, 0.5.23; tests/test_sglang_conformance.py checks each against that version's code).

| what                                   | 0.5.14 | 0.5.17      | 0.5.18+              | 0.5.23                    |
|----------------------------------------|--------|-------------|----------------------|---------------------------|
| chat `return_prompt_token_ids`         | yes    | yes         | yes                  | yes                       |
| chat `return_token_ids`, output ids in | -      | `token_ids` | `response_token_ids` | `response_token_ids`      |
| stream ids (`return_*_ids_in_sglext`)  | -      | -           | -                    | final `sglext` chunk      |
| `--return-hidden-states-mode`          | -      | yes         | yes                  | yes                       |
| aux layers                             | EAGLE3 speculative decoding (a draft)  || `--enable-return-aux-hidden-states`, no draft |
| `metadata.weight_versions` spans       | -      | -           | -                    | yes                       |
| `/generate` sampling_params contract   | -      | -           | -                    | unknown field: 400        |
`/server_info` and `/model_info` exist in all four; 0.5.23 logs a deprecation warning on every call to the
`/get_*` aliases. Stream chunks never carry a weight version.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from .base import ErrorTexts, OpenAIAdapter

CHECKED_VERSIONS = ("0.5.14", "0.5.17", "0.5.18", "0.5.23")
OUTPUT_IDS_FROM = (0, 5, 17)  # return_token_ids
RESPONSE_TOKEN_IDS_FROM = (0, 5, 18)  # renamed from token_ids
HIDDEN_MODE_FROM = (0, 5, 17)  # --return-hidden-states-mode {last,full}
STREAM_IDS_FROM = (0, 5, 23)  # return_input_ids_in_sglext / return_output_ids_in_sglext
AUX_WITHOUT_DRAFT_FROM = (0, 5, 23)  # --enable-return-aux-hidden-states, aux_hidden_state_capture
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
    ),
    retry=("duplicate request id",),  # the retry gets a fresh rid
    endpoint_fatal=(
        "not configured to return hidden states",  # 0.5.17+ (the flags it names differ by version)
        "not configured to return the hidden states",  # 0.5.14
        "return_hidden_states mode exceeds the server maximum",  # 0.5.17+: `True` asked of a `last` server
    ),
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

    @property
    def aux_without_draft(self) -> bool:
        return self._at_least(AUX_WITHOUT_DRAFT_FROM)

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

    @staticmethod
    def hidden_states_on(info: dict[str, Any]) -> bool:
        """`--enable-return-hidden-states`, `--return-hidden-states-mode full`, or aux capture (which sets the
        mode to full)."""
        return bool(info.get("enable_return_hidden_states") or info.get("return_hidden_states_mode") == "full"
                    or info.get("aux_hidden_state_capture") or info.get("enable_return_aux_hidden_states"))

    def aux_capture(self, info: dict[str, Any]) -> str | None:
        """Which auxiliary layers the vectors hold ("eagle3"), None for the last layer only."""
        if info.get("aux_hidden_state_capture"):  # 0.5.23: speculative_algorithm was reset to None
            return str(info["aux_hidden_state_capture"]).lower()
        if (info.get("speculative_algorithm") or "").upper() == "EAGLE3":  # the EAGLE3 draft captures them
            return "eagle3"
        return None

    def aux_flags(self) -> str:
        """The launch flags that give EAGLE-3's auxiliary layers on this version."""
        if self.aux_without_draft or self.version is None:
            return ("--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 (SGLang 0.5.23 captures "
                    "them without a draft: leave out --speculative-draft-model-path)")
        return (f"--speculative-algorithm EAGLE3 with an EAGLE-3 draft (--speculative-draft-model-path); SGLang "
                f"{self.version} has no --enable-return-aux-hidden-states (0.5.23 captures them without a draft)")

    def aux_problem(self, info: dict[str, Any], expected_width: int, layer_width: int) -> str | None:
        """The seed's case, read from the launch arguments: EAGLE-3 data needs the three auxiliary layers
        (expected_width = 3 x layer_width), and a server with EAGLE instead of EAGLE3 (or no aux capture)
        returns one layer."""
        if expected_width != 3 * layer_width or self.aux_capture(info):
            return None
        algorithm = info.get("speculative_algorithm")
        running = (f"--speculative-algorithm {algorithm} instead of EAGLE3" if algorithm
                   else "no auxiliary-layer capture")
        return (f"the server runs {running} (it reports speculative_algorithm: {algorithm}, no aux capture): its "
                f"hidden states are one layer ({layer_width} wide), not EAGLE-3's three auxiliary layers "
                f"({expected_width}). Launch it with {self.aux_flags()}")

    def capture_problem(self, info: dict[str, Any], wanted: list[int] | None = None) -> str | None:
        """An aux capture that is not EAGLE3's layers: EAGLE3 with its default layer ids, or `wanted` (the run's
        hidden_states.aux_layer_ids). 0.5.23 also captures DFLASH's or DSPARK's layers, or other ids, at a width
        the probe cannot tell apart."""
        capture = self.aux_capture(info)
        if not capture:
            return None
        served = info.get("return_aux_hidden_state_layer_ids")
        served = list(served) if isinstance(served, (list, tuple)) else None
        layers = f"layers {served}" if served is not None else "the default layers"
        if capture != "eagle3":
            return (f"the server captures {capture.upper()}'s auxiliary hidden states ({layers}; it reports "
                    f"aux_hidden_state_capture: {capture}), not EAGLE3's: EAGLE-3 training data needs "
                    f"--enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
                    + (f" --return-aux-hidden-state-layer-ids {' '.join(map(str, wanted))}" if wanted else
                       " without --return-aux-hidden-state-layer-ids (the model's EAGLE3 layers)"))
        if "return_aux_hidden_state_layer_ids" not in info:  # older versions: the draft's layers, not reported
            return None
        if wanted is None and served is not None:
            return (f"the server captures EAGLE3 auxiliary layers {served} (--return-aux-hidden-state-layer-ids), "
                    "not the model's default EAGLE3 layers: launch it without --return-aux-hidden-state-layer-ids, "
                    f"or set hidden_states.aux_layer_ids: {served} if the draft is trained on those")
        if wanted is not None and served != wanted:
            return (f"the server captures EAGLE3's auxiliary hidden states ({layers}), the run asks for layers {wanted} "
                    f"(hidden_states.aux_layer_ids): launch it with --return-aux-hidden-state-layer-ids "
                    f"{' '.join(map(str, wanted))}")
        return None

    @staticmethod
    def chunked_prefill_problem(info: dict[str, Any], tokens: int, what: str) -> str | None:
        """A sequence longer than one prefill chunk gets hidden-state rows for its last chunk only."""
        size = info.get("chunked_prefill_size")
        if not isinstance(size, int) or size <= 0 or tokens <= size:
            return None
        return (f"chunked_prefill_size is {size} tokens, shorter than {what} ({tokens} tokens): its hidden states "
                f"would cover the last chunk only. Launch with --chunked-prefill-size {tokens} or more (-1: no "
                "chunking)")

    def seed_warning(self, temperature: float) -> str | None:
        if temperature <= 0 or self.deterministic:
            return None
        state = "runs without it" if self.deterministic is False else "does not say whether it runs with it"
        return ("SGLang ignores seed and sampling_seed unless launched with --enable-deterministic-inference; this "
                f"server {state}, so its records are not reproducible from their seed (each record says so in "
                "`deterministic`)")
