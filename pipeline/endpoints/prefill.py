"""The chunked-prefill check: SGLang keeps hidden-state rows for the last prefill chunk only, so the longest
prompt a hidden-state pass sends must fit in one chunk (`chunked_prefill_size`). The prompt is counted by the
server itself (the chat route's prompt_token_ids, the ids the capture pass then sends to /generate).

Run by the fleet preflight and by every readmission, with the longest prompt of the run's prompt set.
"""
from __future__ import annotations

import uuid
from typing import Any

from ..core.errors import EndpointDown
from ..prompts.tokens import MESSAGE_ALLOWANCE, TEMPLATE_ALLOWANCE
from .client import EndpointClient, _error_message, classify
from .engines import SGLangAdapter

Messages = list[dict[str, str]]


def chunk_size(server_info: dict[str, Any] | None) -> int | None:
    size = (server_info or {}).get("chunked_prefill_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def fits_without_counting(messages: Messages, size: int) -> bool:
    """A token is at least one UTF-8 byte (a character at most 4): a prompt this short fits whatever the
    tokenizer, and needs no request."""
    upper = sum(4 * len(m.get("content") or "") + MESSAGE_ALLOWANCE for m in messages) + TEMPLATE_ALLOWANCE
    return upper <= size


async def count_prompt_tokens(client: EndpointClient, messages: Messages, timeout_s: float) -> int | str:
    """The prompt's tokens as the server counts them, or why it could not say."""
    s = client.settings
    body: dict[str, Any] = {"model": s.model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                            "return_prompt_token_ids": True, "rid": "regen-preflight-" + uuid.uuid4().hex}
    if s.chat_template_kwargs:
        body["chat_template_kwargs"] = s.chat_template_kwargs
    try:
        status, answer = await client.post_json("/v1/chat/completions", body, timeout_s=timeout_s)
    except EndpointDown as exc:
        return f"no answer within {timeout_s:g}s ({exc.message})"
    if status != 200:
        return classify(status, _error_message(answer, f"HTTP {status}"), client.label).message
    choices = answer.get("choices") if isinstance(answer, dict) else None
    ids = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    if isinstance(ids, list) and ids:
        return len(ids)
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else "the answer has no prompt_token_ids and no usage.prompt_tokens"


async def check_chunked_prefill(client: EndpointClient, server_info: dict[str, Any] | None,
                                longest_prompt: Messages | None, timeout_s: float, problems: list[str],
                                warnings: list[str]) -> None:
    """The longest prompt against the server's chunked_prefill_size: a problem (or a warning) appended."""
    size = chunk_size(server_info)
    if size is None or not longest_prompt or fits_without_counting(longest_prompt, size):
        return
    tokens = await count_prompt_tokens(client, longest_prompt, timeout_s)
    if isinstance(tokens, str):
        warnings.append(f"chunked_prefill_size is {size}: could not count the longest prompt's tokens ({tokens}); "
                        "a longer prompt gets hidden states for its last chunk only")
        return
    problem = SGLangAdapter.chunked_prefill_problem(server_info or {}, tokens, "the run's longest prompt")
    if problem:
        problems.append(problem)
