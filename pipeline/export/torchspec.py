"""`regen export RUN --format torchspec`: rows for TorchSpec (lightseekorg/TorchSpec), the trainer of the public
Kimi-K2.5 EAGLE-3 drafts. Pure: records in (normalised messages: export/messages.py), rows out.

What TorchSpec reads (its code, not a dependency here: it is not on PyPI):
- `torchspec/data/utils.py` `load_hf_dataset` -> `load_local_json`: a JSONL file, each line parsed by `json`
  (so a row's `content` may be a string or a list of parts, as rows differ); `torchspec/data/dataset.py`
  `load_conversation_dataset` keeps `id` (its `data_id`) and `conversations` (config `prompt_key`), nothing else.
- `extract_media_urls`: an image part is `{"type": "image_url", "image_url": {"url": U}}` (or
  `{"type": "image", "image": U}`); U goes to the engine as it is (SGLang's `load_image`, vLLM's `fetch_image`), so
  it is a `file://` URL of an absolute path the trainer's machines read (`--image-prefix` maps the run's folder).
- `flatten_multimodal_content` then `parse.py` `KimiK25Parser.format`: each image becomes `<|image|>`, then Kimi's
  `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`; an assistant message's `content` is rendered
  as it is, prefixed with `<think></think>` unless it starts with `<think>` (so reasoning goes inline:
  `<think>REASONING</think>CONTENT`), then its `tool_calls` (`id`, `function.arguments` as a JSON string) in Kimi's
  tool-call tokens; a `tool` message as `## Return of <tool_call_id>` and its content.
Each record is a row of its own (`<unit>#turn<k>`, as the per-turn SpecForge rows): the parser strips the reasoning
of every assistant message but the last, so only a row's last turn carries the target's reasoning; train with
`last_turn_loss_only: true` (TorchSpec's `dataset:` key).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..core.images import IMAGE, is_parts
from .formats import Record, conversation_id, history, reply_message, turn_id
from .messages import ImagePaths

SETTINGS = {"dataset": {"chat_template": "kimi-k25-vlm", "prompt_key": "conversations",
                        "last_turn_loss_only": True}}
NOTES = [
    "torchspec: one row per regenerated turn, its last assistant message the target's reply with its reasoning "
    "inline (<think>...</think>); train with `dataset.last_turn_loss_only: true` (TorchSpec's 'auto' picks it only "
    "for rows with reasoning), `dataset.chat_template: kimi-k25-vlm`",
    "torchspec renders rows with its own KimiK25Parser, not Kimi's chat template: it renders no tool schemas (the "
    "target saw the run's `tools` in its prompt; the rows carry none, as TorchSpec reads only `id` and "
    "`conversations`), injects no default system prompt where Kimi's template may, and strips the reasoning of "
    "every assistant message but the last (Kimi's template may keep that of the current turn's tool-calling steps, "
    "which the run sent back: tool_reasoning_history). To train on exactly what the target saw, use "
    "`specforge-tokens` (text and tool rows; not image rows)",
    "torchspec: each image is a file:// URL of an absolute path (RUN/images/<sha[:2]>/<sha>, or the referenced "
    "file), rewritten by --image-prefix; TorchSpec hands it to its engine: SGLang's load_image reads file:// paths "
    "(0.5.10.post1 checked; files without an extension too), vLLM's fetch_image needs --allowed-local-media-path",
]


def _content(content: Any, paths: ImagePaths) -> Any:
    """A string as it is; parts as TorchSpec's extract_media_urls / KimiK25Parser take them."""
    if not is_parts(content):
        return content or ""
    out = []
    for part in content:
        if part["type"] == IMAGE:
            out.append({"type": "image_url", "image_url": {"url": file_url(paths.path_of(part))}})
        else:
            out.append({"type": "text", "text": part.get("text") or ""})
    return out


def file_url(path: str) -> str:
    """`file://` + the absolute path, percent-encoded where a URL needs it (SGLang and vLLM unquote it)."""
    from urllib.parse import quote

    return "file://" + quote(path)


def _message(message: Mapping[str, Any], paths: ImagePaths) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": _content(message.get("content"), paths)}
    reasoning = message.get("reasoning_content")
    if message["role"] == "assistant" and reasoning:
        think = f"<think>{reasoning}</think>"
        content = out["content"]
        out["content"] = [{"type": "text", "text": think}, *content] if is_parts(content) else think + content
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def torchspec_row(record: Record, paths: ImagePaths, source_ref: str | None,
                  reasoning_of: Callable[[int], str | None] | None = None,
                  reasoning_history: str = "none") -> dict[str, Any]:
    """One regenerated turn: the history as sent (reasoning of the tool-calling steps the run sent back, inline)
    and the target's reply last."""
    messages = history(record, reasoning_of, reasoning_history) + [reply_message(record)]
    return {"id": turn_id(conversation_id(record), record["turn_index"]),
            "conversations": [_message(m, paths) for m in messages], "source_ref": source_ref}
