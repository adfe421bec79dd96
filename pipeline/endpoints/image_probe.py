"""Does the endpoint take images? Asked by the preflight (probes.py) only of a prompt set with images.

- An engine that never does (llama.cpp: regen's fleet serves text only) is refused at once.
- SGLang says so in /model_info `has_image_understanding` (every checked version; identity.py reads it).
- Any other server (vLLM: no route says; a SGLang whose /model_info lacks the field) gets a tiny image probe: two
  1-token requests, the same text with and without an 8x8 PNG (a data: URL, the run's default). A refusal (vLLM:
  400 "<model> is not a multimodal model"; SGLang 0.5.17+: 400 "Model only supports text input; ...") refuses the
  endpoint; so does an answer whose prompt counted no more tokens with the image than without: the server dropped
  it and would answer every image prompt from its text alone. Without both counts (the twin failed, no `usage`)
  there is no evidence: the endpoint is unknown (down, asked again when readmitted), never admitted on it.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any, Callable

from ..core.config import RunConfig
from ..core.errors import EndpointDown, Retryable
from .classify import classify, error_message
from .client import EndpointClient
from .engines import OpenAIAdapter
from .images import data_url, image_url_part, probe_png

PROBE_TEXT = "Reply with one word."
PROBE_SIDE_TEXT = "an 8x8 PNG as a data: URL"


@dataclass(frozen=True)
class ImageVerdict:
    """`takes`: True/False, None: unknown (the server did not answer the probe: `down` says why). `problem`: the
    refusal, in words (the launch fix included)."""

    takes: bool | None
    problem: str | None = None
    down: str | None = None


def images_refusal(engine: OpenAIAdapter | None, why: str) -> str:
    fix = (engine or OpenAIAdapter()).images_fix()
    return f"the prompt set has images, and this server takes none ({why}): {fix}"


def known_verdict(engine: OpenAIAdapter | None, reported: bool | None) -> ImageVerdict | None:
    """The verdict without a request: the engine's (never) or what the server reported; None: probe it."""
    if engine is not None and engine.takes_images is False:
        return ImageVerdict(False, images_refusal(engine, engine.describe()))
    if reported is False:
        return ImageVerdict(False, images_refusal(engine, "/model_info reports has_image_understanding: false"))
    if reported is True:
        return ImageVerdict(True)
    return None


def _body(cfg: RunConfig, client: EndpointClient, rid: str, with_image: bool) -> dict[str, Any]:
    content: Any = PROBE_TEXT
    if with_image:
        png = probe_png()
        part = image_url_part(data_url("image/png", png), hashlib.sha256(png).hexdigest(), client.engine)
        content = [part, {"type": "text", "text": PROBE_TEXT}]
    body: dict[str, Any] = {"model": cfg.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
                            "temperature": 0.0, client.engine.request_id_field: rid}
    if cfg.template_kwargs():
        body["chat_template_kwargs"] = cfg.template_kwargs()
    return body


def _prompt_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


async def probe_images(client: EndpointClient, cfg: RunConfig, rid: Callable[[], str],
                       timeout_s: float) -> ImageVerdict:
    """The tiny image probe (module docstring). Never raises for the endpoint's faults."""
    try:
        (status, answer), (plain_status, plain) = await asyncio.gather(
            client.post_json("/v1/chat/completions", _body(cfg, client, rid(), True), timeout_s=timeout_s),
            client.post_json("/v1/chat/completions", _body(cfg, client, rid(), False), timeout_s=timeout_s))
    except EndpointDown as exc:
        return ImageVerdict(None, down=f"a tiny image request got no answer within {timeout_s:g}s ({exc.message})")
    if status != 200:
        error = classify(status, error_message(answer, f"HTTP {status}"), client.label, engine=client.engine)
        if isinstance(error, Retryable):
            return ImageVerdict(None, down=f"a tiny image request failed ({status}: {error.message})")
        return ImageVerdict(False, images_refusal(client.engine, f"a tiny image request ({PROBE_SIDE_TEXT}) was "
                                                                 f"refused: {status} {error_message(answer, '')}"))
    with_image, alone = _prompt_tokens(answer), _prompt_tokens(plain) if plain_status == 200 else None
    if with_image is None or alone is None:  # no evidence the image counted: unknown, never admitted on it
        why = (f"its text-only twin failed ({plain_status}: {error_message(plain, '')})" if plain_status != 200
               else "an answer carried no usage.prompt_tokens")
        return ImageVerdict(None, down=f"a tiny image request could not tell whether the image was taken ({why})")
    if with_image <= alone:
        return ImageVerdict(False, images_refusal(
            client.engine, f"it answered a tiny image request ({PROBE_SIDE_TEXT}) whose prompt counted {with_image} "
                           f"tokens, no more than the same text alone ({alone}): it dropped the image"))
    return ImageVerdict(True)
