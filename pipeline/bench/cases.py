"""The pipeline benchmarks that drive a fleet: overhead, saturation, stragglers, emulator capacity.

Each returns a `Result`: table rows (metric, value, goal, met?) and notes. Every figure that is compared with
a goal is a ratio against a baseline measured in the same run, on the same emulators.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .env import (
    MODEL,
    REPO,
    RayHead,
    StatsPoller,
    actor_pids_when_ready,
    committed,
    emulators,
    median,
    run_client,
    start_regen,
    wait_regen,
    write_config,
    write_prompts,
)


@dataclass
class Result:
    name: str
    rows: list[tuple[str, str, str, bool | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: str = ""  # markdown


@dataclass
class Ctx:
    work: Path
    quick: bool
    repeat: int
    profile: bool
    _head: RayHead | None = None
    scale_n: int | None = None  # the scale case's prompt count (--n)
    scale_budget_s: float | None = None  # the scale case's new run stops after this long (--scale-budget-s)
    scale_resume_budget_s: float | None = None  # and its resume (--scale-resume-budget-s)

    @property
    def head(self) -> RayHead:
        if self._head is None:
            self._head = RayHead().start()
        return self._head

    def folder(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


@dataclass
class RegenRun:
    rows: int
    started: float  # command start
    first: float  # first request seen at an emulator
    last_commit: float
    rc: int

    @property
    def startup_s(self) -> float:
        return self.first - self.started

    @property
    def makespan_s(self) -> float:
        return self.last_commit - self.first


def regen_run(ctx: Ctx, folder: Path, urls: list[str], concurrency, prompts: Path, max_tokens: int,
              poll: float = 0.025, timeout: float = 600, during=None, **overrides) -> tuple[RegenRun, StatsPoller]:
    """Run `regen generate` to completion; time it from the first request to the last commit.
    If our Ray head was ended from outside during the run, start it again and redo the run once."""
    for attempt in range(4):
        try:
            return _regen_run(ctx, folder, urls, concurrency, prompts, max_tokens, poll, timeout, during,
                              **overrides)
        except RuntimeError:
            if ctx.head.alive() or attempt == 3:
                raise
            print(f"  (the Ray head was ended from outside; restarting it and redoing {folder.name})", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
    raise AssertionError("unreachable")


def _regen_run(ctx: Ctx, folder: Path, urls: list[str], concurrency, prompts: Path, max_tokens: int,
               poll: float, timeout: float, during, **overrides) -> tuple[RegenRun, StatsPoller]:
    ctx.head.ensure()
    cfg = write_config(folder, urls, concurrency, prompts, max_tokens, **overrides)
    poller = StatsPoller(urls, poll)
    poller.start()
    started = time.time()
    proc = start_regen(cfg, ctx.head.env(), folder / "regen.log")
    if during is not None:
        during(proc, poller)
    rc = wait_regen(proc, folder / "regen.log", timeout, alive=ctx.head.alive)
    poller.stop()
    rows, last = committed(folder / "out" / "bench")
    first = poller.first_activity(after=started, skip=3 * len(urls))  # not the preflight's probes
    if rc != 0 or first is None or last is None:
        raise RuntimeError(f"regen run failed (rc {rc}):\n{(folder / 'regen.log').read_text(errors='replace')[-3000:]}")
    return RegenRun(rows, started, first, last, rc), poller


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


# --- 1. overhead ----------------------------------------------------------------------------------------
def overhead(ctx: Ctx) -> Result:
    n, conc, max_tokens = (3000, 64, 8) if ctx.quick else (6000, 64, 8)
    res = Result("overhead")
    w = ctx.folder("overhead")
    prompts = write_prompts(w / "prompts.jsonl", n)
    base_rates, regen_rates, ratios, startups = [], [], [], []
    with emulators(2, tok_per_s=0) as fleet:
        urls = [e.url for e in fleet]
        ctx.head.ensure()  # Ray start-up is measured on its own, before any timed run

        def baseline() -> float:
            out = run_client(["--mode", "pool", "--urls", ",".join(urls), "--prompts", str(prompts),
                              "--concurrency", str(conc), "--max-tokens", str(max_tokens), "--model", MODEL])
            assert out["ok"] == n, out
            return n / out["elapsed_s"]

        def regen(k: int) -> float:
            run, _ = regen_run(ctx, w / f"regen-{k}", urls, conc, prompts, max_tokens)
            assert run.rows == n, (run.rows, n)
            startups.append(run.startup_s)
            return n / run.makespan_s

        for k in range(ctx.repeat):  # alternate the order so drift in the machine's load cancels
            if k % 2 == 0:
                b, g = baseline(), regen(k)
            else:
                g, b = regen(k), baseline()
            base_rates.append(b)
            regen_rates.append(g)
            ratios.append(g / b)
        if ctx.profile:
            res.profile = profile_run(ctx, w, urls, conc, prompts, max_tokens)
    ratio = median(ratios)
    res.rows += [
        ("regen ÷ bare AsyncOpenAI loop (completions/s)", f"{fmt(ratio)}×", "≥ 0.90×", ratio >= 0.9),
        ("regen completions/s (first request → last commit)", fmt(median(regen_rates), 0), "", None),
        ("bare AsyncOpenAI pull loop completions/s", fmt(median(base_rates), 0), "", None),
        ("regen command start → first request (Ray head already up)", f"{fmt(median(startups))} s", "", None),
    ]
    res.notes.append(
        f"2 emulators (tok_per_s 0), concurrency {conc} per endpoint ({2 * conc} in all), {n} prompts, "
        f"max_tokens {max_tokens}, default flush settings (checkpointing on). {ctx.repeat} alternating pairs; "
        f"ratios {', '.join(fmt(r) for r in ratios)}; median reported.")
    return res


def _collapse(raw: Path, top: int = 12) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int]:
    """py-spy raw (collapsed) stacks → (top self, top inclusive) as % of active samples."""
    self_c: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = [_frame(f) for f in stack.split(";") if f]
        if frames:
            self_c[frames[-1]] = self_c.get(frames[-1], 0) + c
        for f in set(frames):
            incl[f] = incl.get(f, 0) + c

    def best(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, 100 * v / max(1, total)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return best(self_c), best(incl), total


def _frame(f: str) -> str:
    """'func (path/to/mod.py:123)' → 'func (mod.py)'."""
    name, _, where = f.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = where.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 and parts[-2] not in ("site-packages",) else parts[-1]
    return f"{name} ({short})"


def profile_run(ctx: Ctx, w: Path, urls: list[str], conc: int, prompts: Path, max_tokens: int) -> str:
    """One more (untimed) regen run with py-spy on the driver and on one endpoint actor."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return "_py-spy is not installed in the venv (`.venv/bin/pip install py-spy`): no profile._\n"
    out = w / "profile"
    out.mkdir(exist_ok=True)
    spies: list[tuple[str, subprocess.Popen, Path, float]] = []

    def during(proc: subprocess.Popen, poller: StatsPoller) -> None:
        deadline = time.time() + 60
        while poller.first_activity(skip=3 * len(urls)) is None and time.time() < deadline:
            time.sleep(0.05)
        duration = 5 if ctx.quick else 6
        targets = [("driver", proc.pid)] + [("actor", pid) for pid in actor_pids_when_ready(ctx.head, 2)[:1]]
        for label, pid in targets:
            dest = out / f"{label}.txt"
            spies.append((label, subprocess.Popen(
                [str(spy), "record", "--pid", str(pid), "--rate", "100", "--nonblocking", "--format", "raw",
                 "--duration", str(duration), "-o", str(dest)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL), dest, duration))

    regen_run(ctx, w / "regen-profiled", urls, conc, prompts, max_tokens, during=during)
    lines = []
    for label, proc, dest, duration in spies:
        proc.wait(60)
        if not dest.exists():
            lines.append(f"_py-spy could not sample the {label} (ptrace not permitted?)._\n")
            continue
        top_self, top_incl, total = _collapse(dest)
        busy = total / (100 * duration)
        lines.append(f"**{label}** — {total} non-idle samples at 100 Hz over {duration} s "
                     f"(≈ {busy:.0%} of one core busy in Python)\n")
        lines.append("| self % | function | | inclusive % | function |\n|---:|---|---|---:|---|")
        for (fs, ps), (fi, pi) in zip(top_self, top_incl):
            lines.append(f"| {ps:.1f} | `{fs}` | | {pi:.1f} | `{fi}` |")
        lines.append("")
    return "\n".join(lines)


# --- 2. saturation --------------------------------------------------------------------------------------
def saturation(ctx: Ctx) -> Result:
    cap, latency, max_tokens = 32, 0.5, 16
    mean_tokens = 0.754 * max_tokens  # the emulator's natural length: [0.2, 1.5) × max_tokens, capped
    tok_per_s = mean_tokens / latency
    seconds = 10 if ctx.quick else 20
    n = int(2 * cap / latency * seconds)
    res = Result("saturation")
    w = ctx.folder("saturation")
    prompts = write_prompts(w / "prompts.jsonl", n)
    fills, fills_all = [], []
    with emulators(2, tok_per_s=tok_per_s, capacity=cap) as fleet:
        urls = [e.url for e in fleet]
        for k in range(1 if ctx.quick else 2):
            run, poller = regen_run(ctx, w / f"regen-{k}", urls, cap, prompts, max_tokens, poll=0.05)
            assert run.rows == n
            # Steady state: after the first request, while the driver still had queued work for every actor
            # (fewer than n - 2·ΣC finished; the last 2·C per endpoint are the drain).
            samples = [(t, row) for t, row in poller.samples if run.first <= t <= run.last_commit]
            base = sum(s.get("requests_finished", 0) for s in samples[0][1]) if samples else 0
            steady = [row for t, row in samples
                      if sum(s.get("requests_finished", 0) for s in row) - base <= n - 2 * 2 * cap
                      and t > run.first + 0.5]
            per_ep = [0.0 if not steady else sum(r[i].get("running", 0) for r in steady) / len(steady)
                      for i in range(len(urls))]
            whole = [sum(r[i].get("running", 0) for _, r in samples) / max(1, len(samples)) for i in range(len(urls))]
            fills.append(min(per_ep) / cap)
            fills_all.append(min(whole) / cap)
    fill = median(fills)
    res.rows += [
        ("mean running ÷ capacity C, steady state (worst endpoint)", f"{fill:.1%}", "≥ 95%", fill >= 0.95),
        ("same over the whole run, ramp and drain included", f"{median(fills_all):.1%}", "", None),
    ]
    res.notes.append(
        f"2 emulators, capacity C={cap} each, ~{latency} s per request (tok_per_s {tok_per_s:.1f}, max_tokens "
        f"{max_tokens}), regen concurrency = C, {n} prompts; `/admin/stats` `running` sampled every 50 ms.")
    return res


# --- 3. stragglers --------------------------------------------------------------------------------------
def stragglers(ctx: Ctx) -> Result:
    cap, fast_latency, max_tokens = 8, 0.2, 16
    tok_fast = 0.754 * max_tokens / fast_latency
    speeds = [tok_fast, tok_fast, tok_fast, tok_fast / 5]
    n = 1024 if ctx.quick else 2048
    res = Result("stragglers")
    w = ctx.folder("stragglers")
    prompts = write_prompts(w / "prompts.jsonl", n)
    ratios, rr_ratios = [], []
    with emulators(4, per=[{"tok_per_s": s} for s in speeds], capacity=cap) as fleet:
        urls = [e.url for e in fleet]
        for k in range(1 if ctx.quick else 2):
            run, _ = regen_run(ctx, w / f"regen-{k}", urls, cap, prompts, max_tokens, poll=0.1)
            assert run.rows == n
            tokens = _total_tokens(w / f"regen-{k}" / "out" / "bench")
            ideal = tokens / (cap * sum(speeds))
            ratios.append(run.makespan_s / ideal)
            if k == 0:
                rr = run_client(["--mode", "shard", "--urls", ",".join(urls), "--prompts", str(prompts),
                                 "--concurrency", str(cap), "--max-tokens", str(max_tokens), "--model", MODEL])
                assert rr["ok"] == n, rr
                assert rr["completion_tokens"] == tokens, (rr["completion_tokens"], tokens)
                rr_ratios.append(rr["elapsed_s"] / ideal)
                rr_s = rr["elapsed_s"]
            regen_s, ideal_s = run.makespan_s, ideal
    ratio = median(ratios)
    res.rows += [
        ("regen makespan ÷ ideal", f"{fmt(ratio)}×", "≤ 1.10×", ratio <= 1.10),
        ("static round-robin sharding makespan ÷ ideal", f"{fmt(median(rr_ratios))}×", "", None),
        ("makespans: ideal / regen / round-robin", f"{fmt(ideal_s, 1)} / {fmt(regen_s, 1)} / {fmt(rr_s, 1)} s", "",
         None),
    ]
    res.notes.append(
        f"4 emulators, capacity {cap} each, three at ~{fast_latency} s per request and one 5× slower; {n} prompts, "
        f"max_tokens {max_tokens}. Ideal = total completion tokens ÷ (C × Σ endpoint tok/s). regen is timed from "
        "the first request to the last commit; round-robin (AsyncOpenAI, 1/4 of the prompts per endpoint up front) "
        "from its first request to its last answer.")
    return res


def _total_tokens(run: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_table(p, columns=["completion_tokens"]).column(0).to_numpy().sum()
               for p in (run / "data").glob("part-*.parquet"))


# --- 6. the emulator's own capacity --------------------------------------------------------------------
def emulator_capacity(ctx: Ctx) -> Result:
    res = Result("emulator")
    rates = []
    with emulators(1, tok_per_s=0) as fleet:
        for _ in range(1 if ctx.quick else 2):
            out = subprocess.run([sys.executable, "-m", "pipeline.emulator.loadgen", "--url", fleet[0].url,
                                  "--concurrency", "128", "--duration", "3", "--max-tokens", "8", "--model", MODEL],
                                 capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
            rates.append(orjson.loads(out.stdout.strip().splitlines()[-1])["req_per_s"])
    rate = median(rates)
    res.rows.append(("one emulator, raw-aiohttp loadgen (128 in flight, max_tokens 8)", f"{fmt(rate, 0)} req/s",
                     "", None))
    res.notes.append("The load generator and the emulator share the same 2 cores; the emulators of the overhead "
                     "benchmark each answer far more than the clients ask of them.")
    return res
