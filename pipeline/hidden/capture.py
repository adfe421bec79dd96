"""The hidden-state route: one prompt through SGLang's native /generate with return_hidden_states.

1. The server templates the prompt itself: a chat request with `return_prompt_token_ids` (and one token of
   output) returns the exact prompt ids its chat template renders, with the run's template kwargs.
2. `/generate` on those `input_ids`, with the run's sampling and `return_hidden_states`.
3. The body is parsed at the byte level (hidden/parse.py), aligned (row i belongs to token i of prompt +
   completion), and written by this actor as a hidden part, before the data row that will reference it.
Reasoning is split at `</think>` here, since /generate returns the raw text.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..endpoints.client import EndpointClient, _error_message, classify, parse_body
from ..core.errors import Retryable
from .parse import align, parse_generate_response
from .parts import HiddenPartWriter
from ..core.work import Completion

THINK_END = "</think>"


@dataclass(frozen=True)
class HiddenRoute:
    expected_width: int
    run_dir: str  # a path every actor's node sees, or an object-store URI (storage.Location.uri)
    thinking: bool | None
    max_in_memory: int = 2  # answers parsed or being written at once, per actor


def split_reasoning(text: str, thinking: bool | None) -> tuple[str, str | None]:
    """Kimi's raw output is `reasoning</think>answer`; a cut before `</think>` is all reasoning."""
    if thinking is False:
        return text, None
    if THINK_END in text:
        reasoning, content = text.split(THINK_END, 1)
        return content.strip(), reasoning.strip()
    return ("", text.strip()) if thinking else (text, None)


async def prompt_ids(client: EndpointClient, messages: list[dict[str, str]]) -> list[int]:
    s = client.settings
    body: dict[str, Any] = {"model": s.model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                            "return_prompt_token_ids": True, "rid": uuid.uuid4().hex}
    if s.chat_template_kwargs:
        body["chat_template_kwargs"] = s.chat_template_kwargs
    status, answer = await client.generate_json("/v1/chat/completions", body, timeout_s=s.timeout_s)
    if status != 200:
        raise classify(status, _error_message(answer, f"/v1/chat/completions answered {status}"), client.label)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    ids = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    if not ids:
        raise Retryable("the server returned no prompt_token_ids (SGLang >= 0.5.9 is needed)", endpoint=client.label)
    return ids


class HiddenTurns:
    """Runs hidden-state turns for one endpoint actor. Up to the endpoint's concurrency are in flight; at most
    `max_in_memory` answers are read, parsed or written at once (one 4K-token answer is about 176 MB)."""

    def __init__(self, client: EndpointClient, route: HiddenRoute, tag: str):
        self.client, self.route, self.tag = client, route, tag
        self.in_memory = asyncio.Semaphore(route.max_in_memory)
        self.part_counter = itertools.count(1)  # one per actor: with the sample's ids, part names never repeat

    async def turn(self, prompt_id: str, turn_index: int, messages: list[dict[str, str]],
                   seed: int | None) -> Completion:
        s = self.client.settings
        ids = await prompt_ids(self.client, messages)
        sampling = self.client.engine.generate_sampling(s.sampling(), s.max_tokens, seed)
        body = {"input_ids": ids, "sampling_params": sampling, "return_hidden_states": True,
                "rid": uuid.uuid4().hex}
        started = time.monotonic()
        async with self.client.posted("/generate", body, timeout_s=s.timeout_s) as response:
            if response.status != 200:
                answer = parse_body(await self.client.read_body(response, s.timeout_s))
                raise classify(response.status, _error_message(answer, f"/generate answered {response.status}"),
                               self.client.label)
            # the answer waits in the socket until a memory slot is free: only held answers are bounded
            async with self.in_memory:
                payload = await self.client.read_body(response, s.timeout_s)
                completion = await asyncio.to_thread(self._store, prompt_id, turn_index, ids, payload,
                                                     time.monotonic() - started)
        return self.client.check_completion(completion)

    def _store(self, prompt_id: str, turn_index: int, ids: list[int], payload: bytes, latency_s: float) -> Completion:
        """Parse, align and commit the hidden part (in a thread: this is the CPU-heavy step)."""
        result = parse_generate_response(payload, self.route.expected_width)
        meta = result.meta
        prompt_tokens, completion_tokens = int(meta["prompt_tokens"]), int(meta["completion_tokens"])
        align(prompt_tokens, completion_tokens, result.n_prefill, result.n_rows)
        finish = (meta.get("finish_reason") or {}).get("type", "unknown")
        writer = HiddenPartWriter(self.route.run_dir, tag=self.tag, counter=self.part_counter)
        writer.add(prompt_id, turn_index, list(ids) + list(result.output_ids), len(ids), result.hidden)
        part, rows = writer.commit()
        content, reasoning = split_reasoning(result.text, self.route.thinking)
        return Completion(
            content=content, reasoning_content=reasoning, finish_reason=finish, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, cached_tokens=meta.get("cached_tokens"), reasoning_tokens=None,
            model=self.client.settings.model, weight_version=meta.get("weight_version"), latency_s=latency_s,
            request_id=str(meta.get("id", "")), prompt_token_ids=list(ids), output_token_ids=list(result.output_ids),
            hidden_part=part, hidden_row=rows[(prompt_id, turn_index)],
            weight_versions=self.client.engine.weight_versions(meta) or None,
            deterministic=self.client.engine.deterministic, engine=self.client.engine.engine,
            engine_version=self.client.engine.version,
        )
