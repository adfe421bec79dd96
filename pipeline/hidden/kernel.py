"""The byte-level kernel behind `hidden/parse.py`: JSON rows of floats -> bf16 bit patterns.

`parse_rows(buf, pos, width, out) -> RowsResult` parses a comma-separated sequence of flat JSON arrays
`[n,...,n],[n,...,n],...` that ends with the closing `]` of the enclosing array, starting at `buf[pos]`
(where a row's `[` is expected). It writes each row into `out` (a C-contiguous uint16 [cap, width] array)
as bf16, rounding to nearest even (values SGLang returns are bf16-exact, so this is exact; the number of
values that were not bf16-exact is counted in `inexact`). It stops at the enclosing `]` (END, `pos` just
after it), when `out` is full (FULL, `pos` at the next row), at a row whose width differs (WIDTH), or at
anything that is not JSON numbers in this shape (SYNTAX).

Two implementations with one contract:
- a small C loop (no Python objects at all), compiled once per machine with the system C compiler into
  a cache directory ($REGEN_CACHE_DIR, else $XDG_CACHE_HOME/regen, else ~/.cache/regen) and loaded with
  ctypes. Numbers are read with Clinger's exact fast path (<= 19 significant digits, |exp10| <= 22)
  and strtod otherwise, so every value is correctly rounded.
- a fallback in Python (orjson per row, then numpy), used when no compiler is available or when
  REGEN_HIDDEN_KERNEL=python. Several times slower; same results bit for bit.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

log = logging.getLogger(__name__)

END, FULL, WIDTH, SYNTAX = 1, 2, -2, -1

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const double P10[23] = {1e0,1e1,1e2,1e3,1e4,1e5,1e6,1e7,1e8,1e9,1e10,1e11,1e12,1e13,1e14,1e15,
                               1e16,1e17,1e18,1e19,1e20,1e21,1e22};

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static inline uint16_t to_bf16(double v, int64_t *inexact) {
    float f = (float)v;
    uint32_t b; memcpy(&b, &f, 4);
    uint16_t h;
    if ((b & 0x7f800000u) == 0x7f800000u) {            /* inf or nan */
        h = (uint16_t)(b >> 16);
        if (b & 0x007fffffu) h |= 0x0040;                /* keep nan a (quiet) nan */
        return h;
    }
    h = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    uint32_t back = (uint32_t)h << 16; float fb; memcpy(&fb, &back, 4);
    if ((double)fb != v) (*inexact)++;
    return h;
}

/* One JSON number at p (< e). Returns the end, or NULL if it is not a number. */
static const char *parse_num(const char *p, const char *e, double *out) {
    const char *s = p;
    int neg = 0;
    if (*p == '-') { neg = 1; p++; }
    if (p < e && (*p == 'N' || *p == 'I')) {             /* NaN, Infinity: Python's json writes them */
        if (!neg && e - p >= 3 && memcmp(p, "NaN", 3) == 0) { *out = __builtin_nan(""); return p + 3; }
        if (e - p >= 8 && memcmp(p, "Infinity", 8) == 0) { *out = neg ? -__builtin_inf() : __builtin_inf(); return p + 8; }
        return NULL;
    }
    uint64_t m = 0; int nd = 0, trunc = 0, ndig = 0; long e10 = 0;
    while (p < e && (unsigned)(*p - '0') < 10u) {
        if (nd < 19) { m = m * 10 + (uint64_t)(*p - '0'); if (m) nd++; } else { trunc = 1; e10++; }
        p++; ndig++;
    }
    if (!ndig) return NULL;
    if (p < e && *p == '.') {
        p++;
        int nf = 0;
        while (p < e && (unsigned)(*p - '0') < 10u) {
            if (nd < 19) { m = m * 10 + (uint64_t)(*p - '0'); if (m) nd++; e10--; } else trunc = 1;
            p++; nf++;
        }
        if (!nf) return NULL;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        int eneg = 0; long ev = 0, ne = 0;
        if (p < e && (*p == '+' || *p == '-')) { eneg = (*p == '-'); p++; }
        while (p < e && (unsigned)(*p - '0') < 10u) { if (ev < 100000) ev = ev * 10 + (*p - '0'); p++; ne++; }
        if (!ne) return NULL;
        e10 += eneg ? -ev : ev;
    }
    double v;
    if (m == 0 && !trunc) v = 0.0;
    else if (!trunc && m <= (1ULL << 53) && e10 >= -22 && e10 <= 22) {
        v = (double)m;
        v = e10 < 0 ? v / P10[-e10] : v * P10[e10];
    } else {
        char tmp[512];
        size_t n = (size_t)(p - s);
        if (n >= sizeof tmp) return NULL;
        memcpy(tmp, s, n); tmp[n] = 0;
        *out = strtod(tmp, NULL);
        return p;
    }
    *out = neg ? -v : v;
    return p;
}

/* res: [0] status, [1] pos, [2] rows written, [3] values in the bad row (WIDTH), [4] inexact count */
void regen_parse_rows(const char *buf, int64_t len, int64_t pos, int64_t width, uint16_t *out,
                      int64_t cap, int64_t *res) {
    const char *p = buf + pos, *e = buf + len;
    int64_t rows = 0, inexact = 0;
    for (;;) {
        while (p < e && is_ws((unsigned char)*p)) p++;
        if (rows == cap) { res[0] = 2; break; }
        if (p >= e || *p != '[') { res[0] = -1; break; }
        const char *row_start = p;
        p++;
        uint16_t *dst = out + rows * width;
        int64_t n = 0;
        int ok = 0;
        for (;;) {
            while (p < e && is_ws((unsigned char)*p)) p++;
            if (p >= e) break;
            if (n == 0 && *p == ']') { p++; ok = 1; break; }   /* empty row: a width error below */
            double v;
            const char *q = parse_num(p, e, &v);
            if (!q) break;
            p = q;
            if (n < width) dst[n] = to_bf16(v, &inexact);
            n++;
            while (p < e && is_ws((unsigned char)*p)) p++;
            if (p >= e) break;
            if (*p == ',') { p++; continue; }
            if (*p == ']') { p++; ok = 1; break; }
            break;
        }
        if (!ok) { res[0] = -1; break; }
        if (n != width) { res[0] = -2; res[3] = n; p = row_start; break; }
        rows++;
        while (p < e && is_ws((unsigned char)*p)) p++;
        if (p < e && *p == ',') { p++; continue; }
        if (p < e && *p == ']') { p++; res[0] = 1; break; }
        res[0] = -1; break;
    }
    res[1] = (int64_t)(p - buf);
    res[2] = rows;
    res[4] = inexact;
}
"""


