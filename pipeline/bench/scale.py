"""The benchmarks at production scale: the 88K-prompt production shape end to end, resume of an 88K-prompt run
directory, and memory over a long run."""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from ..store import schema
from .cases import Ctx, Result, fmt
from .env import (
    REPO,
    RssSampler,
    emulators,
    median,
    start_regen,
    write_config,
    write_prompts,
)

_LETTERS = np.frombuffer(b"etaoinshrdlucmfwypvbgkqjxz     ", dtype=np.uint8)  # ~1 space in 6 characters


def _texts(rng: np.random.Generator, n: int, size: int) -> pa.Array:
    """n distinct strings of about `size` bytes (letters and spaces: compresses about like prose)."""
    lengths = rng.integers(size // 2, size * 3 // 2, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = _LETTERS[rng.integers(0, len(_LETTERS), int(offsets[-1]))]
    return pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.tobytes())).cast(pa.string())


def _token_ids(rng: np.random.Generator, n: int, mean: int) -> pa.Array:
    lengths = rng.integers(mean // 2, mean * 3 // 2, n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 163840, int(offsets[-1]),
                                                                               dtype=np.int32)))


def build_run_dir(config: Path, n_prompts: int, n_done: int, n_failed: int, part_rows: int = 512) -> Path:
    """A run directory written by regen's own store code: the manifest of `config`, a prompt set of n_prompts
    (~2 KB user messages), n_done records (~4 KB content, token ids) in parts of `part_rows`, n_failed failures."""
    from ..core.config import load_config
    from ..run import manifest_for
    from ..store.rundir import RunDir, now_utc

    cfg = load_config(config)
    run = RunDir(Path(cfg.output_dir) / cfg.run_name)
    run.create()
    run.write_manifest(manifest_for(cfg, str(config)))
    rng = np.random.default_rng(0)
    user = _texts(rng, n_prompts, 2048)
    ids = [hashlib.sha256(f"bench:{i}".encode()).hexdigest()[:32] for i in range(n_prompts)]
    roles = pa.array(["user"] * n_prompts)
    nulls = pa.nulls(n_prompts, pa.string())
    messages = pa.ListArray.from_arrays(pa.array(np.arange(n_prompts + 1, dtype=np.int32)),
                                        pa.StructArray.from_arrays(
                                            [roles, user, pa.nulls(n_prompts, schema.MESSAGE6.field("parts").type),
                                             nulls, nulls, nulls], fields=list(schema.MESSAGE6)))
    prompts = pa.Table.from_arrays([pa.array(ids), pa.array(["bench"] * n_prompts),
                                    pa.array([f"bench.jsonl:{i + 1}" for i in range(n_prompts)]), nulls, messages,
                                    nulls, nulls, nulls, pa.nulls(n_prompts, pa.uint64()),
                                    pa.array(np.zeros(n_prompts, np.int32))], schema=schema.PROMPTS)
    run.write_prompt_set(prompts, schema.REJECTS.empty_table())
    order = rng.permutation(n_prompts)  # done prompts are not a prefix of the prompt set
    done, failed = order[:n_done], order[n_done:n_done + n_failed]
    now = pa.scalar(now_utc(), pa.timestamp("ms", tz="UTC"))
    for start in range(0, n_done, part_rows):
        rows = done[start:start + part_rows]
        k = len(rows)
        content = _texts(rng, k, 4096)
        cols = {
            "prompt_id": pa.array([ids[i] for i in rows]), "turn_index": pa.array(np.zeros(k, np.int32)),
            "n_turns": pa.array(np.ones(k, np.int32)), "source": pa.array(["bench"] * k),
            "messages": messages.take(pa.array(rows)), "reference": pa.nulls(k, pa.string()), "content": content,
            "reasoning_content": pa.nulls(k, pa.string()), "finish_reason": pa.array(["stop"] * k),
            "flags": pa.array([[]] * k, pa.list_(pa.string())),
            "prompt_tokens": pa.array(np.full(k, 512, np.int32)),
            "completion_tokens": pa.array(np.full(k, 1024, np.int32)),
            "cached_tokens": pa.nulls(k, pa.int32()), "reasoning_tokens": pa.nulls(k, pa.int32()),
            "endpoint": pa.array(["e0"] * k), "model": pa.array([cfg.model] * k),
            "weight_version": pa.array(["default"] * k), "config_fingerprint": pa.array([cfg.fingerprint()] * k),
            "latency_s": pa.array(np.full(k, 12.5)), "attempts": pa.array(np.ones(k, np.int32)),
            "seed": pa.nulls(k, pa.int64()), "request_id": pa.array([f"r{start + j}" for j in range(k)]),
            "prompt_token_ids": _token_ids(rng, k, 512), "output_token_ids": _token_ids(rng, k, 1024),
            "created_at": pa.array([now.as_py()] * k, pa.timestamp("ms", tz="UTC")),
        }
        # Columns added to the schema later are nullable: left null here.
        run.write_part(run.data, pa.Table.from_arrays(
            [cols[f.name] if f.name in cols else pa.nulls(k, f.type) for f in schema.RECORDS], schema=schema.RECORDS))
    if n_failed:
        k = len(failed)
        run.write_part(run.failures, pa.Table.from_pylist(
            [{"prompt_id": ids[i], "source": "bench", "error_class": "terminal", "status": 400,
              "message": "context overflow", "endpoint": "e0", "attempts": 1, "config_fingerprint": cfg.fingerprint(),
              "created_at": now.as_py()} for i in failed[:k]], schema=schema.FAILURES))
    return Path(run.path)


