"""Hidden states from SGLang's /generate: parsed at the byte level, aligned, stored as bf16 Parquet.

Alignment convention (what every stored matrix means)
-----------------------------------------------------
Let the sample's tokens be `token_ids = prompt_ids + output_ids` (T = P + C tokens). Row i of the stored
matrix is the hidden state the server computed when it fed token i (at position i). The last generated
token is never fed back, so it has no vector: the matrix has exactly T - 1 rows,
    rows [0, P)        the prefill block (element [0] of SGLang's ragged `meta_info.hidden_states`),
    rows [P, P + C - 1) one per decode step (elements [1:]),
and `align()` refuses anything else. A prefill block shorter than P means the server's prefix cache
served part of the prompt (those positions get no row): an endpoint error (`HiddenPrefixShortfall`)
telling to run the server with --disable-radix-cache. We store exactly what the server returned; the
exports say how they handle the missing last row.

Encoding: little-endian bf16 bit patterns (uint16). SGLang's values are bf16-exact JSON floats, so the
conversion is exact; a value that is not bf16-exact is rounded to nearest even and counted in
`GenerateResult.n_inexact` (`strict=True` refuses it instead).

Memory: `parse_generate_response` never builds Python floats. It cuts the `hidden_states` array out of
the body, parses the rest (text, ids, meta_info) with orjson, and converts the numbers with a compiled
kernel (hidden/kernel.py) straight into one uint16 buffer, sized from the bytes per row of the
first 16 rows (over-estimated; pages never written are never resident). Only if that estimate falls short
are further chunks of `chunk_rows` rows appended and joined at the end. So the working set besides the
body is about one bf16 matrix (2x in the rare short-estimate case).

Public API
----------
parse_generate_response(body, expected_width, *, strict=False) -> GenerateResult
align(prompt_tokens, completion_tokens, n_prefill, n_rows) -> None
estimate_bytes(n_prompts, tokens_per_sample, width) -> int
check_free_space(path, needed_bytes, force) -> dict
HiddenPartWriter, hidden_parts, referenced_hidden_parts, garbage_hidden_parts, iter_hidden, HiddenSample
    (hidden/parts.py), export_hidden (export/hidden.py)
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..core.errors import EndpointFatal, RegenError, StorageError, TerminalForPrompt
from . import kernel as hk
from .parts import HiddenMatrix

TB = 1e12


# --- errors -----------------------------------------------------------------------------------------------
class HiddenStateError(RegenError):
    """Base of the hidden-state errors (each also derives from the taxonomy class that decides the action)."""


class HiddenWidthMismatch(EndpointFatal, HiddenStateError):
    """The server returns vectors of another width (e.g. EAGLE instead of EAGLE3): the endpoint leaves the fleet."""


class HiddenPrefixShortfall(EndpointFatal, HiddenStateError):
    """The prefill block is shorter than the prompt: the server's prefix cache is on. The endpoint is misconfigured."""


class HiddenStateMismatch(TerminalForPrompt, HiddenStateError):
    """The hidden states of one answer are malformed or do not line up with the token counts."""


class CaptureSampleError(TerminalForPrompt, HiddenStateError):
    """The capture route cannot take one sample (an id past the model's vocabulary, a sequence past its context):
    names the prompt and sample; only that prompt fails."""


class StoredLayoutMismatch(HiddenStateError):
    """A stored sample does not have capture.json's layout (a capture that mixed two models): names the sample."""


class InsufficientStorage(StorageError):
    """The estimated hidden-state bytes do not fit in the free space (unless forced)."""


# --- parsing ----------------------------------------------------------------------------------------------
@dataclass
class GenerateResult(HiddenMatrix):
    text: str
    output_ids: list[int]
    meta: dict[str, Any]  # meta_info without hidden_states
    hidden: np.ndarray  # uint16 bf16 bit patterns [n_rows, width]
    n_prefill: int  # rows of element [0] (the prefill block)
    n_inexact: int = 0  # values that were not bf16-exact and were rounded to nearest even
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys of the body


_KEY = re.compile(rb'"hidden_states"\s*:\s*')
_WS = b" \t\r\n"


def _find_value(body: bytes) -> int:
    """Offset of the value of the `"hidden_states"` key (a key, not text inside a string: its opening quote
    is not escaped, and a string can't hold an unescaped quote followed by a colon)."""
    for m in _KEY.finditer(body):
        i, backslashes = m.start() - 1, 0
        while i >= 0 and body[i] == 0x5C:
            backslashes, i = backslashes + 1, i - 1
        if backslashes % 2 == 0:
            return m.end()
    return -1


def _skip(body: bytes, p: int) -> int:
    n = len(body)
    while p < n and body[p] in _WS:
        p += 1
    return p


def _expect(body: bytes, p: int, char: bytes, what: str) -> int:
    p = _skip(body, p)
    if body[p:p + 1] != char:
        raise HiddenStateMismatch(f"hidden_states: expected {char.decode()!r} at byte {p} ({what}), "
                                  f"found {body[p:p + 20]!r}")
    return p + 1


