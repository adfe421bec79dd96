"""The emulated model: a word-level pseudo-tokenizer, a Kimi-like chat template and deterministic generation.

Everything here is a pure function of its inputs, so tests elsewhere can recompute what the server answered
(`expected_chat`). A token is a word, a punctuation mark or a special token; its id is a stable hash mod the vocab.

Output of one request: `prompt_text` (template applied) seeds a word stream. Its natural length is a fraction in
[0.2, 1.5) of max_tokens, so both `stop` and `length` finishes happen. With thinking the stream is
`reasoning </think> answer <|im_end|>`; without, `answer <|im_end|>`. At temperature 0 the seed is ignored.
"""
from __future__ import annotations

import hashlib
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import orjson

from .kimi_parser import parse_answer
from .media import MEDIA_SPECIAL, SeenImage, has_parts, image_marker, keyed_pads, mention, pads_of
from .media_load import prepare_media
from .tools import (KIMI_PARSERS, TOOL_SPECIAL, active_tools, history_calls, json_array_text, kimi_call_text,
                    plan_calls, render_calls, render_tools, result_header, text_pieces)

VOCAB_SIZE = 163840
N_PLAIN = 163584                      # ids below this are plain words; the top 256 are special tokens
SPECIAL = {
    "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588, "<|im_system|>": 163594,
    "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607, **TOOL_SPECIAL, **MEDIA_SPECIAL,
}
EOS_ID = SPECIAL["<|im_end|>"]
THINK_END_ID = SPECIAL["</think>"]
THINK_START_ID = SPECIAL["<think>"]
THINK_END = "</think>"

_TOKEN_RE = re.compile(r"<\|[a-z_]+\|>|</?think>|\w+|[^\w\s]")
_ID_CACHE: dict[str, int] = dict(SPECIAL)

ROLE_TOKENS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
               "tool": "<|im_system|>", "developer": "<|im_system|>"}

_WORDS = (
    "the of and to in is that it for as with was on be by this are from or at an which not have has but all "
    "can more one also will when there their they been we would other so what if its into about some than "
    "only then these two may any time new first could like over such our most after just how where many use "
    "model answer question value number result step check case first second next data point reason because "
    "therefore however consider given each order total sum part list line system word simple clear small large "
    "best good fast slow early late high low true false left right start end input output token prompt layer "
    "state cache queue server client request response error retry batch record field table column row file "
    "path name type size width length count rate speed limit range index key map set item group level mode "
    "plan test proof idea note fact rule term form note view sign path area unit cost price month year day "
    "week hour minute water light power energy heat sound field force mass space earth world city road river "
    "tree plant animal food paper story music color shape image"
).split()
# Punctuation appears about once every eight tokens.
_POOL = _WORDS + [","] * 24 + ["."] * 24
_POOL_IDS: list[int] = []
_POOL_PIECES: list[str] = []


def token_id(tok: str) -> int:
    """Stable id of one token: special ids are fixed, others crc32 mod the plain range."""
    i = _ID_CACHE.get(tok)
    if i is None:
        i = zlib.crc32(tok.encode()) % N_PLAIN
        if len(_ID_CACHE) > 1_000_000:
            _ID_CACHE.clear()
            _ID_CACHE.update(SPECIAL)
        _ID_CACHE[tok] = i
    return i


for _w in _POOL:
    _POOL_IDS.append(token_id(_w))
    _POOL_PIECES.append(_w if not _w.isalnum() else " " + _w)
_N_POOL = len(_POOL)
_PUNCT = {i for i, w in enumerate(_POOL) if not w.isalnum()}
_FIRST_WORDS = list(range(len(_WORDS)))


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def encode(text: str) -> list[int]:
    """Token ids of a text (the pseudo-tokenizer)."""
    get = _ID_CACHE.get
    out = []
    for t in _TOKEN_RE.findall(text):
        i = get(t)
        out.append(i if i is not None else token_id(t))
    return out


