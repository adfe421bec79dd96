"""Request validation and response/error bodies, shaped like SGLang's (0.5.9 - 0.5.23)."""
from __future__ import annotations

import math
import time
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from .errors import RequestInvalid
from .tool_schemas import check_tools
from .model import ROLE_TOKENS, VOCAB_SIZE, Generation, chat_answer
from .kimi_parser import stream_answer

JSON = "application/json"
_NUMPY = orjson.OPT_SERIALIZE_NUMPY

ERR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj, option=_NUMPY), status=status, content_type=JSON)


def openai_error_body(status: int, message: str, err_type: str | None = None) -> dict:
    return {"object": "error", "message": message, "type": err_type or ERR_TYPES.get(status, "BadRequestError"),
            "param": None, "code": status}


def openai_error(status: int, message: str, err_type: str | None = None) -> web.Response:
    return json_response(openai_error_body(status, message, err_type), status)


def native_error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status)


def stream_error_event(status: int, message: str) -> bytes:
    """An error after the stream started, as SGLang sends a request aborted with a status (serving_chat.py:
    create_streaming_error_response(message, code.name, code.value)): the type is the HTTPStatus name."""
    error = {"object": "error", "message": message, "type": HTTPStatus(status).name, "param": None, "code": status}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


def parse_json(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestInvalid(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise RequestInvalid("The request body must be a JSON object.")
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestInvalid(f"1 validation error: {key} must be a number, got {v!r}.")
    return float(v)


def _check_sampling(temperature: float | None, top_p: float | None) -> None:
    if temperature is not None and temperature < 0:
        raise RequestInvalid(f"temperature must be non-negative, got {temperature}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestInvalid(f"top_p must be in (0, 1], got {top_p}.")


def validate_chat(body: dict, return_token_ids: bool = True) -> None:
    """`return_token_ids`: the version declares it (before 0.5.17 it is an unknown field, ignored)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestInvalid("1 validation error: messages must be a non-empty list of messages.")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS:
            raise RequestInvalid(f"1 validation error: messages[{i}] must be an object with a role in "
                                 f"{sorted(ROLE_TOKENS)}.")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise RequestInvalid(f"1 validation error: messages[{i}].content must be a string or a list.")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None:
            if not _is_int(v):
                raise RequestInvalid(f"1 validation error: {key} must be an integer, got {v!r}.")
            if v <= 0:
                raise RequestInvalid(f"1 validation error: Value error, {key} must be positive")
    _check_sampling(_num(body, "temperature"), _num(body, "top_p"))
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise RequestInvalid("1 validation error: n must be a positive integer.")
    if n is not None and n > 1:
        raise RequestInvalid("n > 1 is not supported by the emulator.")
    if not isinstance(body.get("stream", False), bool):
        raise RequestInvalid("1 validation error: stream must be a boolean.")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestInvalid("1 validation error: seed must be an integer.")
    for key in ("chat_template_kwargs", "stream_options"):
        v = body.get(key)
        if v is not None and not isinstance(v, dict):
            raise RequestInvalid(f"1 validation error: {key} must be an object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestInvalid("1 validation error: model must be a string.")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestInvalid("1 validation error: rid must be a string.")
    if body.get("stream"):
        if body.get("return_prompt_token_ids"):
            raise RequestInvalid("return_prompt_token_ids is not supported with streaming. "
                                 "Please set stream=false when using return_prompt_token_ids=true.")
        if body.get("return_token_ids") and return_token_ids:
            raise RequestInvalid("return_token_ids is not supported with streaming on /v1/chat/completions. "
                                 "Please set stream=false when using return_token_ids=true.")
        if body.get("return_meta_info"):
            raise RequestInvalid("return_meta_info is not supported with streaming. "
                                 "Please set stream=false when using return_meta_info=true.")
    check_tools(body.get("tools"))  # SGLang's _validate_request: each tool's parameters schema (tool_schemas.py)


def validate_generate(body: dict) -> dict:
    """Checks a /generate body; returns its sampling_params (a dict)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise RequestInvalid("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise RequestInvalid("Either text or input_ids should be provided.")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise RequestInvalid("Batch requests are not supported by the emulator.")
    if text is not None and not isinstance(text, str):
        raise RequestInvalid("text must be a string.")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise RequestInvalid("input_ids must be a list of integers.")
        if any(t < 0 or t >= VOCAB_SIZE for t in ids):
            raise RequestInvalid(f"The input_ids contains values outside the vocab size ({VOCAB_SIZE}).")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise RequestInvalid("sampling_params must be an object.")
    mx = sp.get("max_new_tokens", 128)
    if mx is not None and (not _is_int(mx) or mx < 0):
        raise RequestInvalid(f"max_new_tokens must be at least 0, got {mx}.")
    _check_sampling(_num(sp, "temperature"), _num(sp, "top_p"))
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise RequestInvalid("sampling_seed must be an integer.")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestInvalid("rid must be a string.")
    return sp


def check_context(prompt_tokens: int, max_new: int | None, context_len: int) -> None:
    """SGLang's TokenizerManager checks, messages verbatim: the prompt alone `>=`, the total `>` (0.5.14 to
    0.5.23 alike)."""
    if prompt_tokens >= context_len:
        raise RequestInvalid(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                             f"({context_len} tokens).")
    if max_new is not None and max_new + prompt_tokens > context_len:
        raise RequestInvalid(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {max_new + prompt_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.")


# --- bodies --------------------------------------------------------------------------------------
def chat_usage(gen: Generation, cached: int, cache_report: bool, parser: bool) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "completion_tokens": gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached} if cache_report else None,
            "reasoning_tokens": gen.reasoning_tokens if parser else 0}


def weight_metadata(weight_version: str, n_output: int, spans: bool, switch: bool) -> dict:
    """`metadata` of a chat answer (and the weight fields of meta_info): 0.5.23 adds the `weight_versions`
    spans of the finished request; `switch`: the weights changed halfway through it."""
    if not spans:
        return {"weight_version": weight_version}
    if not switch or n_output < 2:
        return {"weight_version": weight_version,
                "weight_versions": [{"version": weight_version, "start": 0, "end": n_output}]}
    half, new = n_output // 2, weight_version + "-next"
    return {"weight_version": new, "weight_versions": [{"version": weight_version, "start": 0, "end": half},
                                                       {"version": new, "start": half, "end": n_output}]}


def chat_body(rid: str, model: str, gen: Generation, usage: dict, weight_version: str | dict, parser: bool,
              extra_choice: dict | None = None) -> dict:
    """`weight_version`: the version, or the whole metadata (weight_metadata)."""
    content, reasoning, tool_calls, finish, matched_stop = chat_answer(gen, parser)
    choice = {"index": 0,
              "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                          "tool_calls": tool_calls},
              "logprobs": None, "finish_reason": finish, "matched_stop": matched_stop}
    if extra_choice:
        choice.update(extra_choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage,
            "metadata": weight_version if isinstance(weight_version, dict) else {"weight_version": weight_version}}


def chunk_bytes(rid: str, created: int, model: str, delta: dict | None, finish: str | None = None,
                matched: Any = None, usage: dict | None = None) -> bytes:
    if delta is None:
        choices = []
    else:
        d = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
        d.update(delta)
        choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish, "matched_stop": matched}]
    obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": choices, "usage": usage}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_deltas(gen: Generation, parser: bool) -> list[dict]:
    """One delta per output token, as the reasoning parser splits them (EOS and </think> give no text)."""
    return stream_answer_of(gen, parser)[0]


def stream_answer_of(gen: Generation, parser: bool) -> tuple[list[dict], str, Any]:
    """(one delta per output token, the stream's last finish_reason, matched_stop). With a Kimi tool-call parser,
    the answer's tokens go through its streaming parser (kimi_parser.py): content outside the calls' markup, the
    calls as tool_calls fragments."""
    out = []
    n_reason = gen.n_reason if gen.thinking else -1
    start = len(gen.pieces) if gen.tool_parsing is None else n_reason + 1 if gen.thinking and parser else 0
    for i, piece in enumerate(gen.pieces[:start]):
        if not piece:
            out.append({})
        elif gen.thinking and parser and i < n_reason:
            out.append({"reasoning_content": piece})
        elif gen.thinking and parser and i == n_reason:
            out.append({})            # the </think> token itself
        else:
            out.append({"content": piece})
    if gen.tool_parsing is None:
        return out, gen.finish, gen.matched_stop
    history, modern = gen.tool_parsing
    calls, finish = stream_answer(gen.pieces[min(start, len(gen.pieces)):], gen.finish, history, modern)
    return out + calls, finish, None if finish != gen.finish else gen.matched_stop


def meta_info(rid: str, gen: Generation, cached: int, finish: dict, e2e: float, cfg: Any,
              switch: bool = False) -> dict:
    mi = {"id": rid, "finish_reason": finish, "prompt_tokens": gen.prompt_tokens,
          "weight_version": cfg.weight_version, "total_retractions": 0,
          "completion_tokens": gen.completion_tokens, "cached_tokens": cached}
    mi.update(weight_metadata(cfg.weight_version, gen.completion_tokens, cfg.behaviour.weight_version_spans, switch))
    if cfg.is_speculative:
        from .metrics import spec_accept_rate
        ct = gen.completion_tokens
        mi["spec_accept_length"] = cfg.accept_length
        mi["spec_accept_rate"] = spec_accept_rate(cfg.accept_length, cfg.speculative_num_steps)
        mi["spec_verify_ct"] = math.ceil(ct / max(1.0, cfg.accept_length))
    mi["e2e_latency"] = e2e
    return mi