def _syntax(body: bytes, pos: int) -> HiddenStateMismatch:
    return HiddenStateMismatch(f"hidden_states: not an array of JSON numbers at byte {pos}: {body[pos:pos + 40]!r}")


class _Sink:
    """Where parsed rows go: a small first buffer to learn the bytes per row, then one buffer sized from the
    bytes left (over-estimated: pages never written stay virtual, so they cost no memory), then, only if
    that runs out, further chunks joined at the end."""

    def __init__(self, width: int, body_len: int, chunk_rows: int):
        self.width, self.body_len, self.chunk_rows = width, body_len, chunk_rows
        self.buffers: list[np.ndarray] = []  # filled arrays, in order
        self.current: np.ndarray | None = None
        self.filled = 0  # rows filled in `current`
        self.rows = 0
        self.first_pos: int | None = None
        self.estimated = False

    def target(self, pos: int) -> np.ndarray:
        if self.current is not None and self.filled < self.current.shape[0]:
            return self.current[self.filled:]
        if self.first_pos is None:
            self.first_pos, cap = pos, min(16, self.chunk_rows)
        elif not self.estimated and self.rows:
            self.estimated = True
            per_row = max((pos - self.first_pos) / self.rows, 1.0)
            cap = self.rows + int((self.body_len - pos) / (0.8 * per_row)) + 16
            big = np.empty((cap, self.width), dtype=np.uint16)
            big[:self.rows] = self.current  # the small first buffer moves to the front
            self.current, self.filled = big, self.rows
            return big[self.filled:]
        else:
            cap = self.chunk_rows
        if self.current is not None:
            self.buffers.append(self.current)
        self.current, self.filled = np.empty((cap, self.width), dtype=np.uint16), 0
        return self.current

    def wrote(self, n: int) -> None:
        self.filled += n
        self.rows += n

    def matrix(self) -> np.ndarray:
        parts = self.buffers + ([self.current[:self.filled]] if self.current is not None and self.filled else [])
        self.buffers, self.current = [], None
        if not parts:
            return np.empty((0, self.width), dtype=np.uint16)
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts)  # only when the estimate was short (rows much longer than the first ones)


def _rows(body: bytes, p: int, width: int, sink: _Sink) -> tuple[int, int, int]:
    """Parse rows from `p` up to and including the enclosing ']'. Returns (end, rows, inexact)."""
    rows = inexact = 0
    while True:
        res = hk.parse_rows(body, p, width, sink.target(p))
        sink.wrote(res.rows)
        inexact += res.inexact
        rows += res.rows
        if res.status == hk.END:
            return res.pos, rows, inexact
        if res.status == hk.FULL:
            p = res.pos
            continue
        if res.status == hk.WIDTH:
            raise HiddenWidthMismatch(
                f"hidden-state width {res.bad_width} does not match expected_width {width} "
                f"(row {sink.rows}); a server started with EAGLE instead of EAGLE3, or without "
                f"--enable-return-aux-hidden-states, returns one layer instead of the auxiliary layers")
        raise _syntax(body, res.pos)