def _content_text(content: Any, pads: Iterator[int] | None = None) -> str:
    """A message's text; with `pads` (the placeholder count of each image, in order) an image part is Kimi's
    media marker, without it an image part is dropped (a text-only template). Other media parts are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, dict) and p.get("type") == "image_url" and pads is not None:
                parts.append(image_marker(next(pads)))
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: list[dict], thinking: bool = True, tools: list[dict] | None = None,
                images: list[SeenImage] | None = None) -> str:
    """Kimi-like chat template; the generation prompt ends with <think> (thinking) or <think></think>. Tools,
    calls and results as tools.py renders them (only where present: a tool-free chat renders as it always did).
    `images`: the decoded image of each image part, in order (their placeholders expanded); None drops them."""
    out = [render_tools(tools)] if tools else []
    pads = pads_of(images)
    for m in messages:
        role = m.get("role")
        text = _content_text(m.get("content"), pads)
        if role == "tool":
            text = result_header(m) + text
        elif role == "assistant" and m.get("tool_calls"):
            text += render_calls(m["tool_calls"])
        out.append(f"{ROLE_TOKENS[role]}{role}<|im_middle|>{text}<|im_end|>")
    out.append("<|im_assistant|>assistant<|im_middle|><think>" + ("" if thinking else "</think>"))
    return "".join(out)


def thinking_enabled(req: dict) -> bool:
    """Kimi: on by default; chat_template_kwargs.thinking=false turns it off (enable_thinking is ignored)."""
    ctk = req.get("chat_template_kwargs")
    if isinstance(ctk, dict) and "thinking" in ctk:
        return bool(ctk["thinking"])
    return True


@dataclass
class Generation:
    """One deterministic completion. `pieces` holds the detokenized text of each output token ("" for EOS)."""
    prompt_ids: list[int]
    output_ids: list[int]            # includes </think> and the EOS id when generated
    pieces: list[str]
    n_reason: int                    # reasoning tokens in the natural (uncut) sequence
    finish: str                      # "stop" | "length" | "abort"
    thinking: bool
    # A Kimi tool-call parser reads the answer: (calls in the history, whether calls are numbered per answer)
    tool_parsing: tuple[int, bool] | None = None
    # What the prefix cache keys on when it is not prompt_ids: an image's pads replaced by its pad value
    cache_ids: list[int] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def matched_stop(self) -> int | None:
        return EOS_ID if self.finish == "stop" else None

    @property
    def reasoning_tokens(self) -> int:
        return min(self.n_reason, len(self.output_ids)) if self.thinking else 0

    @property
    def reached_answer(self) -> bool:
        return (not self.thinking) or len(self.output_ids) > self.n_reason

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.pieces[:self.reasoning_tokens]) if self.thinking else None

    @property
    def answer_text(self) -> str:
        if not self.thinking:
            return "".join(self.pieces)
        return "".join(self.pieces[self.n_reason + 1:]) if self.reached_answer else ""

    @property
    def text(self) -> str:
        """Raw detokenized output (skip_special_tokens: EOS dropped, </think> kept)."""
        return "".join(self.pieces)

    def cut(self, n: int, finish: str) -> "Generation":
        """The first n tokens with another finish (used for aborts)."""
        return Generation(self.prompt_ids, self.output_ids[:n], self.pieces[:n], self.n_reason, finish,
                          self.thinking, self.tool_parsing, self.cache_ids)

    def answering(self, pieces: list[str], limit: int | None) -> "Generation":
        """This generation with its answer replaced by `pieces` (then EOS), cut at `limit` tokens. A reasoning cut
        before </think> never reaches the answer: unchanged."""
        head = self.n_reason + 1 if self.thinking else 0
        if len(self.output_ids) < head or (self.thinking and self.output_ids[head - 1] != THINK_END_ID):
            return self
        ids = self.output_ids[:head] + [token_id(p.strip()) for p in pieces] + [EOS_ID]
        texts = self.pieces[:head] + pieces + [""]
        finish = "stop"
        if limit is not None and len(ids) > limit:
            ids, texts, finish = ids[:limit], texts[:limit], "length"
        return Generation(self.prompt_ids, ids, texts, self.n_reason, finish, self.thinking, self.tool_parsing,
                          self.cache_ids)


def _seed(prompt_key: bytes, temperature: float, seed: Any) -> int:
    h = hashlib.blake2b(prompt_key, digest_size=8)
    if temperature and temperature > 0:
        h.update(orjson.dumps([float(temperature), seed]))
    return int.from_bytes(h.digest(), "little")


def generate(prompt_key: bytes, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
             seed: Any = None, thinking: bool = False, ignore_eos: bool = False,
             natural_budget: int | None = None) -> Generation:
    """Deterministic output for a prompt. `prompt_key` identifies the prompt (rendered text or ids bytes)."""
    s = _seed(prompt_key, temperature, seed)
    rng = random.Random(s)
    budget = natural_budget if natural_budget is not None else max_tokens
    frac = 0.2 + 1.3 * ((s >> 40) & 0xFFFF) / 65536.0
    natural = max(2, int(round(budget * frac)))
    if ignore_eos:
        natural = max_tokens + 2           # never stops on its own
    if thinking:
        natural = max(natural, 4)
        rfrac = 0.3 + 0.65 * ((s >> 20) & 0xFFFFF) / 1048576.0
        n_reason = max(1, int(natural * rfrac))
        n_answer = max(1, natural - n_reason - 2)
    else:
        n_reason = 0
        n_answer = max(1, natural - 1)
    draw = rng.choices(range(_N_POOL), k=n_reason + n_answer)
    # Each part starts with a word and the answer ends with a full stop.
    if n_reason and draw[0] in _PUNCT:
        draw[0] = rng.choice(_FIRST_WORDS)
    if draw[n_reason] in _PUNCT:
        draw[n_reason] = rng.choice(_FIRST_WORDS)
    if n_answer >= 2:
        draw[-1] = _N_POOL - 1            # "."
    limit = max_tokens if max_tokens is not None else 1 << 62
    total = n_reason + n_answer + (1 if thinking else 0) + (0 if ignore_eos else 1)
    finish = "length" if total > limit else "stop"

    pool_ids, pool_pieces = _POOL_IDS, _POOL_PIECES
    ids: list[int] = []
    pieces: list[str] = []
    if thinking:
        r = draw[:min(n_reason, limit)]
        ids = [pool_ids[i] for i in r]
        pieces = [pool_pieces[i] for i in r]
        if pieces:
            pieces[0] = pieces[0].lstrip()
        if limit > n_reason:
            ids.append(THINK_END_ID)
            pieces.append(THINK_END)
    room = limit - len(ids)
    if room > 0:
        a = draw[n_reason:n_reason + room]
        first = len(pieces)
        ids.extend(pool_ids[i] for i in a)
        pieces.extend(pool_pieces[i] for i in a)
        if len(pieces) > first:
            pieces[first] = pieces[first].lstrip()
        if finish == "stop" and not ignore_eos:
            ids.append(EOS_ID)
            pieces.append("")
    return Generation(prompt_ids, ids, pieces, n_reason, finish, thinking)


def chat_max_tokens(req: dict) -> int | None:
    v = req.get("max_completion_tokens")
    if v is None:
        v = req.get("max_tokens")
    return v


def chat_generation(req: dict, context_length: int, default_budget: int = 512, tool_parser: str | None = None,
                    local_call_index: bool = True, images: list[SeenImage] | None = None) -> tuple[str, Generation]:
    """Render + generate for a (validated) chat request. Returns (prompt_text, generation). `tool_parser`: the
    server's --tool-call-parser; `local_call_index`: its Kimi parser numbers an answer's calls from 0 (0.5.17+).
    `images`: the images the server decoded, in order (the answer names them); None: image parts are dropped."""
    thinking = thinking_enabled(req)
    tools = active_tools(req)
    prompt_text = render_chat(req["messages"], thinking, tools, images)
    prompt_ids = encode(prompt_text)
    prompt_key = prompt_text.encode()
    if images:
        prompt_key += "".join(im.sha256 for im in images).encode()
    max_tokens = chat_max_tokens(req)
    budget = None
    if max_tokens is None:
        max_tokens = max(1, context_length - len(prompt_ids))
        budget = min(default_budget, max_tokens // 2 or 1)
    plan = plan_calls(req, tools)
    if plan:  # the reasoning before a call is short enough to leave the call room (a quarter of the budget)
        budget = max(1, min(budget or max_tokens, max_tokens // 4))
    gen = generate(prompt_key, prompt_ids, max_tokens, float(req.get("temperature") or 0.0),
                   req.get("seed"), thinking, bool(req.get("ignore_eos")), budget)
    if images:
        gen = _seeing(gen, images, max_tokens)
    if plan:
        history = history_calls(req["messages"])
        kimi = tool_parser in KIMI_PARSERS
        constrained = req.get("tool_choice") not in (None, "auto") and not kimi  # JSON schema, not Kimi's markup
        text = json_array_text(plan) if constrained else kimi_call_text(plan, history)
        gen = gen.answering(text_pieces(text), max_tokens)
        gen.tool_parsing = (history, local_call_index) if kimi else None
    return prompt_text, gen


def _seeing(gen: Generation, images: list[SeenImage], limit: int) -> Generation:
    """The answer starts by naming the images (media.mention); the prefix cache sees each image's own pads."""
    head = gen.n_reason + 1 if gen.thinking else 0
    answer = [p for p in gen.pieces[head:] if p]
    if answer:
        answer[0] = " " + answer[0]
    gen = gen.answering(text_pieces(mention(images)) + answer, limit)
    gen.cache_ids = keyed_pads(gen.prompt_ids, images)
    return gen


