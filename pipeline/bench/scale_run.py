"""The `scale` case (on demand: `make bench ARGS="--only scale" N=1000000`): N real-shaped prompts (multi-turn
ShareGPT conversations, a few KB each) end to end through 16 emulated endpoints with checkpointing on.

1. A new run of all N from the JSONL source: driver peak RSS (materialise, then dispatch), and its pace against
   the emulators' ideal. `--scale-budget-s` stops it (SIGTERM, a clean stop) after that long, for sizes whose
   full run does not fit the time at hand; the pace is then that of the part that ran.
2. The run is set to 90% done: records the new run did not make are written for the prompts that lack one by
   the store's own code (RunDir.write_part, parts of 512 rows as the committer writes them; only the ledger's
   columns filled), or whole parts are removed when it did more. The resume is timed from the command to the
   first prompt request an emulator receives (the Ray head already up), and runs to the end: 0 lost, 0 doubled.
3. Bytes per pending prompt: the driver's structures for the whole set pending (reader.pending, the router's
   queues, the dispatcher's unfinished set), measured in a fresh process as RSS growth over N.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from ..endpoints.probes import PROBE_RID_PREFIX
from .cases import Ctx, Result, fmt
from .env import REPO, RssSampler, emulators, start_regen, write_config

ENDPOINTS, CONCURRENCY, MAX_TOKENS, TOK_S = 16, 64, 32, 12.5  # the production case's time-compressed shape
PART_ROWS = 512  # the committer's default flush
FINAL_TAIL = 2000  # prompts the last session runs when the resume was stopped by its budget
_LETTERS = np.frombuffer(b"etaoinshrdlucmfwypvbgkqjxz     ", dtype=np.uint8)
SYSTEMS = [f"You are assistant number {k}. " + "Answer carefully and cite what you rely on. " * 6 for k in range(5)]


def write_chats(path: Path, n: int, seed: int = 0) -> float:
    """n distinct multi-turn ShareGPT conversations (1 to 3 exchanges, about 3 KB; a third open with one of five shared
    system prompts) as JSONL. Returns the mean bytes per line."""
    rng = np.random.default_rng(seed)
    pool = _LETTERS[rng.integers(0, len(_LETTERS), 1 << 24)].tobytes().decode()
    turns = rng.integers(1, 4, n).tolist()
    lengths = rng.integers(200, 1200, (n, 6)).tolist()
    starts = rng.integers(0, len(pool) - 1200, (n, 6)).tolist()
    size = 0
    with open(path, "wb", buffering=1 << 22) as out:
        for i in range(n):
            conv = [{"from": "system", "value": SYSTEMS[i % 5]}] if i % 3 == 0 else []
            at, length = starts[i], lengths[i]
            for t in range(turns[i]):
                conv.append({"from": "human", "value": f"[{i}.{t}] " + pool[at[2 * t]:at[2 * t] + length[2 * t]]})
                conv.append({"from": "gpt", "value": pool[at[2 * t + 1]:at[2 * t + 1] + length[2 * t + 1]]})
            line = orjson.dumps({"id": i, "conversations": conv}) + b"\n"
            size += len(line)
            out.write(line)
    return size / max(n, 1)


def _log_sizes(logs: list[Path]) -> list[int]:
    return [log.stat().st_size if log.exists() else 0 for log in logs]


def _prompt_requests(logs: list[Path], offsets: list[int]) -> list[dict]:
    """The prompt requests (not preflight probes) the emulators logged past the offsets, each when its answer was
    done (`time`) with when it was received (`received`)."""
    out = []
    for log, offset in zip(logs, offsets):
        try:
            with open(log, "rb") as f:
                f.seek(offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    rec = orjson.loads(line)
                    if not str(rec.get("rid", "")).startswith(PROBE_RID_PREFIX):
                        out.append(rec)
        except OSError:
            pass
    return out


def _first_prompt_request(logs: list[Path], offsets: list[int], proc: subprocess.Popen,
                          timeout: float) -> tuple[float, float] | None:
    """(received, answered): when the first prompt request reached an emulator, and when the first answer was done.
    An emulator logs a request once its answer is done, 32 tokens at 12.5 tok/s after it came: so once the first
    line is there, the lines of the requests received before it are waited for too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _prompt_requests(logs, offsets):
            time.sleep(MAX_TOKENS / TOK_S + 1.0)
            recs = _prompt_requests(logs, offsets)
            return min(r.get("received", r["time"]) for r in recs), min(r["time"] for r in recs)
        time.sleep(0.02)
    return None


