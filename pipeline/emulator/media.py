"""Image prompts as SGLang serves Kimi-K2.5 (and a text-only model), per version; read from the 0.5.14, 0.5.17,
0.5.18 and 0.5.23 wheels.

- The parts (entrypoints/openai/protocol.py): `{"type": "image_url", "image_url": {"url", "detail",
  "max_dynamic_patch", "min_dynamic_patch"}}`; 0.5.18 adds `content_hash` ("sha256:" + 64 hex digits, checked by
  multimodal/cache/identity.py:parse_content_hash, lower-cased; before 0.5.18 the key is unknown and ignored),
  0.5.23 `max_long_side_pixel` and `detail: "default"` (read as "auto"). A part FastAPI cannot parse is a 400
  "Bad Request" (http_server.py:validation_exception_handler).
- A text-only model: 0.5.17+ answers a media part (image_url, video_url, audio_url) 400 "Model only supports text
  input; ..." (serving_chat.py:_validate_media_content); 0.5.14 lets it through and ignores it.
- Kimi-K2.5 (multimodal/processors/kimi_k25.py): the template writes
  `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` for an image and the processor repeats
  `<|media_pad|>` (id 163605, configs/kimi_k25.py media_placeholder_token_id) `navit_resize_config(...)
  ["num_tokens"]` times; those ids are the prompt's (prompt_tokens, prompt_token_ids).

The emulated model's answer starts by naming each image it saw (size and the first 16 hex digits of the sha256 of
its bytes), so a test can tell which image arrived (an answer cut inside its reasoning names none); the images'
digests also seed the answer. Kimi ignores video_url and audio_url parts. Loading the bytes: media_load.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from .versions import Behaviour

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = ("<|media_begin|>", "<|media_content|>", "<|media_end|>",
                                                    "<|media_pad|>")
# Kimi's tokenizer ids of its media tokens (the hub's tokenizer_config.json; 163605 is also KimiK25Config's
# default media_placeholder_token_id in the wheels).
MEDIA_SPECIAL = {MEDIA_BEGIN: 163602, MEDIA_CONTENT: 163603, MEDIA_END: 163604, MEDIA_PAD: 163605}
MEDIA_PAD_ID = MEDIA_SPECIAL[MEDIA_PAD]
# Kimi-K2.5's media_proc_cfg (the hub's preprocessor_config.json, not in the wheels): 14-pixel patches merged
# 2x2, at most 16384 patches (about 4096 tokens; up to 4446 with the padding to whole blocks) and 512 patches on a side.
KIMI_K25_MEDIA = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512}
MEDIA_PART_TYPES = ("image_url", "video_url", "audio_url")  # serving_chat.py:_MEDIA_CONTENT_PART_TYPES
_DETAILS = ("auto", "low", "high")
_MODALITIES = ("image", "multi-images", "video")


@dataclass(frozen=True)
class SeenImage:
    """An image the server decoded: the sha256 of its bytes, its size, and Kimi's placeholder count for it."""
    sha256: str
    width: int
    height: int

    @property
    def tokens(self) -> int:
        return kimi_image_tokens(self.width, self.height)

    @property
    def pad_value(self) -> int:
        """What the radix cache sees instead of this image's pads (SGLang pads with a hash of the image)."""
        return int(self.sha256[:12], 16)


def kimi_image_tokens(width: int, height: int) -> int:
    """kimi_k25.py:navit_resize_config(width, height, **KIMI_K25_MEDIA)["num_tokens"]: scale down to fit the patch
    limits, pad each side to a multiple of patch * merge, one token per merged patch."""
    patch, merge = KIMI_K25_MEDIA["patch_size"], KIMI_K25_MEDIA["merge_kernel_size"]
    limit, side = KIMI_K25_MEDIA["in_patch_limit"], KIMI_K25_MEDIA["patch_limit_on_one_side"]
    s1 = math.sqrt(limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, s1, side * patch / width, side * patch / height)
    new_w = min(max(1, int(width * scale)), side * patch)
    new_h = min(max(1, int(height * scale)), side * patch)
    factor = merge * patch
    return -(-new_w // factor) * -(-new_h // factor)


def image_marker(pads: int) -> str:
    """One image in the prompt, its placeholder expanded to `pads` tokens."""
    return f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD * pads}{MEDIA_END}"


def mention(images: list[SeenImage]) -> str:
    """How the emulated model's answer starts when it saw images."""
    return " ".join(f"I see an image ({im.width}x{im.height}, sha256 {im.sha256[:16]})." for im in images)


def has_parts(messages: list[dict]) -> bool:
    """Any list content (the only place a media part can be): the text path's one check."""
    return any(isinstance(m.get("content"), list) for m in messages)


