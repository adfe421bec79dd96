"""`max_prompt_tokens`: a prompt longer than the target accepts is rejected before it is sent, counted with the
target's tokenizer (the chat template applied, as the server does) where one is available.

Without a tokenizer the prompt is kept, and the server's 400 (context overflow) makes it a terminal failure.
Most prompts are never tokenized: a token covers at least one byte of text, so a prompt whose UTF-8 length plus a
generous template allowance fits is within the limit for certain.

Images count too: each image part as image_tokens.py says (exact for Kimi-K2.5's processor, from the image's
size; else `images.tokens_per_image`), added to the tokens of the conversation's texts (its parts' texts joined,
rendered by the template without the images).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

from ..core.images import content_text, images_of, is_parts
from .image_tokens import image_token_counter
from .records import InvalidRecord, RejectCode

log = logging.getLogger("regen")

DEFAULT_TOKENS_PER_IMAGE = 4608  # core/config_sections.py Images.tokens_per_image's default
TEMPLATE_ALLOWANCE = 64  # tokens a chat template adds around a conversation, at most...
MESSAGE_ALLOWANCE = 16  # ... and around each message


class PromptLength:
    """Call with a conversation: raises InvalidRecord(TOO_LONG) when it is over `max_tokens`."""

    def __init__(self, tokenizer: Any, max_tokens: int, name: str, chat_template: str | None = None,
                 image_tokens: Callable[[Mapping[str, Any]], int] | None = None):
        """`chat_template`: the template text the servers render with (vLLM's --chat-template), in place of the
        tokenizer's own. `image_tokens`: the tokens one image part counts as (image_tokens.py; default: the
        `images.tokens_per_image` default)."""
        self.tokenizer, self.max_tokens, self.name = tokenizer, max_tokens, name
        self.chat_template = chat_template
        self.image_tokens = image_tokens or image_token_counter(None, DEFAULT_TOKENS_PER_IMAGE)[0]
        self.tokenized = 0  # conversations that had to be tokenized (the rest fit by their byte length)
        self.unrenderable = 0  # conversations the template could not render: measured by their texts

    def count(self, messages: tuple[dict[str, Any], ...], tools: list[dict] | None = None) -> int:
        """The conversation's tokens: its texts as the template renders them, plus its images'."""
        self.tokenized += 1
        return self._count_texts(tuple(_text_only(m) for m in messages), tools) + self._images(messages)

    def _images(self, messages: tuple[dict[str, Any], ...]) -> int:
        return sum(self.image_tokens(part) for part in images_of(messages))

    def _count_texts(self, messages: tuple[dict[str, Any], ...], tools: list[dict] | None) -> int:
        if self.chat_template or getattr(self.tokenizer, "chat_template", None):
            # the tools as the server renders them: passed to the template, which places them
            try:
                ids = self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=True,
                                                         add_generation_prompt=True, chat_template=self.chat_template)
            except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages (e.g. a
                # tool turn or `content: null` in a template written for plain chat): measured by the texts
                self._cannot_render(exc)
            else:
                if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
                    ids = ids["input_ids"]
                return len(ids)
        # no template to apply: the texts' tokens, a lower bound of what the server counts
        return sum(len(self.tokenizer.encode(text, add_special_tokens=False)) for text in _texts(messages, tools))

    def __call__(self, messages: tuple[dict[str, Any], ...], tools: list[dict] | None = None) -> None:
        """`tools`: the prompt's OpenAI tools list, which the template renders into the prompt."""
        allowance = TEMPLATE_ALLOWANCE + MESSAGE_ALLOWANCE * len(messages) + self._images(messages)
        texts = _texts(messages, tools)
        if 4 * sum(map(len, texts)) + allowance <= self.max_tokens:  # a character is at most 4 UTF-8 bytes
            return
        if sum(len(text.encode()) for text in texts) + allowance <= self.max_tokens:
            return
        tokens = self.count(messages, tools)
        if tokens > self.max_tokens:
            images = self._images(messages)
            counted = f"{self.name}'s tokenizer" + (f", its images {images:,}" if images else "")
            raise InvalidRecord(RejectCode.TOO_LONG, f"the prompt is {tokens:,} tokens ({counted}), "
                                                     f"over max_prompt_tokens {self.max_tokens:,}")


    def _cannot_render(self, exc: Exception) -> None:
        self.unrenderable += 1
        if self.unrenderable == 1:
            log.warning("max_prompt_tokens %d: %s's chat template cannot render some prompts (%s: %s), e.g. "
                        "tool calls or results; those are measured by their texts' tokens, a lower bound (set "
                        "`tokenizer:` to one whose template renders them, or local_fleet.chat_template)",
                        self.max_tokens, self.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _texts(messages: tuple[dict[str, Any], ...], tools: list[dict] | None) -> list[str]:
    """Every text the template renders: contents, calls (arguments as JSON) and the tools' schemas."""
    texts = [content_text(m.get("content")) for m in messages]  # images are counted apart (image_tokens.py)
    texts += [orjson.dumps(m["tool_calls"]).decode() for m in messages if m.get("tool_calls")]
    if tools:
        texts.append(orjson.dumps(tools).decode())
    return texts


def _text_only(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template renders its texts: parts become their texts joined (the images are counted apart)."""
    return {**message, "content": content_text(message["content"])} if is_parts(message.get("content")) else message


def load_length_check(max_tokens: int | None, tokenizer: str, chat_template: str | None = None,
                      tokens_per_image: int = DEFAULT_TOKENS_PER_IMAGE) -> PromptLength | None:
    """The check for `max_prompt_tokens`, or None (with a warning) when no tokenizer can be loaded.
    `chat_template`: the file of the template the servers are launched with (local_fleet.chat_template).
    `tokens_per_image`: images.tokens_per_image, where the model's processor cannot count an image exactly."""
    if max_tokens is None:
        return None
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:  # noqa: BLE001 - any failure only means "no tokenizer": said once, then go on
        log.warning("max_prompt_tokens %d: no tokenizer could be loaded from %r (%s: %s); prompts are not measured "
                    "before sending, and the server refuses an over-long one (a terminal failure)", max_tokens,
                    tokenizer, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    template = Path(chat_template).read_text(encoding="utf-8") if chat_template else None
    image_tokens, how = image_token_counter(tokenizer, tokens_per_image)
    log.info("max_prompt_tokens %d: an image counts as %s", max_tokens, how, extra={"file_only": True})
    return PromptLength(loaded, max_tokens, tokenizer, template, image_tokens)