def chat_answer(gen: Generation, parser: bool) -> tuple[str, str | None, list[dict] | None, str, int | None]:
    """(content, reasoning_content, tool_calls, finish_reason, matched_stop) as the chat endpoint reports them."""
    content, reasoning = split_reasoning(gen, parser)
    if gen.tool_parsing is None:
        return content, reasoning, None, gen.finish, gen.matched_stop
    history, modern = gen.tool_parsing
    content, calls, finish = parse_answer(content, gen.finish, history, modern)
    return content, reasoning, calls, finish, None if finish != gen.finish else gen.matched_stop


def split_reasoning(gen: Generation, parser: bool) -> tuple[str, str | None]:
    """(content, reasoning_content) as the chat endpoint reports them."""
    if not gen.thinking:
        return gen.answer_text, None
    if not parser:
        return gen.text, None
    return gen.answer_text.strip(), gen.reasoning_text.strip()


def expected_chat(request_json: dict, cfg: Any = None) -> dict:
    """What the emulator answers to a chat request (without faults): content, reasoning_content, finish_reason,
    prompt_tokens, completion_tokens (plus reasoning_tokens and the token ids)."""
    from .config import EmulatorConfig
    cfg = cfg or EmulatorConfig()
    images = None
    if has_parts(request_json["messages"]):  # image parts: read and decoded as the server does (or refused)
        images = prepare_media(request_json["messages"], cfg.behaviour, cfg.image_understanding)
    _, gen = chat_generation(request_json, cfg.context_length, cfg.default_max_tokens, cfg.tool_call_parser,
                             cfg.behaviour.kimi_local_call_index, images)
    parser = cfg.thinking_parser
    content, reasoning, tool_calls, finish, matched_stop = chat_answer(gen, parser)
    return {
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": tool_calls,
        "finish_reason": finish,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "reasoning_tokens": gen.reasoning_tokens if parser else 0,
        "matched_stop": matched_stop,
        "output_ids": gen.output_ids,
        "prompt_ids": gen.prompt_ids,
    }