def image_urls(messages: list[dict]) -> list[dict]:
    """The `image_url` objects of a (validated) conversation, in order."""
    return [p["image_url"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image_url"]


def media_refusal(messages: list[dict]) -> str | None:
    """A text-only model's 400 (0.5.17+): the first media part's type. input_audio is an audio_url by then."""
    for m in messages:
        if isinstance(m.get("content"), list):
            for p in m["content"]:
                kind = "audio_url" if p.get("type") == "input_audio" else p.get("type")
                if kind in MEDIA_PART_TYPES:
                    return f"Model only supports text input; received unsupported content type '{kind}'."
    return None


def pads_of(images: list[SeenImage] | None) -> Iterator[int] | None:
    return iter([im.tokens for im in images]) if images is not None else None


def keyed_pads(prompt_ids: list[int], images: list[SeenImage]) -> list[int]:
    """The prompt as the radix cache keys it: each image's run of pads replaced by the image's pad value."""
    values = iter([im.pad_value for im in images])
    out, value, previous = [], 0, -1
    for t in prompt_ids:
        if t == MEDIA_PAD_ID and previous != MEDIA_PAD_ID:
            value = next(values)
        out.append(value if t == MEDIA_PAD_ID else t)
        previous = t
    return out


# --- the parts as the version's pydantic models read them ---------------------------------------------------------
class PartInvalid(ValueError):
    """A part the version's ChatCompletionRequest refuses: where, and pydantic's message."""

    def __init__(self, where: str, message: str):
        super().__init__(f"1 validation error: {where}: {message}")


def check_parts(messages: list[dict], behaviour: Behaviour) -> None:
    """Raise PartInvalid for the first content part the version's models refuse (the request is left as sent)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise PartInvalid(where, "Input should be a valid dictionary")
            kind = part.get("type")
            if kind not in behaviour.part_types:
                raise PartInvalid(f"{where}.type", f"Input should be one of {sorted(behaviour.part_types)}, "
                                                   f"got {kind!r}")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise PartInvalid(f"{where}.text", "Input should be a valid string")
            elif kind == "image_url":
                _check_image(part, f"{where}.image_url", behaviour)
            elif kind in ("video_url", "audio_url"):
                _check_url(part.get(kind), f"{where}.{kind}", kind.replace("_url", "").title() + "URL")


def _check_url(obj: Any, where: str, model: str) -> None:
    """`model`: the pydantic model's name after ChatCompletionMessageContent (ImageURL, VideoURL, AudioURL)."""
    if not isinstance(obj, dict):
        raise PartInvalid(where, f"Input should be a valid dictionary or instance of "
                                 f"ChatCompletionMessageContent{model}")
    if "url" not in obj:
        raise PartInvalid(f"{where}.url", "Field required")
    if not isinstance(obj["url"], str):
        raise PartInvalid(f"{where}.url", "Input should be a valid string")


def _check_image(part: dict, where: str, behaviour: Behaviour) -> None:
    obj = part.get("image_url")
    _check_url(obj, where, "ImageURL")
    if part.get("modalities") is not None and part["modalities"] not in _MODALITIES:
        raise PartInvalid(where.rsplit(".", 1)[0] + ".modalities", "Input should be 'image', 'multi-images' or "
                                                                   "'video'")
    if normal_detail(obj.get("detail"), behaviour) not in (None, *_DETAILS):
        raise PartInvalid(f"{where}.detail", "Input should be 'auto', 'low' or 'high'")
    if behaviour.content_hash and obj.get("content_hash") is not None:
        parse_content_hash(obj["content_hash"], f"{where}.content_hash")


def normal_detail(detail: Any, behaviour: Behaviour) -> Any:
    """image_url.detail as the version's model holds it (0.5.23 reads "default" as "auto")."""
    return "auto" if detail == "default" and behaviour.detail_default else detail


def parse_content_hash(value: Any, where: str) -> str:
    """multimodal/cache/identity.py:parse_content_hash, its messages verbatim (pydantic prefixes 'Value error, '):
    the hash lower-cased."""
    if not isinstance(value, str):
        raise PartInvalid(where, "Input should be a valid string")
    if not value.startswith("sha256:"):
        raise PartInvalid(where, "Value error, content_hash must use the form 'sha256:<64 hex digits>'")
    digest = value[len("sha256:"):]
    if len(digest) != 64:
        raise PartInvalid(where, "Value error, content_hash must contain exactly 64 SHA-256 hex digits")
    try:
        bytes.fromhex(digest)
    except ValueError:
        raise PartInvalid(where, "Value error, content_hash contains non-hexadecimal characters") from None
    return "sha256:" + digest.lower()