_LEDGER = """
import sys, time, orjson
t0 = time.perf_counter()
import pyarrow.parquet as pq
from pipeline.store.rundir import RunDir
t1 = time.perf_counter()
run = RunDir(__import__('pathlib').Path(sys.argv[1]))
committed = run.committed_ids()
t2 = time.perf_counter()
failed = run.failed_ids() - committed
all_ids = pq.read_table(run.prompt_set_versions()[-1], columns=['prompt_id']).column(0).to_pylist()
done = committed | failed
pending = [p for p in all_ids if p not in done]
t3 = time.perf_counter()
prompts = run.load_prompt_set()
t4 = time.perf_counter()
print(orjson.dumps({'import_s': t1 - t0, 'committed_s': t2 - t1, 'pending_s': t3 - t1, 'full_prompt_set_s': t4 - t3,
                    'parts': len(run.parts(run.data)), 'pending': len(pending), 'done': len(done)}).decode())
"""


def resume(ctx: Ctx) -> Result:
    n_prompts, n_done, n_failed = 88_000, 80_000, 200
    res = Result("resume")
    w = ctx.folder("resume")
    prompts = write_prompts(w / "unused.jsonl", 1)  # the stored prompt set is used; the source is not re-read
    log = w / "requests.jsonl"
    with emulators(1, logs=w, tok_per_s=0) as fleet:
        config = write_config(w, [fleet[0].url], 64, prompts, 8, run_name="resume88k")
        t0 = time.perf_counter()
        run = build_run_dir(config, n_prompts, n_done, n_failed)
        build_s = time.perf_counter() - t0
        size_mb = sum(p.stat().st_size for p in run.rglob("*") if p.is_file()) / 2**20
        ledgers = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", _LEDGER, str(run)], capture_output=True, text=True, cwd=REPO,
                                 timeout=120, check=True)
            ledgers.append(orjson.loads(out.stdout.strip().splitlines()[-1]))
        assert ledgers[0]["pending"] == n_prompts - n_done - n_failed, ledgers[0]
        firsts = []
        for k in range(6):  # retried when another user's `ray stop` ended our head mid-run
            if len(firsts) == (1 if ctx.quick else 2):
                break
            log = w / "e0.jsonl"
            log.write_bytes(b"")
            ctx.head.ensure()
            started = time.time()
            proc = start_regen(config, ctx.head.env(), w / f"regen-{k}.log")
            first = _first_logged(log, proc, timeout=180)
            proc.send_signal(signal.SIGTERM)  # a clean stop: the run stays resumable
            proc.wait(60)
            if first is not None:
                firsts.append(first - started)
            elif ctx.head.alive():
                raise RuntimeError((w / f"regen-{k}.log").read_text(errors="replace")[-3000:])
    pending_s = median([x["pending_s"] for x in ledgers])
    res.rows += [
        ("pending set: ledger + failures + prompt ids (88K prompts, 80K done)", f"{fmt(pending_s)} s", "≤ 2 s",
         pending_s <= 2.0),
        ("reading the whole stored prompt set (messages too)", f"{fmt(median([x['full_prompt_set_s'] for x in ledgers]))} s",
         "", None),
        ("command start → first request sent (Ray head already up)",
         f"{fmt(median(firsts))} s" if firsts else "no request seen", "", None),
    ]
    res.notes.append(
        f"Run directory written by RunDir.write_prompt_set / write_part: {n_prompts} prompts (~2 KB user message), "
        f"{n_done} records (~4 KB content, ~512 + ~1024 token ids) in {ledgers[0]['parts']} parts of 512 rows, "
        f"{n_failed} failures; {size_mb:.0f} MB on disk, built in {build_s:.0f} s. Page cache warm. The pending "
        f"set is timed in a fresh process (median of 3, imports excluded: {fmt(ledgers[0]['import_s'])} s). The "
        "command is `regen generate` on that directory against an emulator with a request log; it is stopped "
        "with SIGTERM after the first request.")
    return res