def expected_generate(request_json: dict, cfg: Any = None) -> dict:
    """What /generate answers (without faults): text, output_ids, finish_reason dict, token counts."""
    p = request_json.get("sampling_params") or {}
    key, ids = generate_prompt(request_json)
    mx = p.get("max_new_tokens", 128)
    gen = generate(key, ids, mx, float(p.get("temperature") or 0.0), p.get("sampling_seed"),
                   bool(ids) and ids[-1] == THINK_START_ID, bool(p.get("ignore_eos")))
    return {"text": gen.text, "output_ids": gen.output_ids, "finish_reason": native_finish(gen),
            "prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens}


def generate_prompt(req: dict) -> tuple[bytes, list[int]]:
    """(prompt key, prompt ids) of a /generate request: raw text (no template) or input_ids.

    A prompt ending with <think> (a rendered chat template with thinking on) makes the model think, so /generate
    with `render_chat(messages)` answers exactly what the chat endpoint answers for `messages`."""
    if req.get("text") is not None:
        text = req["text"]
        return text.encode(), encode(text)
    ids = list(req["input_ids"])
    return b"ids:" + orjson.dumps(ids), ids


def native_finish(gen: Generation) -> dict:
    if gen.finish == "stop":
        return {"type": "stop", "matched": EOS_ID}
    return {"type": "length", "length": gen.completion_tokens}