def _logged_at(run: Path, text: str) -> float | None:
    """When the run's log last wrote a line containing `text` (its local-time stamp, as a Unix time)."""
    from datetime import datetime

    found = None
    with open(run / "logs" / "regen.log", "rb") as f:
        for line in f:
            if text.encode() in line:
                found = line[:23].decode()
    return None if found is None else datetime.strptime(found, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _ledger(run: Path) -> tuple[int, int]:
    ids = [pid for part in sorted((run / "data").glob("part-*.parquet"))
           for pid in pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()]
    return len(ids), len(set(ids))


def made_in(run: Path) -> int:
    """Records regen made (the benchmark's ledger-only records have no request id)."""
    return sum(len(pq.read_table(p, columns=["request_id"]).column(0).drop_null())
               for p in (run / "data").glob("part-*.parquet"))


def set_done(run: Path, fraction: float) -> tuple[int, int]:
    """Make `fraction` of the run's prompts committed: write ledger-only records for prompts without one (parts of
    PART_ROWS, through RunDir.write_part), or remove whole parts past it. Returns (written, removed) records."""
    from ..store import schema
    from ..store.rundir import RunDir, now_utc

    rd = RunDir(run)
    manifest = rd.read_manifest()
    records_schema = schema.records_schema(manifest.get("schema_version"))
    committed = rd.committed_ids()
    reader = rd.prompt_set_reader()
    target = int(reader.num_rows * fraction)
    removed = 0
    for part in sorted((run / "data").glob("part-*.parquet"), reverse=True):
        if len(committed) <= target:
            break
        ids = pq.read_table(part, columns=["prompt_id"]).column(0).to_pylist()
        part.unlink()
        committed -= set(ids)
        removed += len(ids)
    need = target - len(committed)
    if need <= 0:
        index_as_committed(rd)
        return 0, removed
    todo = [p.prompt_id for p in reader.pending(committed, set(), True, 0).pending[:need]]
    now = now_utc()
    for start in range(0, len(todo), PART_ROWS):
        ids = todo[start:start + PART_ROWS]
        k = len(ids)
        cols = {"prompt_id": pa.array(ids), "turn_index": pa.array(np.zeros(k, np.int32)),
                "n_turns": pa.array(np.ones(k, np.int32)), "source": pa.array(["bench"] * k),
                "content": pa.array(["(written by the benchmark)"] * k), "finish_reason": pa.array(["stop"] * k),
                "config_fingerprint": pa.array([manifest["fingerprint"]] * k),
                "created_at": pa.array([now] * k, pa.timestamp("ms", tz="UTC"))}
        rd.write_part(rd.data, pa.Table.from_arrays(
            [cols[f.name] if f.name in cols else pa.nulls(k, f.type) for f in records_schema], schema=records_schema))
    index_as_committed(rd)
    return len(todo), removed


def index_as_committed(rd) -> int:
    """The ledger index as the committer would have left it had it committed these parts: a segment per 128 parts
    in order, the tail read part by part (parts written or removed here bypass the committer). Returns segments."""
    from ..store.ledger_index import SEGMENT_PARTS, index_folder, write_segment

    for segment in index_folder(rd.data).iterdir():
        segment.unlink()
    parts = rd.ledger(rd.data).unindexed
    whole = len(parts) - len(parts) % SEGMENT_PARTS
    for start in range(0, whole, SEGMENT_PARTS):
        write_segment(rd.data, parts[start:start + SEGMENT_PARTS])
    return whole // SEGMENT_PARTS


_PENDING_BYTES = r"""
import gc, sys, tracemalloc
from pipeline.store.rundir import RunDir
from pipeline.dispatch.routing import Router

reader = RunDir(sys.argv[1]).prompt_set_reader()
gc.collect()
tracemalloc.start()
scan = reader.pending(set(), set(), True, 256)
router = Router(affinity=True)
router.set_endpoints([f"e{i}" for i in range(16)])
router.add(scan.pending)
unfinished = {p.prompt_id for p in scan.pending}
gc.collect()
held, _ = tracemalloc.get_traced_memory()
print(len(scan.pending), held)
"""


def pending_bytes(run: Path) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", _PENDING_BYTES, str(run)], capture_output=True, text=True, cwd=REPO,
                         timeout=1800, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    n, grown = (int(x) for x in out.stdout.split())
    return n, grown / max(n, 1)


class CpuMeter:
    """CPU seconds (user + system) of the driver and of the cluster's endpoint actors, with the session's completions
    (status.json), read at a mark and at each `read`: a figure of regen's own work that does not depend on the
    machine's load (the wall time does). The mark is the first read SETTLE_S after every endpoint's actor was
    seen, so the actors' start (their imports: over a second of CPU each) is left out; an actor started later (a
    restart) counts from when it was first seen. An actor's seconds are the most seen for its pid (it may end)."""

    SETTLE_S = 5.0

    def __init__(self, pid: int, head, run: Path, actors: int = ENDPOINTS):
        import psutil

        self.driver, self.head, self.run, self.expected = psutil.Process(pid), head, run, actors
        self.actors: dict[int, float] = {}
        self.first_seen: dict[int, float] = {}  # an actor's CPU when first seen (after the mark: it is left out)
        self.all_seen_at: float | None = None
        self.mark: tuple[float, float, int, float] | None = None  # driver s, actors s, done, wall clock
        self.last: tuple[float, float, int, float] | None = None

    def _done(self) -> int:
        try:
            return orjson.loads((self.run / "status.json").read_bytes())["this_session"]["done"]
        except (OSError, ValueError, KeyError):
            return 0

    def read(self) -> None:
        import psutil

        try:
            t = self.driver.cpu_times()
            driver = t.user + t.system
        except psutil.Error:
            return
        for proc in self.head.actor_processes():
            try:
                t = proc.cpu_times()
                self.actors[proc.pid] = max(self.actors.get(proc.pid, 0.0), t.user + t.system)
                self.first_seen.setdefault(proc.pid, self.actors[proc.pid])
            except psutil.Error:
                pass
        now = time.time()
        if self.all_seen_at is None and len(self.actors) >= self.expected:
            self.all_seen_at = now
        if self.mark is None:
            if self.all_seen_at is None or now - self.all_seen_at < self.SETTLE_S:
                return
            self.first_seen = dict(self.actors)  # from here every actor counts from the mark
        actors = sum(cpu - self.first_seen[pid] for pid, cpu in self.actors.items())
        self.last = (driver, actors, self._done(), now)
        if self.mark is None:
            self.mark = self.last

    def per_completion(self) -> dict | None:
        """Driver's and actors' CPU ms per completion from the mark to the last read, their cores (CPU seconds over
        the wall time between), the completions counted."""
        if self.mark is None or self.last is None or self.last[2] <= self.mark[2]:
            return None
        n, wall = self.last[2] - self.mark[2], max(1e-9, self.last[3] - self.mark[3])
        driver, actors = self.last[0] - self.mark[0], self.last[1] - self.mark[1]
        return {"driver_ms": 1000 * driver / n, "actors_ms": 1000 * actors / n, "n": n, "driver_cores": driver / wall,
                "actors_cores": actors / wall, "wall": wall}


def _run(ctx: Ctx, config: Path, log: Path, run: Path, budget_s: float | None, request_logs: list[Path]) -> dict:
    ctx.head.ensure()
    offsets = _log_sizes(request_logs)
    started = time.time()
    proc = start_regen(config, ctx.head.env(), log)
    sampler = RssSampler(proc.pid, None, run, interval=1.0)
    sampler.start()
    seen = _first_prompt_request(request_logs, offsets, proc, 1800)
    first, answered = seen if seen is not None else (None, None)
    cpu = CpuMeter(proc.pid, ctx.head, run)
    cpu.read()  # the mark: once every actor has started (CpuMeter), the dispatch's own CPU
    while True:
        try:
            rc = proc.wait(1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        cpu.read()
        # past the budget, once requests flow (a stop during materialise would leave no prompt set)
        if budget_s and time.time() - started > budget_s and first is not None:
            proc.send_signal(signal.SIGTERM)  # a clean stop: the buffer is committed, the run stays resumable
            rc = proc.wait(300)
            break
    wall = time.time() - started
    sampler.stop()
    if rc not in (0, 130):
        raise RuntimeError(log.read_text(errors="replace")[-3000:])
    live = [s for s in sampler.samples if s["done"] is not None]
    ready = _logged_at(run, " prompts pending of ")
    return {"rc": rc, "wall": wall, "first": None if first is None else first - started,
            "answered": None if answered is None else answered - started,
            "ready": None if ready is None else ready - started,
            "peak": max((s["driver_mb"] for s in sampler.samples), default=0.0),
            "materialise_peak": max((s["driver_mb"] for s in sampler.samples if s["done"] is None), default=0.0),
            "dispatch_peak": max((s["driver_mb"] for s in live), default=0.0),
            "done": live[-1]["done"] if live else 0, "dispatch_t0": live[0]["t"] - started if live else wall,
            "cpu": cpu.per_completion()}


def _cpu(c: dict | None) -> str:
    if c is None:
        return "not measured"
    return (f"{c['driver_ms']:.2f} ms ({c['driver_cores']:.2f} cores); actors {c['actors_ms']:.2f} ms "
            f"({c['actors_cores']:.2f} cores); {c['n']} completions")


def scale(ctx: Ctx) -> Result:
    n = ctx.scale_n or (20_000 if ctx.quick else 1_000_000)
    res = Result(f"scale {n // 1000}K")
    w = ctx.folder(f"scale-{n}")
    t0 = time.perf_counter()
    line_bytes = write_chats(w / "chats.jsonl", n)
    source_s = time.perf_counter() - t0
    logs = [w / f"e{i}.jsonl" for i in range(ENDPOINTS)]
    with emulators(ENDPOINTS, logs=w, tok_per_s=TOK_S, capacity=CONCURRENCY) as fleet:
        config = write_config(w, [e.url for e in fleet], CONCURRENCY, w / "chats.jsonl", MAX_TOKENS)
        spec = w / "source.yaml"
        spec.write_text(yaml.safe_dump({**yaml.safe_load(spec.read_text()), "format": "sharegpt"}))
        run = w / "out" / "bench"
        new = _run(ctx, config, w / "regen-new.log", run, ctx.scale_budget_s, logs)
        made = _ledger(run)[1]
        written, removed = set_done(run, 0.9)
        resumed = _run(ctx, config, w / "regen-resume.log", run, ctx.scale_resume_budget_s, logs)
        finish = None
        if resumed["rc"] == 130:  # stopped by its budget: the rest but FINAL_TAIL set done, then run to the end
            more, _ = set_done(run, 1 - min(FINAL_TAIL, n // 10) / n)
            finish = {**_run(ctx, config, w / "regen-finish.log", run, None, logs), "written": more}
    rows, unique = _ledger(run)
    n_pending, per_prompt = pending_bytes(run)
    dispatched = new["wall"] - (new["first"] if new["first"] is not None else new["dispatch_t0"])
    ideal_rate = ENDPOINTS * CONCURRENCY * TOK_S / MAX_TOKENS  # completions a second the fleet can give
    rate = made / dispatched if dispatched > 0 else 0.0
    tail = n - int(n * 0.9)
    by_regen = made_in(run)
    res.rows += [
        ("prompts committed / lost / doubled (after the resume)", f"{unique} / {n - unique} / {rows - unique}",
         "0 lost, 0 doubled", unique == n and rows == unique),
        ("driver peak RSS, new run (materialise / dispatch)",
         f"{new['peak']:.0f} MB ({new['materialise_peak']:.0f} / {new['dispatch_peak']:.0f})", "≤ 1 GB at 1M",
         new["peak"] <= 1024 if n >= 1_000_000 else None),
        ("driver peak RSS, resume at 90% done", f"{resumed['peak']:.0f} MB", "≤ 1 GB at 1M",
         resumed["peak"] <= 1024 if n >= 1_000_000 else None),
        ("command → first request, resume at 90% done (Ray head up)",
         f"{fmt(resumed['first'])} s" if resumed["first"] is not None else "no request seen", "≤ 5 s at 1M",
         (resumed["first"] is not None and resumed["first"] <= 5.0) if n >= 1_000_000 else None),
        ("resume: command → first answer done at an emulator (the row above's measure before this change)",
         f"{fmt(resumed['answered'])} s" if resumed["answered"] is not None else "no request seen", "", None),
        ("resume: command → pending set ready (ledger, prompt-set scan, preflight)",
         f"{fmt(resumed['ready'])} s" if resumed["ready"] is not None else "not logged", "", None),
        ("new run: command → first request (materialise included)",
         f"{fmt(new['first'])} s" if new["first"] is not None else "no request seen", "", None),
        ("driver structures per pending prompt (all pending)", f"{per_prompt:.0f} B", "a few hundred bytes", None),
        ("dispatch pace vs the emulators' ideal (new run, from its first request)",
         f"{rate:.0f} vs {ideal_rate:.0f} completions/s = {rate / ideal_rate:.2f}x", "", None),
        ("driver CPU per completion, new run (user+sys, once its actors are up; the 16 actors' beside it)", _cpu(new["cpu"]),
         "", None),
        ("resume: wall time for the last 10% vs ideal",
         f"{resumed['wall']:.0f} s vs {tail / ideal_rate:.0f} s" if finish is None else
         f"stopped by the budget after {resumed['wall']:.0f} s", "", None),
        ("driver peak RSS, last session", f"{finish['peak']:.0f} MB" if finish else "(no last session)", "", None),
    ]
    res.notes += [
        f"{n} ShareGPT conversations of 1-3 exchanges (a third with a shared system prompt), {line_bytes / 1024:.1f} "
        f"KB a JSONL line, written in {source_s:.0f} s; {ENDPOINTS} emulators x concurrency {CONCURRENCY}, "
        f"{MAX_TOKENS} tokens at {TOK_S} tok/s a request (ideal {ideal_rate:.0f} completions/s); default "
        f"checkpointing (512 records or 30 s). RSS of the driver (and its children) sampled every second.",
        f"New run: {new['wall']:.0f} s, of which materialising the prompt set {new['dispatch_t0']:.0f} s; "
        + (f"stopped by the budget ({ctx.scale_budget_s:.0f} s) with {made} records made"
           if new["rc"] == 130 else f"complete, {made} records")
        + f". Then set to 90% done: {written} ledger-only records written, {removed} removed, and the ledger index "
        f"left as the committer would have (a segment per 128 parts, the rest read part by part). "
        + (f"The resume ran the last {tail} prompts in {resumed['wall']:.0f} s." if finish is None else
           f"The resume was stopped by its budget ({ctx.scale_resume_budget_s:.0f} s, from the command); then all but "
           f"{min(FINAL_TAIL, n // 10)} prompts were set done ({finish['written']} more ledger-only records) and a "
           f"last session ran them to the end in {finish['wall']:.0f} s (first request at {fmt(finish['first'])} s)."),
        f"Records made by regen itself (not written by the benchmark): {by_regen} of {n}; 0 lost and 0 "
        "doubled count every prompt of the set across all sessions and the written records.",
        f"Bytes per pending prompt: what a fresh process allocates (tracemalloc) to hold the pending list of all "
        f"{n_pending} prompts, the router's queues over 16 endpoints and the unfinished set, over the prompt count.",
        f"The machine has {os.cpu_count()} cores shared with other work: the driver, the Ray actors and "
        f"{ENDPOINTS} emulators contend for them, so the pace against the ideal mostly measures that contention.",
        "CPU per completion: the user+system CPU seconds of the driver process (psutil), and of the endpoint actors, "
        "over the completions status.json counts, from 5 s after every actor of the new run was up to its end: "
        "regen's own work per completion, which does not depend on the machine's load (the pace does); cores is "
        "the same CPU over the wall time.",
    ]
    return res
