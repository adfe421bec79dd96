"""float32 -> bfloat16 bit patterns, as the capture stores its states."""
from __future__ import annotations

import numpy as np


def f32_to_bf16(f32: np.ndarray) -> tuple[np.ndarray, int]:
    """float32 -> bf16 bits, round to nearest even (NaN stays NaN). Returns (bits, count of inexact values)."""
    bits = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    special = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    if special.any():
        raw = (bits >> np.uint32(16)).astype(np.uint16)
        nan = special & ((bits & np.uint32(0x7FFFFF)) != 0)
        rounded = np.where(special, raw | np.where(nan, np.uint16(0x40), np.uint16(0)), rounded).astype(np.uint16)
    back = (rounded.astype(np.uint32) << np.uint32(16)).view(np.float32)
    inexact = int(np.count_nonzero((back != f32) & ~np.isnan(f32)))
    return rounded, inexact
