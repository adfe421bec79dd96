"""The capacity case: `concurrency: auto` against fixed concurrencies, on emulators with a throughput curve.

Three emulators (--throughput-curve, /metrics on): a small one (its KV pool admits about 20 requests: retracts
when driven hard), a large one (batch 160, knee 64) and a slow one (steps twice as long, knee 32). The same prompts
go through regen at concurrency 8, 64, each server's best fixed value (a sweep of each emulator alone with the load
generator, in this run), and `auto`. Reported: fleet completions/s ÷ the best fixed run's, request timeouts and
other errors, retractions, the time auto took to settle (per endpoint: when its limit entered ±10% of its final
value and stayed; its last change and count of changes beside it), and the emulators' own CPU use (kept
far from the two cores' limit by steps of 5-10 ms and answers of ~200 tokens).
"""
from __future__ import annotations

import asyncio
import os
import re
import urllib.request
from pathlib import Path

import orjson

from ..emulator.loadgen import run_loadgen
from .cases import Ctx, Result, fmt, regen_run
from .env import emulators, write_prompts

PREFILL = 20_000  # prefill tok/s: a retracted request's prefill again stalls its whole batch
SERVERS = [  # (name, emulator options): steps of 5-10 ms, answers of ~200 tokens
    ("small", {"capacity": 48, "knee": 8, "step_ms": 5, "max_total_num_tokens": 4800, "prefill_tok_per_s": PREFILL}),
    ("large", {"capacity": 160, "knee": 64, "step_ms": 5, "max_total_num_tokens": 400_000,
               "prefill_tok_per_s": PREFILL}),
    ("slow", {"capacity": 64, "knee": 32, "step_ms": 10, "max_total_num_tokens": 400_000,
              "prefill_tok_per_s": PREFILL}),
]
SWEEP = (8, 16, 32, 48, 64, 96, 128, 160)


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _retracted(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(r"^sglang:num_retracted_requests_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _sweep(url: str, max_tokens: int, quick: bool) -> tuple[int, float]:
    """The best fixed concurrency of one emulator alone: (concurrency, req/s)."""
    best = (0, 0.0)
    for c in SWEEP:
        r = asyncio.run(run_loadgen(url, concurrency=c, duration=5.0 if quick else 8.0, max_tokens=max_tokens,
                                    warmup=3.0))
        if r["req_per_s"] > best[1] * 1.02:
            best = (c, r["req_per_s"])
    return best


def _errors(folder: Path) -> tuple[int, int, str]:
    """(timeouts, other errors, how auto settled: per endpoint, when its limit entered ±10% of its final value
    and stayed, its last change and how many changes it made)."""
    status = orjson.loads((folder / "out" / "bench" / "status.json").read_bytes())
    timeouts = errors = 0
    settled = []
    for label, stats in (status.get("endpoints") or {}).items():
        for kind, n in (stats.get("errors") or {}).items():
            errors += n
        timeouts += int("timeout" in (stats.get("last_error") or "").lower())
        if stats.get("concurrency_settled_s") is not None:
            name = dict((f"e{i}", n) for i, (n, _) in enumerate(SERVERS)).get(label, label)
            settled.append(f"{name} at {stats['concurrency']} after {stats['concurrency_settled_s']:.1f} s "
                           f"(last change {stats['concurrency_last_change_s']:.1f} s, "
                           f"{stats['concurrency_changes']} changes)")
    return timeouts, errors, "; ".join(settled)


def _steady_rate(folder: Path) -> float:
    """Completions/s over the second half of the run's records (by created_at): past auto's start-up."""
    import pyarrow.parquet as pq

    parts = sorted((folder / "out" / "bench" / "data").glob("part-*.parquet"))
    times = sorted(t.timestamp() for p in parts for t in pq.read_table(p, columns=["created_at"]).column(0)
                   .to_pylist())
    half = len(times) // 2
    return (len(times) - half) / max(1e-9, times[-1] - times[half])


def capacity(ctx: Ctx) -> Result:
    n, max_tokens = (3000, 256) if ctx.quick else (6000, 256)
    res = Result("capacity")
    w = ctx.folder("capacity")
    prompts = write_prompts(w / "prompts.jsonl", n)
    per = [dict(opts) for _, opts in SERVERS]
    with emulators(len(SERVERS), per=per, throughput_curve=True, enable_metrics=True) as fleet:
        urls = [e.url for e in fleet]
        best = [_sweep(u, max_tokens, ctx.quick) for u in urls]
        ctx.head.ensure()
        runs = {"8": 8, "64": 64, "best fixed": [c for c, _ in best], "auto": "auto"}
        rates: dict[str, float] = {}
        steady: dict[str, float] = {}
        for label, conc in runs.items():
            cpu0 = [_cpu_s(e.pid) for e in fleet]
            ret0 = [_retracted(u) for u in urls]
            run, _ = regen_run(ctx, w / f"regen-{label.replace(' ', '-')}", urls, conc, prompts, max_tokens)
            assert run.rows == n, (run.rows, n)
            cpu = sum(_cpu_s(e.pid) for e in fleet) - sum(cpu0)
            retracted = sum(_retracted(u) for u in urls) - sum(ret0)
            timeouts, errors, settled = _errors(w / f"regen-{label.replace(' ', '-')}")
            rates[label] = n / run.makespan_s
            steady[label] = _steady_rate(w / f"regen-{label.replace(' ', '-')}")
            res.rows.append((f"concurrency {label}: completions/s (whole run; second half)",
                             f"{fmt(rates[label], 1)}; {fmt(steady[label], 1)}", "", None))
            res.notes.append(f"concurrency {label}: {run.makespan_s:.1f} s, {int(retracted)} retractions, "
                             f"{errors} errors ({timeouts} timeouts), emulators' CPU {cpu / run.makespan_s:.2f} "
                             f"cores of 2" + (f"; auto settled within 10% of its final limit: {settled}"
                                              if settled else ""))
        ratio = rates["auto"] / rates["best fixed"]
        res.rows.insert(0, ("auto ÷ each server's best fixed concurrency (fleet completions/s)", f"{fmt(ratio)}×",
                            "≥ 0.95×", ratio >= 0.95))
        res.rows.insert(1, ("auto ÷ best fixed, second half of each run (past auto's start-up)",
                            f"{fmt(steady['auto'] / steady['best fixed'])}×", "", None))
        res.rows.insert(2, ("64 ÷ best fixed", f"{fmt(rates['64'] / rates['best fixed'])}×", "", None))
        res.rows.insert(3, ("8 ÷ best fixed", f"{fmt(rates['8'] / rates['best fixed'])}×", "", None))
    res.notes.insert(0, "sweep (each emulator alone, load generator): " + "; ".join(
        f"{name} best at {c} ({r:.0f} req/s)" for (name, _), (c, r) in zip(SERVERS, best))
        + f". {n} prompts, max_tokens {max_tokens}; load average {os.getloadavg()[0]:.1f} at the end.")
    return res