def _first_logged(log: Path, proc: subprocess.Popen, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(log, "rb") as f:
                line = f.readline()
            if line.endswith(b"\n"):
                return orjson.loads(line)["time"]
        except OSError:
            pass
        time.sleep(0.01)
    return None


# --- 5. memory ------------------------------------------------------------------------------------------
def memory(ctx: Ctx) -> Result:
    n, max_tokens = (4000, 2048) if ctx.quick else (20_000, 2048)
    res = Result("memory")
    w = ctx.folder("memory")
    prompts = write_prompts(w / "prompts.jsonl", n)
    with emulators(2, tok_per_s=0) as fleet:
        config = write_config(w, [e.url for e in fleet], 64, prompts, max_tokens)
        ctx.head.ensure()
        proc = start_regen(config, ctx.head.env(), w / "regen.log")
        sampler = RssSampler(proc.pid, ctx.head, w / "out" / "bench", interval=0.5)
        sampler.start()
        rc = proc.wait(1800)
        sampler.stop()
    if rc != 0:
        raise RuntimeError((w / "regen.log").read_text(errors="replace")[-3000:])
    samples = [s for s in sampler.samples if s["done"] is not None]
    driver_peak = max(s["driver_mb"] for s in sampler.samples)
    total_peak = max(s["driver_mb"] + s["actors_mb"] for s in sampler.samples)
    actors_peak = max(s["actors_mb"] for s in sampler.samples)
    # The trend: driver RSS at each quarter of the run, and its slope over the second half.
    quarters = []
    for q in (0.25, 0.5, 0.75, 1.0):
        near = [s for s in samples if s["done"] <= q * n]
        quarters.append(near[-1]["driver_mb"] if near else float("nan"))
    half = [s for s in samples if s["done"] >= n / 2]
    slope = 0.0
    if len(half) >= 3:
        x = np.array([s["done"] for s in half], float)
        y = np.array([s["driver_mb"] for s in half], float)
        if np.ptp(x) > 0:
            slope = float(np.polyfit(x, y, 1)[0]) * 1000
    flat = driver_peak <= 1024 and slope * 88 < 256  # < 256 MB extrapolated over 88K prompts
    res.rows += [
        ("driver peak RSS", f"{driver_peak:.0f} MB", "≤ 1 GB, flat", flat),
        ("driver RSS at 25/50/75/100% of the run", " / ".join(f"{x:.0f}" for x in quarters) + " MB", "", None),
        ("driver RSS slope over the second half", f"{slope:+.2f} MB per 1K prompts", "", None),
        ("driver + endpoint actors peak RSS", f"{total_peak:.0f} MB (actors {actors_peak:.0f} MB)", "", None),
    ]
    tokens = _completion_tokens(w / "out" / "bench")
    res.notes.append(
        f"Scaled down from 88K: {n} prompts, max_tokens {max_tokens} ({tokens / n:.0f} completion tokens per record "
        f"on average, with token ids), 2 instant emulators, concurrency 64 each, default flush settings; RSS "
        f"sampled every 0.5 s ({len(sampler.samples)} samples). Flat means the second-half slope extrapolates to "
        f"less than 256 MB over 88K prompts.")
    return res


def _completion_tokens(run: Path) -> int:
    import pyarrow.parquet as pq

    return int(sum(pq.read_table(p, columns=["completion_tokens"]).column(0).to_numpy().sum()
                   for p in (run / "data").glob("part-*.parquet")))


# --- 6. the production shape ----------------------------------------------------------------------------------
def production(ctx: Ctx) -> Result:
    """88K prompts through 16 emulated endpoints x 64 concurrency, time-compressed, default checkpointing: it
    completes with nothing lost and nothing doubled; driver RSS (live samples only), commit overhead, wall time
    against the emulators' ideal."""
    n, endpoints, concurrency, max_tokens = (8_800 if ctx.quick else 88_000), 16, 64, 32
    # Time compression: each request decodes max_tokens at tok_s, so the fleet's ideal is
    # endpoints x concurrency requests every max_tokens / tok_s seconds (about 400 completions/s here,
    # what the client side sustains on 2 cores; instant answers would measure only the client).
    tok_s = 12.5
    res = Result("production")
    w = ctx.folder("production")
    prompts = write_prompts(w / "prompts.jsonl", n)
    with emulators(endpoints, tok_per_s=tok_s, capacity=concurrency) as fleet:
        config = write_config(w, [e.url for e in fleet], concurrency, prompts, max_tokens)
        ctx.head.ensure()
        started = time.monotonic()
        proc = start_regen(config, ctx.head.env(), w / "regen.log")
        sampler = RssSampler(proc.pid, ctx.head, w / "out" / "bench", interval=1.0)
        sampler.start()
        rc = proc.wait(3600)
        wall = time.monotonic() - started
        sampler.stop()
    if rc != 0:
        raise RuntimeError((w / "regen.log").read_text(errors="replace")[-3000:])
    import pyarrow.parquet as pq

    run = w / "out" / "bench"
    ids = [pid for part in sorted((run / "data").glob("part-*.parquet"))
           for pid in pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()]
    status = orjson.loads((run / "status.json").read_bytes())
    lost, doubled = n - len(set(ids)), len(ids) - len(set(ids))
    ideal = -(-n // (endpoints * concurrency)) * max_tokens / tok_s
    live = [s for s in sampler.samples if s["done"] is not None]
    driver_peak = max(s["driver_mb"] for s in sampler.samples)
    half = [s for s in live if s["done"] >= n / 2]
    slope = 0.0
    if len(half) >= 3 and np.ptp([s["done"] for s in half]) > 0:
        slope = float(np.polyfit([s["done"] for s in half], [s["driver_mb"] for s in half], 1)[0]) * 1000
    commit_s = float(status.get("commit_s", 0.0))
    res.rows += [
        ("prompts committed / lost / doubled", f"{len(set(ids))} / {lost} / {doubled}", "0 lost, 0 doubled",
         lost == 0 and doubled == 0),
        ("driver peak RSS (live samples only)", f"{driver_peak:.0f} MB", "≤ 1 GB, flat",
         driver_peak <= 1024 and slope * 88 < 256),
        ("driver RSS slope over the second half", f"{slope:+.2f} MB per 1K prompts", "", None),
        ("wall time vs the emulators' ideal", f"{wall:.0f} s vs {ideal:.0f} s = {wall / ideal:.2f}x", "", None),
        ("commit overhead: time writing parts / wall time", f"{commit_s:.1f} s / {wall:.0f} s = "
         f"{100 * commit_s / wall:.1f}%", "", None),
    ]
    res.notes.append(
        f"{n} prompts, {endpoints} emulators x concurrency {concurrency} (capacity {concurrency}), {max_tokens} tokens "
        f"at {tok_s} tok/s per request; default flush settings (512 records or 30 s); {len(live)} RSS samples of "
        f"the live driver, one a second. Wall time includes start-up (Ray actors, preflight); the ideal is the "
        "fleet's own: ceil(n / (endpoints x concurrency)) x max_tokens / tok_s.")
    return res
