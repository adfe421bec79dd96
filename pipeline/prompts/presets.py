"""The dataset presets (prompts_sources/<name>.yaml) and how to tell their records apart.

`regen validate` names the preset a source's records look like when the spec's `format` or `field` do not match
it (docs/dataset-presets.md). Each preset is recognised by the columns its hub card shows; the first that
matches wins, so the more specific come first (Hermes and Magpie are ShareGPT with more columns).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PRESETS_DIR = "prompts_sources"


@dataclass(frozen=True)
class Preset:
    name: str  # the spec file is PRESETS_DIR/<name>.yaml
    format: str
    field: str
    matches: Callable[[dict[str, Any]], bool]

    @property
    def spec_file(self) -> str:
        return f"{PRESETS_DIR}/{self.name}.yaml"


def _turns(value: Any, role: str = "from", content: str = "value") -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and role in value[0] \
        and content in value[0]


def _hermes(data: dict[str, Any]) -> bool:
    turns = data.get("conversations")
    if not _turns(turns):
        return False
    first = turns[0].get("value")
    return (isinstance(first, str) and "<tools>" in first) or any(
        isinstance(t, dict) and (t.get("from") == "tool" or "<tool_call>" in str(t.get("value"))) for t in turns)


def _magpie(model_word: str) -> Callable[[dict[str, Any]], bool]:
    def matches(data: dict[str, Any]) -> bool:
        return _turns(data.get("conversations")) and "uuid" in data and "instruction" in data \
            and model_word in str(data.get("model", "")).lower()
    return matches


def _image_path(data: dict[str, Any]) -> str:
    image = data.get("image")
    return image if isinstance(image, str) else ""


def _llava_shaped(matches: Callable[[str], bool]) -> Callable[[dict[str, Any]], bool]:
    """ShareGPT turns with an `image` path beside them (LLaVA's layout), the path as each dataset writes it."""
    def check(data: dict[str, Any]) -> bool:
        path = _image_path(data)
        return _turns(data.get("conversations")) and bool(path) and matches(path)
    return check


PRESETS: tuple[Preset, ...] = (
    Preset("nemotron_chat", "input_output", "input",
           lambda d: _turns(d.get("input"), "role", "content") and isinstance(d.get("output"), str)),
    Preset("gsm8k", "question_answer", "question",
           lambda d: isinstance(d.get("question"), str) and isinstance(d.get("answer"), str)),
    Preset("hermes_function_calling", "sharegpt", "conversations", _hermes),
    # image datasets (docs/sources.md, section Images): ALLaVA's paths start with its folder, ShareGPT4V's with
    # their dataset's folder (coco/train2017/...), LLaVA-Instruct's are bare COCO file names
    Preset("allava_4v", "sharegpt", "conversations", _llava_shaped(lambda p: p.lstrip("/").startswith("allava_"))),
    Preset("sharegpt4v", "sharegpt", "conversations", _llava_shaped(lambda p: "/" in p)),
    Preset("llava_instruct_150k", "sharegpt", "conversations", _llava_shaped(lambda p: "/" not in p)),
    Preset("magpie_qwen25_pro_1m", "sharegpt", "conversations", _magpie("qwen")),
    Preset("magpie_llama31_pro_300k", "sharegpt", "conversations", _magpie("llama")),
    Preset("ultrachat", "openai", "messages",
           lambda d: _turns(d.get("messages"), "role", "content") and "prompt_id" in d),
    Preset("open_perfectblend", "sharegpt", "conversations",
           lambda d: _turns(d.get("conversations")) and isinstance(d.get("source"), str) and "id" not in d),
    Preset("sharegpt", "sharegpt", "conversations", lambda d: _turns(d.get("conversations")) and "id" in d),
)


def recognise(data: Any) -> Preset | None:
    """The preset a record looks like, or None."""
    if not isinstance(data, dict):
        return None
    return next((p for p in PRESETS if p.matches(data)), None)
