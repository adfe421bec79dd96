"""Benchmark: JSON hidden states -> bf16 Parquet (`python -m pipeline.bench.hidden`).

Three ingest paths over the same /generate bodies (values from the emulator's bf16-exact hidden-vector
function), each timed on one core, parse + write of one hidden part:
  naive     json.loads + numpy.array (float32) + >> 16
  orjson    orjson.loads + numpy.array (float32) + >> 16
  regen     pipeline.hidden.parse.parse_generate_response (byte-level kernel) -- the pipeline's path
Then, in a subprocess each (so ru_maxrss is its own), the peak memory of parsing + writing one 4K-token
answer at width 21504 with the regen path, beyond the body itself, against the bf16 matrix; and the
bytes on disk against the ideal 2 x width x rows.

`run(...)` returns a dict for BENCHMARKS.md; `main()` prints the table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..emulator.hidden import hidden_rows
from ..hidden import parse as H
from ..hidden import kernel as hk
from ..store.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def make_body(prompt_ids: list[int], output_ids: list[int], width: int, chunk: int = 128) -> bytes:
    """The emulator's /generate body (orjson bytes, as it serves them), built chunk by chunk so a 4K-token body
    never needs the float32 matrix at once."""
    plen, n_out = len(prompt_ids), len(output_ids)

    def rows(ids, start) -> list[bytes]:
        out = []
        for i in range(0, len(ids), chunk):
            block = hidden_rows(ids[i:i + chunk], range(start + i, start + i + len(ids[i:i + chunk])), width)
            out.append(orjson.dumps(block, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1])
        return out

    meta = orjson.dumps({"id": "bench", "finish_reason": {"type": "length", "length": n_out},
                         "prompt_tokens": plen, "completion_tokens": n_out, "cached_tokens": 0})
    parts = [b'{"text":"bench","output_ids":', orjson.dumps(output_ids), b',"meta_info":', meta[:-1],
             b',"hidden_states":[[', b",".join(rows(prompt_ids, 0)), b"]"]
    if n_out > 1:
        parts += [b",", b",".join(rows(output_ids[:-1], plen))]
    parts.append(b"]}}")
    return b"".join(parts)


def _to_bf16(hs: list) -> tuple[np.ndarray, int]:
    mats = [np.array(hs[0], dtype=np.float32)]
    if len(hs) > 1:
        mats.append(np.array(hs[1:], dtype=np.float32))
    f32 = np.concatenate(mats) if len(mats) > 1 else mats[0]
    return (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16), len(hs[0])


def ingest_naive(body: bytes, width: int):
    obj = json.loads(body)
    hs = obj["meta_info"].pop("hidden_states")
    hidden, n_prefill = _to_bf16(hs)
    return obj, hidden, n_prefill


def ingest_orjson(body: bytes, width: int):
    obj = orjson.loads(body)
    hs = obj["meta_info"].pop("hidden_states")
    hidden, n_prefill = _to_bf16(hs)
    return obj, hidden, n_prefill


def ingest_regen(body: bytes, width: int):
    r = H.parse_generate_response(body, width)
    H.align(r.meta["prompt_tokens"], r.meta["completion_tokens"], r.n_prefill, r.n_rows)
    return r.meta, r.hidden, r.n_prefill


METHODS: dict[str, Callable] = {"naive json+numpy": ingest_naive, "orjson+numpy": ingest_orjson,
                                "regen": ingest_regen}


def _write(run: RunDir, hidden: np.ndarray, prompt: list[int], output: list[int], tag: str) -> Path:
    w = H.HiddenPartWriter(run, tag=tag)
    w.add("bench", 0, prompt + output, len(prompt), hidden)
    name, _ = w.commit()
    return Path(run.path / "hidden" / name)


def _cpu() -> float:
    return time.process_time()


def measure_throughput(width: int, prompt_tokens: int, completion_tokens: int, repeats: int,
                       tmp: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 160_000, prompt_tokens).tolist()
    output = rng.integers(1, 160_000, completion_tokens).tolist()
    body = make_body(prompt, output, width)
    run = RunDir(tmp / "tp")
    results: dict[str, Any] = {"json_mb": len(body) / 1e6, "rows": prompt_tokens + completion_tokens - 1,
                               "width": width, "methods": {}}
    reference = None
    for name, fn in METHODS.items():
        best_wall = best_cpu = float("inf")
        for _ in range(repeats):
            gc.collect()
            w0, c0 = time.perf_counter(), _cpu()
            _, hidden, _ = fn(body, width)
            path = _write(run, hidden, prompt, output, "bench")
            wall, cpu = time.perf_counter() - w0, _cpu() - c0
            best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
            if reference is None:
                reference = hidden
            elif not np.array_equal(reference, hidden):
                raise AssertionError(f"{name} disagrees with the naive parser")
            del hidden
            path.unlink()
        results["methods"][name] = {"wall_s": best_wall, "cpu_s": best_cpu,
                                    "mb_per_s": len(body) / 1e6 / best_wall,
                                    "mb_per_cpu_s": len(body) / 1e6 / best_cpu}
    return results


def measure_disk(width: int, rows_per_sample: int, samples: int, tmp: Path) -> dict[str, Any]:
    run = RunDir(tmp / "disk")
    w = H.HiddenPartWriter(run, tag="disk")
    rng = np.random.default_rng(1)
    ideal = 0
    for i in range(samples):
        ids = rng.integers(1, 160_000, rows_per_sample + 1).tolist()
        f32 = hidden_rows(ids[:-1], range(rows_per_sample), width)
        w.add(f"s{i}", 0, ids, rows_per_sample // 2, (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
        ideal += 2 * width * rows_per_sample
    name, _ = w.commit()
    size = (run.path / "hidden" / name).size()
    return {"samples": samples, "rows_per_sample": rows_per_sample, "width": width, "bytes": size,
            "ideal_bytes": ideal, "ratio": size / ideal}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_child(body_path: str, width: int, out_dir: str) -> dict[str, Any]:
    """In a fresh process: read the body, then parse + align + write; peak RSS beyond the body."""
    body = Path(body_path).read_bytes()
    import pyarrow  # noqa: F401  (imports before the baseline)
    hk.c_kernel()
    gc.collect()
    reset = _reset_peak()
    base = _rss_bytes()
    t0 = time.perf_counter()
    r = H.parse_generate_response(body, width)
    H.align(r.meta["prompt_tokens"], r.meta["completion_tokens"], r.n_prefill, r.n_rows)
    parse_peak = _peak_rss()
    prompt = list(range(r.meta["prompt_tokens"]))
    _write(RunDir(Path(out_dir)), r.hidden, prompt, r.output_ids, "peak")
    total_peak = _peak_rss()
    return {"body_bytes": len(body), "matrix_bytes": int(r.hidden.nbytes), "rss_before": base,
            "peak_reset": reset, "parse_extra": max(parse_peak, base) - base,
            "total_extra": max(total_peak, base) - base, "seconds": time.perf_counter() - t0,
            "kernel": hk.kernel_name()}


def measure_peak(width: int, tokens: int, tmp: Path) -> dict[str, Any]:
    prompt_tokens = 512
    rng = np.random.default_rng(2)
    body = make_body(rng.integers(1, 160_000, prompt_tokens).tolist(),
                     rng.integers(1, 160_000, tokens - prompt_tokens + 1).tolist(), width)
    body_path = tmp / "peak-body.json"
    body_path.write_bytes(body)
    del body
    code = ("import json, sys; from pipeline.bench.hidden import _peak_child; "
            "print(json.dumps(_peak_child(sys.argv[1], int(sys.argv[2]), sys.argv[3])))")
    proc = subprocess.run([sys.executable, "-c", code, str(body_path), str(width), str(tmp / "peak")],
                          capture_output=True, text=True, cwd=str(REPO), check=True)
    body_path.unlink()
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["parse_ratio"] = res["parse_extra"] / res["matrix_bytes"]
    res["total_ratio"] = res["total_extra"] / res["matrix_bytes"]
    return res


def run(width: int = 21504, prompt_tokens: int = 256, completion_tokens: int = 257, repeats: int = 2,
        peak_tokens: int = 4096, disk_samples: int = 4, disk_rows: int = 512) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="regen-bench-hidden-") as d:
        tmp = Path(d)
        tp = measure_throughput(width, prompt_tokens, completion_tokens, repeats, tmp)
        disk = measure_disk(width, disk_rows, disk_samples, tmp)
        peak = measure_peak(width, peak_tokens, tmp) if peak_tokens else None
    return {"kernel": hk.kernel_name(), "throughput": tp, "disk": disk, "peak": peak,
            "goals": {"mb_per_s": 200, "peak_ratio": 3.0, "disk_ratio": 1.02}}


def table(res: dict[str, Any]) -> str:
    tp = res["throughput"]
    lines = [(f"hidden-state ingest: JSON -> bf16 Parquet, one core, {tp['rows']} rows x {tp['width']} "
              f"({tp['json_mb']:.0f} MB of JSON), kernel={res['kernel']}"),
             f"{'path':<20} {'wall s':>8} {'MB/s':>8} {'MB/cpu-s':>9}"]
    for name, m in tp["methods"].items():
        lines.append(f"{name:<20} {m['wall_s']:>8.2f} {m['mb_per_s']:>8.0f} {m['mb_per_cpu_s']:>9.0f}")
    regen = tp["methods"]["regen"]["mb_per_s"]
    lines.append(f"regen vs orjson+numpy: {regen / tp['methods']['orjson+numpy']['mb_per_s']:.2f}x, "
                 f"vs naive: {regen / tp['methods']['naive json+numpy']['mb_per_s']:.2f}x (goal >= 200 MB/s)")
    if res["peak"]:
        p = res["peak"]
        lines.append(f"peak memory, one {p['matrix_bytes'] // (2 * tp['width']) + 1}-token answer at width "
                     f"{tp['width']}: bf16 matrix {p['matrix_bytes'] / 1e6:.0f} MB, body {p['body_bytes'] / 1e6:.0f} MB; "
                     f"beyond the body: parse {p['parse_extra'] / 1e6:.0f} MB ({p['parse_ratio']:.2f}x), "
                     f"parse + write {p['total_extra'] / 1e6:.0f} MB ({p['total_ratio']:.2f}x) (goal <= 3x); "
                     f"{p['seconds']:.1f} s")
    d = res["disk"]
    lines.append(f"bytes on disk: {d['bytes']:,} for ideal {d['ideal_bytes']:,} ({d['samples']} samples x "
                 f"{d['rows_per_sample']} rows x {d['width']}): {d['ratio']:.4f}x (goal <= 1.02x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.hidden", description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=21504)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--completion-tokens", type=int, default=257)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peak-tokens", type=int, default=4096, help="0: skip the peak-memory measurement")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    args = ap.parse_args(argv)
    res = run(args.width, args.prompt_tokens, args.completion_tokens, args.repeats, args.peak_tokens)
    print(table(res))
    if args.json:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
