"""Generation routes: POST /v1/chat/completions and POST /generate (non-streaming and SSE)."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from .versions import contract_error
from .media import has_parts
from .media_load import prepare_media
from .model import THINK_START_ID, Generation, chat_generation, chat_max_tokens, generate, \
    generate_prompt, native_finish
from .protocol import (RequestInvalid, chat_body, chat_usage, check_context, chunk_bytes, json_response,
                       meta_info, native_error, openai_error, parse_json, stream_answer_of, stream_error_event,
                       validate_chat, validate_generate, weight_metadata)
from .batch import QueueFull
from .state import Overloaded, PrefixCache, ServerState

CHAT = "/v1/chat/completions"
GENERATE = "/generate"
STATE_KEY: web.AppKey[ServerState] = web.AppKey("emulator_state", ServerState)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
_FAULT_MESSAGES = {400: "Invalid request (emulated fault).", 429: "Too many requests (emulated fault).",
                   500: "Internal server error: emulated fault.", 503: "The request queue is full."}


@dataclass
class Job:
    route: str
    body: dict
    rid: str
    gen: Generation
    stream: bool
    t0: float
    cached: int = 0
    fault: str | None = None
    timed: bool = False               # the batch (the throughput curve) has spent its time already
    extra: dict = field(default_factory=dict)


def _error(route: str, status: int, message: str) -> web.Response:
    return openai_error(status, message) if route == CHAT else native_error(status, message)


async def _hang_forever() -> None:
    await asyncio.Event().wait()


def _admit(st: ServerState, body: dict) -> str:
    """The checks both generation routes share; returns the request's rid."""
    rid = body.get("rid") or uuid.uuid4().hex
    if rid in st.running_rids:
        raise RequestInvalid(f"Duplicate request ID detected: {rid}")
    return rid


def _refuse(st: ServerState, route: str, body: dict, error: RequestInvalid, respond) -> web.Response:
    st.count(route, str(error.status))
    rid = body.get("rid") if isinstance(body.get("rid"), str) else ""
    st.log_request(route, rid, body, f"error:{error.status}", message=error.message)
    if error.bare:
        return json_response({"error": error.message}, error.status)
    if error.err_type:
        return openai_error(error.status, error.message, error.err_type)
    return respond(error.status, error.message)


async def _prepare_chat(st: ServerState, body: dict) -> Generation:
    cfg = st.cfg
    validate_chat(body, cfg.behaviour.return_token_ids)
    images = None
    if has_parts(body["messages"]):  # media parts: checked, refused or read and decoded (off the event loop)
        images = await asyncio.to_thread(prepare_media, body["messages"], cfg.behaviour, cfg.image_understanding)
    # No model-name check: SGLang's chat route echoes request.model (only /v1/models/{m} answers 404).
    _, gen = chat_generation(body, cfg.context_length, cfg.default_max_tokens, cfg.tool_call_parser,
                             cfg.behaviour.kimi_local_call_index, images)
    check_context(gen.prompt_tokens, chat_max_tokens(body), cfg.context_length)
    return gen


async def _prepare_generate(st: ServerState, body: dict) -> Generation:
    cfg = st.cfg
    if cfg.behaviour.generate_contract and isinstance(body.get("sampling_params"), dict):
        error = contract_error(body["sampling_params"])
        if error:
            raise RequestInvalid(error, bare=True)
    sp = validate_generate(body)
    key, ids = generate_prompt(body)
    if not ids:
        raise RequestInvalid("The input is empty.")
    mx = sp.get("max_new_tokens", 128)
    check_context(len(ids), mx, cfg.context_length)
    if mx is None:
        mx = cfg.context_length - len(ids) - 1
    return generate(key, ids, mx, float(sp.get("temperature") or 0.0), sp.get("sampling_seed"),
                    ids[-1] == THINK_START_ID, bool(sp.get("ignore_eos")))


