"""The prompt tokens an image costs, for `max_prompt_tokens` (tokens.py): exact where the model's processor is a
pure function of the image's size, `images.tokens_per_image` (a conservative budget) elsewhere.

Kimi-K2.5 (and every model whose preprocessor_config.json holds a NaViT `media_proc_cfg`) expands each image's one
`<|media_pad|>` into `navit_tokens(width, height)` placeholders: the image is scaled down (never up) to at most
`in_patch_limit` patches of `patch_size` pixels and `patch_limit_on_one_side` patches a side, padded to whole
`merge_kernel_size` x `merge_kernel_size` blocks of patches, and each block is one token. The same formula in both
engines: SGLang 0.5.23 `multimodal/processors/kimi_k25.py` `navit_resize_config` (its CPU path asks the model's
own `media_tokens_calculator`) and vLLM 0.32.0 `transformers_utils/processors/kimi_k25_vision_fused.py`
`navit_resize_image` (behind `KimiK25Processor`, `transformers_utils/processors/kimi_k25.py`). Kimi-K2.5's values
(its preprocessor_config.json): patch 14, merge 2, 16,384 patches, 512 a side: about 4,096 tokens for a large
image, at most 4,446 (7035 x 487: the padding to whole blocks), so `images.tokens_per_image` defaults to 4,608.
The width and height are the image part's own (those of the file the servers decode). Pure: no I/O but
`media_proc_cfg_of`, which reads a model folder's (or the hub cache's) preprocessor_config.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

# The template's markers around each image's placeholders (Kimi: <|media_begin|>image<|media_content|> ...
# <|media_end|>): a generous allowance, as tokens.py gives each message.
IMAGE_MARKER_ALLOWANCE = 16


@dataclass(frozen=True)
class NavitConfig:
    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None

    @classmethod
    def from_media_proc_cfg(cls, cfg: Mapping[str, Any]) -> "NavitConfig":
        merge = cfg["merge_kernel_size"]
        return cls(int(cfg["patch_size"]), int(merge[0] if isinstance(merge, (list, tuple)) else merge),
                   int(cfg["in_patch_limit"]), int(cfg["patch_limit_on_one_side"]), cfg.get("fixed_output_tokens"))


KIMI_K25 = NavitConfig()


def navit_tokens(width: int, height: int, cfg: NavitConfig = KIMI_K25) -> int:
    """The placeholder tokens of one image of width x height pixels (the engines' formula, module docstring)."""
    if cfg.fixed_output_tokens is not None:
        return int(cfg.fixed_output_tokens)
    patch, side = cfg.patch_size, cfg.patch_limit_on_one_side
    fit = math.sqrt(cfg.in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, fit, side * patch / width, side * patch / height)
    new_w = min(max(1, int(width * scale)), side * patch)
    new_h = min(max(1, int(height * scale)), side * patch)
    block = cfg.merge_kernel_size * patch
    return -(-new_w // block) * -(-new_h // block)  # padded up to whole blocks


def media_proc_cfg_of(model: str) -> dict[str, Any] | None:
    """The `media_proc_cfg` of a model's preprocessor_config.json (a local folder, or the hub's cached copy through
    transformers), or None: the model has none (not a NaViT processor), or it cannot be read."""
    path = Path(model) / "preprocessor_config.json"
    try:
        if not path.is_file():
            from transformers.utils import cached_file

            found = cached_file(model, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
            if not found:
                return None
            path = Path(found)
        config = json.loads(path.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - any failure only means "no exact count": the budget is used
        return None
    cfg = config.get("media_proc_cfg") if isinstance(config, dict) else None
    needed = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side")
    return cfg if isinstance(cfg, dict) and all(key in cfg for key in needed) else None


def image_token_counter(model: str | None, tokens_per_image: int) -> tuple[Callable[[Mapping[str, Any]], int], str]:
    """(tokens of one image part, how they are counted): exact for a NaViT processor, else the budget."""
    cfg = media_proc_cfg_of(model) if model else None
    if cfg is None:
        return (lambda part: tokens_per_image), f"images.tokens_per_image ({tokens_per_image:,} an image)"
    navit = NavitConfig.from_media_proc_cfg(cfg)
    return (lambda part: navit_tokens(int(part["width"]), int(part["height"]), navit) + IMAGE_MARKER_ALLOWANCE), \
        f"{model}'s NaViT processor (exact, from each image's size)"
