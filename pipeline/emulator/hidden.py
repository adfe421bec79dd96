"""Deterministic, bf16-exact hidden-state vectors.

Value of column c for token id t at position p:
    h = mix32(mix32(t * 0x9E3779B1 + p * 0x85EBCA77) + c * 0xC2B2AE3D)
    v = ((h >> 24) - 128) / 32          # an integer in [-128, 127] over 32: exact in bf16
so every value is a multiple of 1/32 in [-4, 3.97], and JSON floats parse back to the same bf16.

Layout of /generate full mode (SGLang's): element [0] is the 2-D block of prefill rows (positions
[start, prompt_len)), then one 1-D vector per decode step, fed token output_ids[j-1] at position prompt_len + j - 1,
for j = 1 .. completion_tokens - 1. Total vectors = completion_tokens; the last generated token has no vector.
"""
from __future__ import annotations

import numpy as np

_M32 = np.uint32(0xFFFFFFFF)
_COL_CACHE: dict[int, np.ndarray] = {}


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    x = x ^ (x >> np.uint32(16))
    return x


def _cols(width: int) -> np.ndarray:
    c = _COL_CACHE.get(width)
    if c is None:
        c = (np.arange(width, dtype=np.uint32) * np.uint32(0xC2B2AE3D))
        _COL_CACHE[width] = c
    return c


def hidden_rows(token_ids, positions, width: int) -> np.ndarray:
    """[n][width] float32 array (bf16-exact values) for the (token id, position) pairs."""
    t = np.asarray(token_ids, dtype=np.uint32).reshape(-1, 1)
    p = np.asarray(positions, dtype=np.uint32).reshape(-1, 1)
    with np.errstate(over="ignore"):
        row = _mix32(t * np.uint32(0x9E3779B1) + p * np.uint32(0x85EBCA77))
        h = _mix32(row + _cols(width)[None, :])
    v = (h >> np.uint32(24)).astype(np.int16) - np.int16(128)
    return v.astype(np.float32) * np.float32(1.0 / 32.0)


def hidden_vector(token_id: int, position: int, width: int) -> np.ndarray:
    """One [width] vector: the state computed when `token_id` is fed at `position`."""
    return hidden_rows([token_id], [position], width)[0]


def prefill_start(prompt_len: int, cached: int, chunk: int) -> int:
    """First prompt position that gets a row: after the cached prefix, and only the final prefill chunk."""
    todo = prompt_len - cached
    if chunk and chunk > 0 and todo > chunk:
        return prompt_len - ((todo - 1) % chunk + 1)
    return cached


def full_hidden_states(prompt_ids: list[int], output_ids: list[int], start: int, width: int) -> list:
    """The ragged list: [prefill block [n][H]] + one [H] per decode step (total = len(output_ids))."""
    n_out = len(output_ids)
    if n_out == 0:
        return []
    plen = len(prompt_ids)
    block = hidden_rows(prompt_ids[start:], range(start, plen), width)
    out: list = [block]
    if n_out > 1:
        dec = hidden_rows(output_ids[:-1], range(plen, plen + n_out - 1), width)
        out.extend(dec)
    return out


def last_hidden_state(prompt_ids: list[int], output_ids: list[int], width: int):
    """What the chat endpoint returns: the last vector of the ragged list, or [] with a single vector."""
    n_out = len(output_ids)
    if n_out <= 1:
        return []
    return hidden_vector(output_ids[-2], len(prompt_ids) + n_out - 2, width)