async def _serve(request: web.Request, route: str, prepare, respond_error) -> web.StreamResponse:
    """Both generation routes: parse, validate, admit (or refuse with the route's error body), then run."""
    st = request.app[STATE_KEY]
    st.enter()
    t0 = time.monotonic()
    body: dict = {}
    try:
        try:
            body = parse_json(await request.read())
            gen = await prepare(st, body)
            rid = _admit(st, body)
        except RequestInvalid as e:
            return _refuse(st, route, body, e, respond_error)
        return await _run(request, st, Job(route, body, rid, gen, bool(body.get("stream")), t0))
    finally:
        st.leave()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CHAT, _prepare_chat, openai_error)


async def generate_native(request: web.Request) -> web.StreamResponse:
    return await _serve(request, GENERATE, _prepare_generate, native_error)


async def _run(request: web.Request, st: ServerState, job: Job) -> web.StreamResponse:
    """Faults, admission, prefix cache, timing, then the answer."""
    cfg = st.cfg
    route = job.route
    st.running_rids.add(job.rid)
    try:
        if cfg.health_ok_while_hung:
            job.fault = "hang"
        else:
            job.fault = st.draw_fault()
        job.fault = st.poison(job.body) or job.fault
        if job.fault == "hang":
            st.count(route, "hang")
            st.log_request(route, job.rid, job.body, "hang")
            await _hang_forever()
        if job.fault in ("429", "503") or (job.fault in ("400", "500") and not job.stream):
            status = int(job.fault)
            st.count(route, job.fault)
            st.log_request(route, job.rid, job.body, f"error:{status}", fault=True)
            return _error(route, status, _FAULT_MESSAGES[status])
        if cfg.throughput_curve:
            return await _run_curve(request, st, job)
        try:
            await st.acquire()
        except Overloaded as e:
            st.count(route, "503")
            st.log_request(route, job.rid, job.body, "error:503", message=str(e))
            return _error(route, 503, str(e))
        gen = job.gen
        tokens = gen.prompt_tokens + gen.completion_tokens
        st.running_tokens += tokens
        try:
            plen = gen.prompt_tokens
            if not cfg.disable_radix_cache:
                prompt = gen.prompt_ids if gen.cache_ids is None else gen.cache_ids
                hashes = PrefixCache.prefix_hashes(prompt + gen.output_ids[:-1])
                job.cached = min(st.cache.match(hashes[:plen]), plen - 1)
                st.cache.insert(hashes)     # prompt + output, as SGLang caches a finished request
            if job.fault == "abort":
                job.gen = gen = gen.cut(gen.completion_tokens // 2, "abort")
            if job.stream:
                resp = await _stream(request, st, job)
            else:
                resp = await _plain(request, st, job)
            return resp
        finally:
            st.running_tokens -= tokens
            st.release()
    except asyncio.CancelledError:
        st.count(route, "cancelled")
        st.log_request(route, job.rid, job.body, "cancelled")
        raise
    finally:
        st.running_rids.discard(job.rid)


async def _run_curve(request: web.Request, st: ServerState, job: Job) -> web.StreamResponse:
    """The throughput curve (batch.py): the batch decides when the answer is done; then it is sent at once."""
    gen = job.gen
    plen = gen.prompt_tokens
    if not st.cfg.disable_radix_cache:
        prompt = gen.prompt_ids if gen.cache_ids is None else gen.cache_ids
        hashes = PrefixCache.prefix_hashes(prompt + gen.output_ids[:-1])
        job.cached = min(st.cache.match(hashes[:plen]), plen - 1)
        st.cache.insert(hashes)
    if job.fault == "abort":
        job.gen = gen = gen.cut(gen.completion_tokens // 2, "abort")
    try:
        await st.curve().run(plen, plen - job.cached, gen.completion_tokens, _max_new(job, st.cfg), st.cfg.queue_timeout)
    except QueueFull as e:
        st.count(job.route, "503")
        st.log_request(job.route, job.rid, job.body, "error:503", message=str(e))
        return _error(job.route, 503, str(e))
    job.timed = True
    return await (_stream(request, st, job) if job.stream else _plain(request, st, job))


def _max_new(job: Job, cfg) -> int:
    if job.route == CHAT:
        return chat_max_tokens(job.body) or max(1, cfg.context_length - job.gen.prompt_tokens)
    sp = job.body.get("sampling_params") or {}
    return int(sp.get("max_new_tokens", 128)) if isinstance(sp, dict) else 128


def _timing(st: ServerState, job: Job) -> tuple[float, float]:
    """(prefill seconds, seconds per decode token); none once the batch has timed it (the curve)."""
    cfg = st.cfg
    if job.timed:
        return 0.0, 0.0
    pre = (job.gen.prompt_tokens - job.cached) / cfg.prefill_tok_per_s if cfg.prefill_tok_per_s > 0 else 0.0
    dt = 1.0 / cfg.tok_per_s if cfg.tok_per_s > 0 else 0.0
    return pre, dt


def _finish_stats(st: ServerState, job: Job, ttft: float) -> None:
    gen = job.gen
    e2e = time.monotonic() - job.t0
    st.record_done(gen.prompt_tokens, job.cached, gen.completion_tokens, e2e, ttft)
    st.count(job.route, "200")
    st.log_request(job.route, job.rid, job.body, gen.finish, prompt_tokens=gen.prompt_tokens,
                   completion_tokens=gen.completion_tokens, cached_tokens=job.cached,
                   received=time.time() - e2e)  # a line is written when the answer is done: `time` is its end


def _chat_extras(st: ServerState, job: Job, finish_meta: bool) -> dict:
    body, gen, cfg = job.body, job.gen, st.cfg
    extra: dict[str, Any] = {}
    ids_field = cfg.behaviour.output_ids_field
    # SGLang (0.5.17+) puts the prompt ids on the choice for either flag
    if body.get("return_prompt_token_ids") or (body.get("return_token_ids") and ids_field):
        extra["prompt_token_ids"] = gen.prompt_ids
    if body.get("return_token_ids") and ids_field:
        extra[ids_field] = gen.output_ids
    if finish_meta and body.get("return_meta_info"):
        extra["meta_info"] = meta_info(job.rid, gen, job.cached, _native_finish(gen),
                                       time.monotonic() - job.t0, cfg, job.fault == "weight_switch")
    return extra


def body_model(body: dict, cfg) -> str:
    """SGLang's chat answers echo request.model (the served name when the request names none)."""
    model = body.get("model")
    return model if isinstance(model, str) and model else cfg.served_model_name


def _sglext_ids(cfg, job: Job) -> dict | None:
    """0.5.23: the ids a stream asked for with return_*_ids_in_sglext, in one chunk after the last token."""
    if not cfg.behaviour.stream_ids_in_sglext:
        return None
    ext: dict[str, Any] = {}
    if job.body.get("return_input_ids_in_sglext"):
        ext["input_ids"] = job.gen.prompt_ids
    if job.body.get("return_output_ids_in_sglext"):
        ext["output_ids"] = [job.gen.output_ids]
    return ext or None


def _native_finish(gen: Generation) -> dict:
    if gen.finish == "abort":
        return {"type": "abort", "message": "Request aborted (emulated fault).", "status_code": None,
                "err_type": None}
    return native_finish(gen)


def _generate_body(st: ServerState, job: Job, e2e: float) -> dict:
    gen, cfg = job.gen, st.cfg
    mi = meta_info(job.rid, gen, job.cached, _native_finish(gen), e2e, cfg, job.fault == "weight_switch")
    return {"text": gen.text, "output_ids": gen.output_ids, "meta_info": mi}


async def _plain(request: web.Request, st: ServerState, job: Job) -> web.StreamResponse:
    cfg, gen = st.cfg, job.gen
    pre, dt = _timing(st, job)
    total = pre + dt * gen.completion_tokens
    if total > 0:
        await asyncio.sleep(total)
    if job.route == CHAT:
        parser = cfg.thinking_parser
        usage = chat_usage(gen, job.cached, cfg.enable_cache_report, parser)
        metadata = weight_metadata(cfg.weight_version, gen.completion_tokens, cfg.behaviour.weight_version_spans,
                                   job.fault == "weight_switch")
        obj = chat_body(job.rid, body_model(job.body, cfg), gen, usage, metadata, parser,
                        _chat_extras(st, job, True))
    else:
        obj = _generate_body(st, job, time.monotonic() - job.t0)
    if job.fault == "reset":
        return await _reset(request, st, job, orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY))
    _finish_stats(st, job, pre + dt)
    return json_response(obj)


async def _reset(request: web.Request, st: ServerState, job: Job, data: bytes) -> web.StreamResponse:
    """Send the headers and part of the body, then drop the connection."""
    st.count(job.route, "reset")
    st.log_request(job.route, job.rid, job.body, "reset")
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    resp.content_length = len(data)
    await resp.prepare(request)
    await resp.write(data[: max(1, len(data) // 2)])
    _abort(request)
    return resp


def _abort(request: web.Request) -> None:
    tr = request.transport
    if tr is not None:
        tr.abort()


async def _stream(request: web.Request, st: ServerState, job: Job) -> web.StreamResponse:
    cfg, gen = st.cfg, job.gen
    pre, dt = _timing(st, job)
    slow = cfg.slow_stream_s
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    n = gen.completion_tokens
    cut = n // 2 if job.fault in ("400", "500", "reset") else None
    created = int(time.time())
    model = body_model(job.body, cfg)
    chat = job.route == CHAT
    parser = cfg.thinking_parser
    deltas, finish, matched = stream_answer_of(gen, parser) if chat else (None, None, None)
    buf: list[bytes] = []
    if chat:
        buf.append(chunk_bytes(job.rid, created, model, {"role": "assistant", "content": ""}))
    start = time.monotonic()
    ttft = pre + dt
    for i in range(n):
        if cut is not None and i == cut:
            break
        due = start + pre + (i + 1) * dt + i * slow - time.monotonic()
        if due > 0.001:
            if buf:
                await resp.write(b"".join(buf))
                buf.clear()
            await asyncio.sleep(due)
        if chat:
            d = deltas[i]
            if d:
                buf.append(chunk_bytes(job.rid, created, model, d))
        else:
            part = gen.cut(i + 1, "")
            mi = {"id": job.rid, "finish_reason": None, "prompt_tokens": gen.prompt_tokens,
                  "weight_version": cfg.weight_version, "completion_tokens": i + 1, "cached_tokens": job.cached}
            buf.append(b"data: " + orjson.dumps({"text": part.text, "output_ids": part.output_ids,
                                                 "meta_info": mi}) + b"\n\n")
    if cut is not None:
        if buf:
            await resp.write(b"".join(buf))
        if job.fault == "reset":
            st.count(job.route, "reset")
            st.log_request(job.route, job.rid, job.body, "reset")
            _abort(request)
            return resp
        status = int(job.fault)  # SGLang aborts the request with this status after the stream started
        st.count(job.route, "stream_error")
        st.log_request(job.route, job.rid, job.body, f"stream_error:{status}")
        await resp.write(stream_error_event(status, _FAULT_MESSAGES[status]) + _DONE)
        await resp.write_eof()
        return resp
    if chat:
        buf.append(b"data: " + orjson.dumps(
            {"id": job.rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": {"role": None, "content": None, "reasoning_content": None,
                                                "tool_calls": None},
                          "logprobs": None, "finish_reason": finish, "matched_stop": matched}],
             "usage": None}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n")
        ext = _sglext_ids(cfg, job)
        if ext:
            buf.append(b"data: " + orjson.dumps({"id": job.rid, "object": "chat.completion.chunk",
                                                 "created": created, "model": model, "choices": [],
                                                 "usage": None, "sglext": ext}) + b"\n\n")
        so = job.body.get("stream_options") or {}
        if so.get("include_usage"):
            usage = chat_usage(gen, job.cached, cfg.enable_cache_report, parser)
            buf.append(chunk_bytes(job.rid, created, model, None, usage=usage))
    else:
        final = _generate_body(st, job, time.monotonic() - job.t0)
        buf.append(b"data: " + orjson.dumps(final, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n")
    buf.append(_DONE)
    await resp.write(b"".join(buf))
    await resp.write_eof()
    _finish_stats(st, job, ttft)
    return resp