def parse_generate_response(body: bytes, expected_width: int, *, strict: bool = False,
                            chunk_rows: int | None = None) -> GenerateResult:
    """Parse a non-streaming /generate response carrying `meta_info.hidden_states` (full mode).

    Checks the ragged structure (element [0] 2-D, then 1-D vectors) and that every row has
    `expected_width` values (else `HiddenWidthMismatch`, naming both widths). Does not check the counts
    against the token counts: call `align()` with the meta's prompt/completion tokens for that.
    """
    body = bytes(body)
    start = _find_value(body)
    if start < 0:
        raise HiddenStateMismatch("the response has no meta_info.hidden_states (was return_hidden_states sent, "
                                  "and does the server run with --enable-return-hidden-states?)")
    if chunk_rows is None:
        chunk_rows = max(1, (8 << 20) // (2 * expected_width))  # ~8 MB of bf16 per chunk
    sink = _Sink(expected_width, len(body), chunk_rows)
    n_prefill = n_rows = inexact = 0
    p = _expect(body, start, b"[", "the start of hidden_states")
    p = _skip(body, p)
    if body[p:p + 1] == b"]":  # [] : no vector at all (a single generated token)
        end = p + 1
    else:
        p = _expect(body, p, b"[", "element [0], the 2-D prefill block")
        p = _skip(body, p)
        if body[p:p + 1] == b"]":  # an empty prefill block
            p += 1
        elif body[p:p + 1] == b"[":
            p, n_prefill, bad = _rows(body, p, expected_width, sink)
            inexact += bad
        else:
            raise HiddenStateMismatch("hidden_states[0] is not 2-D: expected the prefill block [[...], ...] "
                                      f"at byte {p}, found {body[p:p + 20]!r}")
        n_rows = n_prefill
        p = _skip(body, p)
        if body[p:p + 1] == b",":
            end, n_dec, bad = _rows(body, p + 1, expected_width, sink)
            n_rows += n_dec
            inexact += bad
        elif body[p:p + 1] == b"]":
            end = p + 1
        else:
            raise _syntax(body, p)
    if strict and inexact:
        raise HiddenStateMismatch(f"{inexact} hidden-state values are not bf16-exact")
    try:
        rest = orjson.loads(body[:start] + b"null" + body[end:])
    except orjson.JSONDecodeError as exc:
        raise HiddenStateMismatch(f"the /generate response is not valid JSON: {exc}") from None
    meta = rest.get("meta_info") if isinstance(rest, dict) else None
    if not isinstance(meta, dict) or "hidden_states" not in meta or meta["hidden_states"] is not None:
        raise HiddenStateMismatch("hidden_states is not a key of meta_info in the /generate response")
    del meta["hidden_states"]
    hidden = sink.matrix()
    extra = {k: v for k, v in rest.items() if k not in ("text", "output_ids", "meta_info")}
    return GenerateResult(text=rest.get("text", ""), output_ids=list(rest.get("output_ids") or []), meta=meta,
                          hidden=hidden, n_prefill=n_prefill, n_inexact=inexact, extra=extra)


# --- alignment --------------------------------------------------------------------------------------------
def align(prompt_tokens: int, completion_tokens: int, n_prefill: int, n_rows: int) -> None:
    """Refuse hidden states that do not cover prompt + completion minus the last generated token."""
    if n_prefill < prompt_tokens:
        raise HiddenPrefixShortfall(
            f"the server's prefix cache served {prompt_tokens - n_prefill} of {prompt_tokens} prompt tokens "
            f"(the prefill block has {n_prefill} rows): those positions have no hidden state. Run the server "
            "with --disable-radix-cache (and a --chunked-prefill-size larger than the longest prompt).")
    if n_prefill != prompt_tokens:
        raise HiddenStateMismatch(f"the prefill block has {n_prefill} rows for {prompt_tokens} prompt tokens")
    expected = prompt_tokens + max(completion_tokens - 1, 0)
    if n_rows != expected:
        raise HiddenStateMismatch(
            f"{n_rows} hidden-state rows for {prompt_tokens} prompt + {completion_tokens} completion tokens; "
            f"expected {expected} (the last generated token has no vector)")


# --- storage ----------------------------------------------------------------------------------------------
def estimate_bytes(n_prompts: int, tokens_per_sample: int, width: int) -> int:
    """Bytes the hidden parts will take: prompts x tokens x (2 x width bf16 + 4 for the token id).
    Parquet's own overhead is a few hundred bytes per sample (measured ratio ~1.000x), left out."""
    return int(n_prompts) * int(tokens_per_sample) * (2 * int(width) + 4)


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human_bytes(n: float) -> str:
    """Decimal units, about 3 significant digits: 612 kB, 7.74 TB (a small need is never "0.00 TB")."""
    unit = "B"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            break
        n /= 1000
    digits = 0 if unit == "B" or abs(n) >= 100 else (1 if abs(n) >= 10 else 2)
    return f"{n:.{digits}f} {unit}"


GENERATION_ADVICE = "Free space, point output_dir elsewhere, lower the prompt count or max tokens"


def check_free_space(path: str | Path, needed_bytes: int, force: bool,
                     advice: str = GENERATION_ADVICE) -> dict[str, Any]:
    """Refuse (InsufficientStorage) when `needed_bytes` exceed the free space of the filesystem holding
    `path` (or its nearest existing parent), unless `force`. `advice`: what the caller's user can change.
    Returns {needed_bytes, free_bytes, fits, message}."""
    where = _existing(Path(path))
    free = shutil.disk_usage(where).free
    fits = needed_bytes <= free
    message = (f"hidden states need about {human_bytes(needed_bytes)} ({needed_bytes:,} bytes); "
               f"{human_bytes(free)} free at {where}")
    if not fits and not force:
        raise InsufficientStorage(f"{message}. {advice}, or pass --force to start anyway.")
    return {"needed_bytes": int(needed_bytes), "free_bytes": int(free), "fits": fits, "message": message}


# The storage half of the API, re-exported (parts.py imports nothing from this module).
from .parts import (
    HiddenPartWriter,
    HiddenSample,
    garbage_hidden_parts,
    hidden_parts,
    iter_hidden,
    referenced_hidden_parts,
)

__all__ = ["GenerateResult", "HiddenPartWriter", "HiddenPrefixShortfall", "HiddenSample", "HiddenStateError",
           "HiddenStateMismatch", "CaptureSampleError", "HiddenWidthMismatch", "InsufficientStorage", "StoredLayoutMismatch",
           "align", "check_free_space", "human_bytes",
           "estimate_bytes", "garbage_hidden_parts", "hidden_parts", "iter_hidden", "parse_generate_response",
           "referenced_hidden_parts"]
