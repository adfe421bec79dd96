"""Information, health, metrics and admin routes."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from .metrics import render_metrics
from .model import encode, render_chat, thinking_enabled
from .protocol import json_response, openai_error, parse_json, RequestInvalid
from .routes_gen import STATE_KEY


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


def _healthy(request: web.Request) -> bool:
    st = request.app[STATE_KEY]
    if st.cfg.health_503:
        return False
    return time.time() - st.started >= st.cfg.startup_delay


async def health(request: web.Request) -> web.Response:
    return _empty(200 if _healthy(request) else 503)


async def health_generate(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    if not _healthy(request):
        return _empty(503)
    if st.cfg.health_ok_while_hung:
        await asyncio.sleep(st.cfg.health_check_timeout)     # the probe generation never finishes
        return _empty(503)
    return _empty(200)


async def get_model_info(request: web.Request) -> web.Response:
    """http_server.py:model_info of the version. has_image_understanding is ModelConfig's
    is_image_understandable_model: a multimodal model with a vision_config (Kimi-K2.5's); no audio."""
    cfg = request.app[STATE_KEY].cfg
    behaviour = cfg.behaviour
    info = {"model_path": cfg.model_path}
    if behaviour.model_info_names_parser:
        info["served_model_name"] = cfg.served_model_name
    info.update({"tokenizer_path": cfg.model_path, "is_generation": True, "preferred_sampling_params": None,
                 "weight_version": cfg.weight_version})
    if behaviour.model_info_names_parser:
        info.update({"load_format": "auto", "reasoning_parser": cfg.reasoning_parser,
                     "tool_call_parser": cfg.tool_call_parser})
    if behaviour.model_info_disaggregation:
        info["disaggregation_mode"] = "null"
    info.update({"has_image_understanding": cfg.image_understanding, "has_audio_understanding": False,
                 "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]})
    return json_response(info)


async def get_server_info(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    cfg = st.cfg
    info = cfg.server_args()
    info.update({
        "max_total_num_tokens": cfg.max_total_num_tokens,
        "internal_states": [{
            "last_gen_throughput": st.gen_throughput(),
            # every supported version (0.5.14-0.5.23): get_internal_state's scheduler.max_running_requests
            "effective_max_running_requests_per_dp": cfg.capacity if cfg.capacity > 0 else 1 << 30,
            "avg_spec_accept_length": cfg.accept_length if cfg.is_speculative else None,
        }],
        "version": cfg.sglang_version,
    })
    return json_response(info)


async def tokenize(request: web.Request) -> web.Response:
    """POST /v1/tokenize (and /tokenize): a prompt, or messages rendered through the chat template with the
    request's chat_template_kwargs, as tokens; no generation."""
    st = request.app[STATE_KEY]
    cfg = st.cfg
    body: dict = {}
    try:
        body = parse_json(await request.read())
        st.log_request(request.path, "", body, "tokenize")
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise RequestInvalid("Exactly one of 'prompt' or 'messages' must be provided.")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise RequestInvalid("messages must be a list of messages.")
            tokens = encode(render_chat(messages, thinking_enabled(body)))
        elif isinstance(prompt, str):
            tokens = encode(prompt)
        else:
            raise RequestInvalid("The emulator tokenizes one prompt string at a time.")
    except (RequestInvalid, KeyError, ValueError) as e:
        return openai_error(400, str(getattr(e, "message", e)))
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": cfg.context_length})


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    cfg = st.cfg
    return json_response({"object": "list", "data": [{
        "id": cfg.served_model_name, "object": "model", "created": int(st.started), "owned_by": "sglang",
        "root": cfg.model_path, "parent": None, "max_model_len": cfg.context_length}]})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    if not st.cfg.enable_metrics:
        return json_response({"detail": "Not Found"}, 404)
    return web.Response(text=render_metrics(st), content_type="text/plain", charset="utf-8",
                        headers={"X-Emulator": "sglang"})


async def flush_cache(request: web.Request) -> web.Response:
    request.app[STATE_KEY].cache.clear()
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be performed.)\n")


async def admin_faults(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    if request.method == "GET":
        return json_response(st.cfg.faults())
    try:
        body = parse_json(await request.read())
        return json_response(st.update_faults(body))
    except (RequestInvalid, ValueError, TypeError) as e:
        return json_response({"error": {"message": str(getattr(e, "message", e))}}, 400)


async def admin_stats(request: web.Request) -> web.Response:
    return json_response(request.app[STATE_KEY].stats())


async def admin_reset(request: web.Request) -> web.Response:
    """Counters, prefix cache, fault settings (back to the startup values) and the fault draw sequence."""
    st = request.app[STATE_KEY]
    keep_faults = request.query.get("keep_faults") in ("1", "true")
    st.reset(faults=not keep_faults)
    return json_response({"ok": True})


async def not_found(request: web.Request) -> web.Response:
    return json_response({"detail": "Not Found"}, 404)
