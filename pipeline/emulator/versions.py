"""What the emulator does differently for the SGLang version it claims (`--sglang-version`), as each version's
own code does it (read from the wheels of 0.5.14, 0.5.17, 0.5.18 and 0.5.23; the conformance test checks the
emulator's answers against that version's own models).

The emulator imports nothing of regen, so this table is its own copy of the facts.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.5.23" -> (0, 5, 23); a suffix such as "rc1" or ".post1" is ignored."""
    numbers = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        numbers.append(int(digits or 0))
    return tuple(numbers)


# 0.5.23's /generate contract gate (sglang/api/v1/api_types.py): the sampling_params it admits, in its order.
GENERATE_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


@dataclass(frozen=True)
class Behaviour:
    version: tuple[int, ...]

    def _from(self, *floor: int) -> bool:
        return self.version >= floor

    @property
    def return_token_ids(self) -> bool:
        """Chat `return_token_ids` exists (before 0.5.17 it is an unknown field: ignored)."""
        return self._from(0, 5, 17)

    @property
    def output_ids_field(self) -> str | None:
        if not self.return_token_ids:
            return None
        return "response_token_ids" if self._from(0, 5, 18) else "token_ids"

    @property
    def model_info_names_parser(self) -> bool:
        """/model_info reports served_model_name, load_format, reasoning_parser and tool_call_parser."""
        return self._from(0, 5, 18)

    @property
    def stream_ids_in_sglext(self) -> bool:
        return self._from(0, 5, 23)

    @property
    def weight_version_spans(self) -> bool:
        return self._from(0, 5, 23)

    @property
    def kimi_local_call_index(self) -> bool:
        """KimiK2Detector numbers one answer's calls from 0; before 0.5.17 it took the IDX the model wrote (a
        conversation-wide count, which serving_chat then offsets by the history again)."""
        return self._from(0, 5, 17)

    @property
    def generate_contract(self) -> bool:
        """/generate refuses unknown sampling_params fields with 400 {"error": "<text>"}."""
        return self._from(0, 5, 23)

    # --- media (the image prompts; media.py and media_load.py) -------------------------------------------------
    @property
    def content_hash(self) -> bool:
        """image_url.content_hash is declared and validated (ChatCompletionMessageContentImageURL); before
        0.5.18 it is an unknown key, ignored."""
        return self._from(0, 5, 18)

    @property
    def media_refusal(self) -> bool:
        """A text-only model answers a media part 400 (OpenAIServingChat._validate_media_content); 0.5.14 lets
        it through and ignores it."""
        return self._from(0, 5, 17)

    @property
    def model_info_disaggregation(self) -> bool:
        return self._from(0, 5, 23)

    @property
    def part_types(self) -> frozenset[str]:
        """The content-part `type`s ChatCompletionMessageContentPart admits."""
        types = {"text", "image_url", "video_url", "audio_url", "tool_reference"}
        if self._from(0, 5, 17):
            types |= {"thinking", "reasoning"}
        if self._from(0, 5, 23):
            types.add("input_audio")
        return frozenset(types)

    @property
    def image_data_fields(self) -> tuple[str, ...]:
        """utils.common.ImageData's fields, in order (its repr is in the loaders' error texts)."""
        fields = ("url", "detail", "max_dynamic_patch", "preprocess_kwargs")
        if self._from(0, 5, 18):
            fields += ("content_hash",)
        if self._from(0, 5, 23):
            fields += ("max_long_side_pixel",)
        return fields

    @property
    def media_client_errors(self) -> bool:
        """_load_single_item turns CLIENT_MEDIA_EXCEPTIONS (ValueError, UnidentifiedImageError, requests'
        RequestException) into ValueError, and fast_load_mm_data keeps a ValueError one: 400. In 0.5.14
        fast_load_mm_data makes every loading error a RuntimeError: 500."""
        return self._from(0, 5, 17)

    @property
    def media_snapshot_first(self) -> bool:
        """Kimi's _load_single_item (kimi_common.KimiGridMMDataMixin) reads the bytes with snapshot_media
        before the base loader's try: a fetch or file error is not wrapped in 'Error while loading data'."""
        return self._from(0, 5, 23)

    @property
    def detail_default(self) -> bool:
        """image_url.detail "default" is read as "auto" (a before-validator)."""
        return self._from(0, 5, 23)

    @property
    def decode_error_text(self) -> bool:
        """_load_image turns Pillow's failure into ValueError('Could not decode image: ...') (a client error)."""
        return self._from(0, 5, 23)

    @property
    def media_download_policy(self) -> bool:
        """download_remote_media: redirects followed by hand (at most 5), at most 64 MiB."""
        return self._from(0, 5, 18)

def behaviour(sglang_version: str) -> Behaviour:
    return Behaviour(version_tuple(sglang_version))


def contract_error(sampling_params: dict) -> str | None:
    """0.5.23's text for the first unknown sampling_params field (None: all known)."""
    for key in sampling_params:
        if key not in GENERATE_SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in GENERATE_SAMPLING_FIELDS)
            return f"unknown field `{key}`, expected one of {listed}"
    return None
