"""`make bench` / `python -m pipeline.bench`: the pipeline benchmarks against an emulated fleet on 127.0.0.1.

Prints a table and writes BENCHMARKS.md. Every figure compared with a goal is a ratio against a baseline
measured in the same run on the same emulators (the machine is shared and noisy); repeated measurements
report medians. The benchmark starts and stops everything it needs: its own Ray head (in a temp dir, ended by
process id), the emulators, the regen runs.

  overhead    regen end to end vs a bare asyncio + AsyncOpenAI pull loop (+ a py-spy profile)
  saturation  mean running requests per endpoint vs its capacity C
  capacity    concurrency auto vs 8, 64 and each server's best fixed value, on emulators with a throughput curve
  stragglers  4 endpoints, one 5x slower: makespan vs ideal, and static round-robin's
  resume      88K-prompt run dir with 80K done: pending-set time, command start to first request
  memory      driver and actor RSS over a long run of 2K-token completions
  emulator    the emulator's own req/s under a raw aiohttp load generator
  simulator   `regen simulate`'s predicted wall time against the actual emulated run
  production  the production shape: 88K prompts, 16 endpoints x 64, checkpointing on, lost/doubled, RSS, commits
  sources     materialise a 1 GB JSON array of ShareGPT rows with limit 88,000: MB/s on one core, peak RSS
  images      read 100K LLaVA-shaped image records over a folder of COCO-sized JPEGs: MB/s on one core, peak RSS
  capture     `regen capture` on SmolLM2-135M (CPU) vs its forward pass alone; hidden bytes vs the ideal bf16
  image_requests  what a 1 MB image adds to a request on the worker's path (read, sha256, base64, JSON, send), and per
              all_turns step
  scale       on demand only (--only scale, --n N): N multi-turn prompts end to end through 16 endpoints, peak
              driver RSS, resume at 90% done (command to first request), 0 lost / 0 doubled (docs/scale.md)
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .cases import (
    Ctx,
    Result,
    emulator_capacity,
    overhead,
    saturation,
    stragglers,
)
from .capacity import capacity
from .capture import capture_needs, capture_throughput
from .image_requests import image_request_cost
from .env import REPO
from .scale import memory, production, resume
from .scale_run import scale
from .images import materialise_images
from .sources import materialise_json


def simulator_accuracy(ctx: Ctx) -> Result:
    """`regen simulate` on a sample at 20x time compression against the actual emulated run of all prompts."""
    from ..tools.simulate import simulate
    from .env import emulators, write_config, write_prompts

    n_prompts, tok_s, endpoints, concurrency = (240, 60.0, 2, 8) if ctx.quick else (600, 60.0, 4, 8)
    folder = ctx.work / "simulator"
    folder.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(folder / "prompts.jsonl", n_prompts)
    os.environ.update(ctx.head.env())  # the simulated run joins the benchmark's Ray head too
    with emulators(endpoints, tok_per_s=tok_s, capacity=concurrency) as fleet:
        config = write_config(folder, [s.url for s in fleet], concurrency, prompts, max_tokens=48)
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--config", str(config)],
                             capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
        actual = time.monotonic() - started
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
    predicted = simulate(str(config), endpoints, tok_s, sample=n_prompts // 4, speedup=20.0, concurrency=concurrency)
    ratio = predicted.wall_s / actual
    res = Result("simulator")
    res.rows += [("predicted / actual wall time of an emulated run", f"{ratio:.2f}x "
                  f"({predicted.wall_s:.0f} s / {actual:.0f} s)", "within 10%", abs(ratio - 1) <= 0.10)]
    res.notes += [f"{n_prompts} prompts, {endpoints} endpoints x {concurrency} at {tok_s:.0f} tok/s a request; "
                  f"the prediction ran a quarter of them at 20x speed ({predicted.sample_wall_s:.0f} s).",
                  predicted.table().replace("\n", " ")]
    return res


BENCHES = {"overhead": overhead, "capacity": capacity, "saturation": saturation, "stragglers": stragglers, "resume": resume,
           "memory": memory, "emulator": emulator_capacity,
           "simulator": simulator_accuracy, "production": production, "sources": materialise_json,
           "images": materialise_images, "capture": capture_throughput, "image_requests": image_request_cost,
           "scale": scale}
ON_DEMAND = {"scale"}  # tens of minutes: run only when named in --only
# What a case needs beyond the benchmarks' own (a reason string when this environment lacks it): the case is
# skipped with that line instead of failing the whole command after the others have run.
NEEDS = {"capture": capture_needs}


def table(results: list[Result]) -> list[str]:
    lines = ["| benchmark | figure | value | goal | met |", "|---|---|---:|---|:---:|"]
    for r in results:
        for metric, value, goal, ok in r.rows:
            mark = "" if ok is None else ("yes" if ok else "**no**")
            lines.append(f"| {r.name} | {metric} | {value} | {goal} | {mark} |")
    return lines


def markdown(results: list[Result], ctx: Ctx, elapsed: float, args: argparse.Namespace, errors: list[str],
             skipped: dict[str, str] | None = None) -> str:
    head = ctx._head
    out = [
        "# regen benchmarks",
        "",
        "Generated by `make bench` (`python -m pipeline.bench`"
        + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
        + "). Do not edit by hand.",
        "",
        (f"Machine: {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python "
         f"{platform.python_version()}; shared with other work, so every goal is a ratio against a baseline "
         f"measured in the same run, and repeated figures are medians. Total time {elapsed / 60:.1f} min."),
        "",
    ]
    if head is not None and head.startup_s is not None:
        out += [f"Ray start-up (`ray start --head`, 127.0.0.1, own temp dir): {head.startup_s:.1f} s, measured once "
                f"and kept out of every timed figure." + (f" The head was ended from outside {head.restarts} "
                                                         "time(s) and restarted; affected runs were redone."
                                                         if head.restarts else ""), ""]
    out += table(results) + [""]
    for r in results:
        out += [f"## {r.name}", ""] + [f"- {n}" for n in r.notes] + [""]
        if r.profile:
            out += ["### Profile (py-spy, an untimed run of the same workload)", "", r.profile, ""]
    if skipped:
        out += ["## Skipped", ""] + [f"- {name}: {why}" for name, why in skipped.items()] + [""]
    if errors:
        out += ["## Errors", ""] + [f"```\n{e}\n```" for e in errors] + [""]
    return "\n".join(out)


def kept_from(previous: str, rerun: set[str]) -> tuple[list[str], list[str]]:
    """The table rows and `## name` sections of the benchmarks an earlier report holds and this run did not redo
    (`--merge`), in their order. Rows are those of the table before the first section (a section's own tables,
    the py-spy profile, stay in it); a row of a benchmark without a section is not a benchmark's."""
    rows, sections, current, in_sections = [], [], None, False
    lines = previous.splitlines()
    named = {line[3:].split(" (", 1)[0].strip() for line in lines if line.startswith("## ")}
    for line in lines:
        if not in_sections and line.startswith("| ") and not line.startswith(("| benchmark ", "|---")):
            name = line.split("|")[1].strip()
            if name not in rerun and name in named:
                rows.append(line)
        elif line.startswith("## "):
            in_sections = True
            name = line[3:].split(" (", 1)[0].strip()
            current = None if name in rerun or name == "Errors" else name
            if current:
                sections.append(f"## {name} (an earlier run)")  # once, however many merges ago
        elif current:
            sections.append(line)
    return rows, sections