@dataclass
class RowsResult:
    status: int  # END, FULL, WIDTH or SYNTAX
    pos: int  # END: after the enclosing ']'; FULL: at the next row; WIDTH: at the bad row; SYNTAX: where it failed
    rows: int  # rows written into out
    bad_width: int  # WIDTH: how many values the bad row had
    inexact: int  # values that were not bf16-exact (rounded to nearest even)


def _cache_dir() -> Path:
    if os.environ.get("REGEN_CACHE_DIR"):
        return Path(os.environ["REGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "regen"


_FLAGS = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing"]
_lib = None
_lib_tried = False


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    key = hashlib.sha1((C_SOURCE + " ".join(_FLAGS) + platform.machine()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"bf16json-{platform.system().lower()}-{platform.machine()}-{key}.so"
    if not target.exists():
        if not compiler:
            log.warning("no C compiler: hidden states are parsed by the slower Python fallback")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "bf16json.c"
            src.write_text(C_SOURCE)
            built = Path(tmp) / "bf16json.so"
            proc = subprocess.run([compiler, *_FLAGS, "-o", str(built), str(src)], capture_output=True, text=True,
                                  check=False)
            if proc.returncode != 0:
                log.warning("could not compile the hidden-state kernel (%s); using the Python fallback:\n%s",
                            compiler, proc.stderr[-2000:])
                return None
            staged = target.with_name(f".tmp-{target.name}.{uuid.uuid4().hex[:8]}")
            shutil.copyfile(built, staged)
            os.replace(staged, target)  # concurrent builders: the last rename wins, all copies are equal
    lib = ctypes.CDLL(str(target))
    lib.regen_parse_rows.restype = None
    lib.regen_parse_rows.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def c_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (fallback). Built on first use; REGEN_HIDDEN_KERNEL=python disables it."""
    global _lib, _lib_tried
    if os.environ.get("REGEN_HIDDEN_KERNEL", "").lower() == "python":
        return None
    if not _lib_tried:
        _lib_tried = True
        try:
            _lib = _build()
        except OSError as exc:
            log.warning("hidden-state kernel unavailable (%s); using the Python fallback", exc)
            _lib = None
    return _lib


def kernel_name() -> str:
    return "c" if c_kernel() is not None else "python"


def parse_rows(buf: bytes, pos: int, width: int, out: np.ndarray) -> RowsResult:
    assert out.dtype == np.uint16 and out.flags.c_contiguous and out.shape[1] == width
    lib = c_kernel()
    if lib is None:
        return _parse_rows_py(buf, pos, width, out)
    res = np.zeros(5, dtype=np.int64)
    lib.regen_parse_rows(buf, len(buf), pos, width, out.ctypes.data, out.shape[0], res.ctypes.data)
    return RowsResult(int(res[0]), int(res[1]), int(res[2]), int(res[3]), int(res[4]))


# --- the Python fallback ------------------------------------------------------------------------------
_WS = b" \t\r\n"


def _skip_ws(buf: bytes, p: int) -> int:
    n = len(buf)
    while p < n and buf[p] in _WS:
        p += 1
    return p


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


def _parse_rows_py(buf: bytes, pos: int, width: int, out: np.ndarray) -> RowsResult:
    rows, inexact, p = 0, 0, pos
    cap = out.shape[0]
    while True:
        p = _skip_ws(buf, p)
        if rows == cap:
            return RowsResult(FULL, p, rows, 0, inexact)
        if p >= len(buf) or buf[p] != 0x5B:  # '['
            return RowsResult(SYNTAX, p, rows, 0, inexact)
        q = buf.find(b"]", p)
        if q < 0 or buf.find(b"[", p + 1, q) >= 0:
            return RowsResult(SYNTAX, p, rows, 0, inexact)
        try:
            row = np.array(orjson.loads(buf[p:q + 1]))
        except (orjson.JSONDecodeError, ValueError, TypeError):
            return RowsResult(SYNTAX, p, rows, 0, inexact)
        if row.ndim != 1 or (row.size and row.dtype.kind not in "fiu"):
            return RowsResult(SYNTAX, p, rows, 0, inexact)
        row = row.astype(np.float64)
        if row.shape[0] != width:
            return RowsResult(WIDTH, p, rows, row.shape[0], inexact)
        bits, _ = f32_to_bf16(row.astype(np.float32))
        out[rows] = bits
        back = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
        inexact += int(np.count_nonzero((back != row) & ~np.isnan(row)))
        rows += 1
        p = _skip_ws(buf, q + 1)
        if p < len(buf) and buf[p] == 0x2C:  # ','
            p += 1
            continue
        if p < len(buf) and buf[p] == 0x5D:  # ']'
            return RowsResult(END, p + 1, rows, 0, inexact)
        return RowsResult(SYNTAX, p, rows, 0, inexact)
