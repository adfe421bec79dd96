"""`make bench` case `sources`: materialise a generated JSON array of ShareGPT rows (1 GB; 100 MB with --quick)
with `limit: 88000`, as `regen generate` does before its first request: the sources streamed into a staged set,
the source files hashed for the run's identity, the set committed into a run directory.

Measured in a child process pinned to one core: MB/s of the source file, and the peak RSS above the child's
baseline (its VmHWM, reset after the imports: ru_maxrss would start at the parent's size) as a ratio of the file
size. Goals: at least 30 MB/s on one core, at most 0.3x the file size. REGEN_BENCH_SOURCE_MB sets another size
(about 35 MB of the peak is fixed: buffers, the Parquet writer, the allocators; a 100 MB file cannot meet 0.3x).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from .cases import Ctx, Result
from .env import REPO

LIMIT = 88_000
_WORDS = ("the of and to in is that for it as with was on be by this are or from at an not have which but has "
          "you all were can we more one their there been if will so what when would about into time some could "
          "them other than then its only also two may like new these do any most people over such after way "
          "because first well even how our just where those through very made many much before must between").split()

CHILD = r"""
import json, os, sys, time
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[-1]})  # one core
from pipeline.core.config import load_config
from pipeline.run import GenerateOptions, manifest_for, open_run
from pipeline.store.promptset import stage_prompt_set
from pipeline.store.rundir import RunDir
import pipeline.prompts.jsonarray, ijson, ray, openai  # imported before the baseline, as in a real run

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

cfg = load_config(sys.argv[1])
run_dir = RunDir(os.path.join(cfg.output_dir, cfg.run_name))
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
started = time.perf_counter()
staged = stage_prompt_set(cfg)
staged_s = time.perf_counter() - started
staged_peak = kb("VmHWM") - base
open_run(cfg, GenerateOptions(sys.argv[1]), run_dir, lambda: manifest_for(cfg, sys.argv[1]))
staged.commit(run_dir)
elapsed = time.perf_counter() - started
print(json.dumps({"elapsed_s": elapsed, "staged_s": staged_s, "peak_kb": kb("VmHWM") - base, "staged_peak_kb": staged_peak, "base_kb": base,
                  "report": staged.result.reports[0].as_dict(),
                  "backend": pipeline.prompts.jsonarray.backend().backend_name}))
"""


def write_sharegpt_array(path: Path, target_bytes: int) -> int:
    """A JSON array of ShareGPT rows (1-4 turns, a few hundred words each; some with a blank system message or a
    leading assistant turn, as the real dumps have), about `target_bytes` long. Returns the row count."""
    paragraphs = []
    for k in range(512):
        words = [_WORDS[(k * 7 + j * 13 + j * j) % len(_WORDS)] for j in range(40 + (k * 37) % 400)]
        paragraphs.append(" ".join(words).capitalize() + ".")
    rows, written = 0, 1
    with path.open("wb") as fh:
        fh.write(b"[")
        while written < target_bytes:
            conv = []
            if rows % 17 == 0:
                conv.append({"from": "system", "value": ""})
            if rows % 29 == 0:
                conv.append({"from": "gpt", "value": "Hello! How can I help you today?"})
            for t in range(1 + rows % 4):
                conv.append({"from": "human", "value": f"({rows}.{t}) " + paragraphs[(rows + t) % 512][:600]})
                conv.append({"from": "gpt", "value": paragraphs[(rows * 3 + t) % 512] + " "
                             + paragraphs[(rows * 5 + t) % 512]})
            blob = orjson.dumps({"id": f"sg{rows}", "conversations": conv})
            fh.write((b",\n" if rows else b"") + blob)
            written += len(blob) + 2
            rows += 1
        fh.write(b"]")
    return rows


def materialise_json(ctx: Ctx) -> Result:
    size_mb = int(os.environ.get("REGEN_BENCH_SOURCE_MB") or (100 if ctx.quick else 1000))
    work = ctx.folder("sources")
    data = work / "ShareGPT_generated.json"
    rows = write_sharegpt_array(data, size_mb * 1_000_000)
    size = data.stat().st_size
    spec = work / "sharegpt.yaml"
    spec.write_text(json.dumps({"name": "sharegpt", "kind": "json", "path": data.name, "format": "sharegpt",
                                "id_field": "id"}))
    config = work / "config.yaml"
    config.write_text(json.dumps({"run_name": "bench", "output_dir": str(work / "out"), "model": "m",
                                  "sources": [{"spec": str(spec), "limit": LIMIT}],
                                  "endpoints": [{"url": "http://127.0.0.1:9"}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(work)}  # the spill file on the work disk
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True, env=env,
                         timeout=3600, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    mb_s = size / 1e6 / figures["elapsed_s"]
    ratio = figures["peak_kb"] * 1024 / size
    report = figures["report"]
    res = Result("sources")
    res.rows += [
        (f"materialise a {size / 1e6:.0f} MB JSON array, limit {LIMIT:,}: MB/s on one core", f"{mb_s:.0f}",
         ">= 30 MB/s", mb_s >= 30),
        ("peak RSS above baseline / file size", f"{ratio:.3f}x ({figures['peak_kb'] / 1024:.0f} MB)", "<= 0.3x",
         ratio <= 0.3),
    ]
    res.notes += [
        f"{rows:,} generated ShareGPT rows; ijson backend {figures['backend']}; reading, normalising and selecting "
        f"took {figures['staged_s']:.1f} s (hashing the file for the run identity included), committing "
        f"{figures['elapsed_s'] - figures['staged_s']:.1f} s; the whole step {time.monotonic() - started:.0f} s with "
        "the child's start-up.",
        f"report: read {report['read']:,}, valid {report['valid']:,}, rejected {report['rejected']:,}, selected "
        f"{report['selected']:,}, duplicates {report['duplicates']:,}, dropped turns {report['dropped_turns']}.",
        f"baseline RSS of the child after its imports: {figures['base_kb'] / 1024:.0f} MB.",
    ]
    return res