def merged(report: str, previous: str, rerun: set[str]) -> str:
    rows, sections = kept_from(previous, rerun)
    lines = report.splitlines()
    end_of_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    while end_of_table + 1 < len(lines) and lines[end_of_table + 1].startswith("|"):
        end_of_table += 1  # the first table; a section's own tables (a profile) come later
    note = (f"This run redid {', '.join(sorted(rerun))}; the other rows and sections come from the earlier "
            "report it was merged into (`--merge`).")
    return "\n".join(lines[:end_of_table + 1] + rows + [""] + [note, ""] + lines[end_of_table + 1:] + [""] + sections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller workloads, one repetition (a few minutes)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    p.add_argument("--repeat", type=int, default=None, help="overhead pairs to run (default 3, quick 1)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile of the overhead run")
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="markdown report (default: BENCHMARKS.md)")
    p.add_argument("--merge", action="store_true",
                   help="keep the figures of the benchmarks not run from the existing --out report")
    p.add_argument("--n", type=int, default=None, help="prompts for the scale case (default 1,000,000; quick 20,000)")
    p.add_argument("--scale-budget-s", type=float, default=None,
                   help="stop the scale case's new run after this many seconds (default: run it to the end)")
    p.add_argument("--scale-resume-budget-s", type=float, default=None,
                   help="stop the scale case's resume after this many seconds, then run the last 2,000 prompts")
    p.add_argument("--workdir", default=None, help="keep run directories here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or [n for n in BENCHES if n not in ON_DEMAND]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="regen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work, quick=args.quick, repeat=args.repeat or (1 if args.quick else 3), profile=not args.no_profile,
              scale_n=args.n, scale_budget_s=args.scale_budget_s, scale_resume_budget_s=args.scale_resume_budget_s)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    results: list[Result] = []
    errors: list[str] = []
    skipped: dict[str, str] = {}
    t0 = time.perf_counter()
    try:
        for name in names:
            lacking = NEEDS[name]() if name in NEEDS else None
            if lacking:
                skipped[name] = lacking
                print(f"bench: {name} skipped: it {lacking}", file=sys.stderr, flush=True)
                continue
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                results.append(BENCHES[name](ctx))
            except Exception:  # noqa: BLE001 - one broken benchmark does not lose the others
                errors.append(f"{name}: {traceback.format_exc()}")
                print(f"bench: {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
            print(f"bench: {name} took {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        if ctx._head is not None:
            ctx._head.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    report = markdown(results, ctx, elapsed, args, errors, skipped)
    if args.merge and Path(args.out).exists():
        report = merged(report, Path(args.out).read_text(), {r.name for r in results})
    Path(args.out).write_text(report)
    print("\n".join(table(results)))
    if ctx._head is not None and ctx._head.startup_s is not None:
        print(f"Ray start-up (ray start --head): {ctx._head.startup_s:.1f} s (not in any timed figure)")
    for name, why in skipped.items():
        print(f"skipped {name}: it {why}")
    print(f"wrote {args.out} ({elapsed / 60:.1f} min)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
