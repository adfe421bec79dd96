"""`make bench` case `images`: read 100K LLaVA-shaped image records (10K with --quick) over a local folder of
COCO-sized JPEGs, as `regen generate` reads its sources: each record's image resolved in its folder, checked with
Pillow (header, then a 1/8-scale decode that reads every byte), hashed (sha256), the record normalised and
deduplicated. Each picture is named by two records (as LLaVA-Instruct's conversation and detail questions share a
COCO picture), so half the reads are served by the reader's cache of parts.

Measured in a child process pinned to one core, the prompts going to a sink that only counts them (the sources'
part alone: copying the images into the run is the store's, measured by its own case): records/s, MB/s of
distinct image bytes, and the peak RSS above the child's baseline. The pictures are written just before, so they
are read from the page cache: a cold disk or a network filesystem is slower by its own read rate.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from .cases import Ctx, Result
from .env import REPO

BASES = 48  # distinct encodings; every picture file is one of them with its own JPEG comment (distinct bytes)

CHILD = r"""
import json, os, sys, time
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[-1]})  # one core
from pipeline.prompts.prompt_set import build_into
from pipeline.prompts.sources import load_source_spec

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

class Counting:
    prompts = rejects = images = 0
    def add_prompt(self, prompt): self.prompts += 1
    def add_reject(self, reject): self.rejects += 1
    def add_image(self, sha256, source): self.images += 1

spec = load_source_spec(sys.argv[1])
sink = Counting()
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
started, cpu = time.perf_counter(), time.process_time()
result = build_into(sink, [(spec, None)])
elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
print(json.dumps({"elapsed_s": elapsed, "cpu_s": cpu, "peak_kb": kb("VmHWM") - base, "base_kb": base,
                  "prompts": sink.prompts, "rejects": sink.rejects, "handed": sink.images,
                  "report": result.reports[0].as_dict()}))
"""


def _bases(folder: Path) -> list[bytes]:
    """COCO-sized (640x480) JPEGs at quality 90: gradients, shapes and grain, about COCO's bytes per picture."""
    import io

    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(7)
    out = []
    for k in range(BASES):
        image = Image.linear_gradient("L").resize((640, 480)).convert("RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x, y = rng.randrange(600), rng.randrange(440)
            draw.ellipse((x, y, x + rng.randrange(20, 200), y + rng.randrange(20, 200)),
                         fill=tuple(rng.randrange(256) for _ in range(3)))
        grain = Image.effect_noise((640, 480), 24 + k % 16).convert("RGB")
        image = Image.blend(image.filter(ImageFilter.GaussianBlur(2)), grain, 0.25)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def write_records(folder: Path, records: int) -> tuple[Path, int]:
    """records/2 distinct pictures under folder/train2017 and the LLaVA-shaped JSON Lines naming each twice; returns
    (the data file, the distinct pictures' bytes)."""
    pictures = folder / "train2017"
    pictures.mkdir(parents=True, exist_ok=True)
    bases = _bases(folder)
    distinct = records // 2
    total = 0
    for i in range(distinct):
        base = bases[i % BASES]
        comment = f"regen bench picture {i}".encode()
        data = base[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + base[2:]
        (pictures / f"{i:012d}.jpg").write_bytes(data)
        total += len(data)
    data_file = folder / "llava.jsonl"
    with data_file.open("w") as fh:
        for r in range(records):
            i = r % distinct
            question = ("What is in this picture?", "Describe the picture in detail.")[r // distinct % 2]
            fh.write(json.dumps({"id": f"{i:012d}", "image": f"{i:012d}.jpg", "conversations": [
                {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": "A picture."}]}) + "\n")
    return data_file, total


def materialise_images(ctx: Ctx) -> Result:
    records = int(os.environ.get("REGEN_BENCH_IMAGE_RECORDS") or (10_000 if ctx.quick else 100_000))
    work = ctx.folder("images")
    data_file, distinct_bytes = write_records(work, records)
    spec = work / "llava.yaml"
    spec.write_text(json.dumps({"name": "llava", "kind": "jsonl", "path": data_file.name, "format": "sharegpt",
                                "id_field": "id", "image_root": "train2017"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(spec)], capture_output=True, text=True, env=env,
                         timeout=3600, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    elapsed = figures["elapsed_s"]
    mb_s = distinct_bytes / 1e6 / elapsed
    report = figures["report"]
    res = Result("images")
    res.rows += [
        (f"read {records:,} image records ({records // 2:,} distinct JPEGs, {distinct_bytes / 1e9:.2f} GB): "
         "records/s on one core", f"{records / elapsed:,.0f}", None, None),
        ("distinct image bytes read, checked and hashed: MB/s on one core", f"{mb_s:.0f}", ">= 50 MB/s", mb_s >= 50),
        ("the same per second of the child's CPU time (the machine's other load left out)",
         f"{distinct_bytes / 1e6 / figures['cpu_s']:.0f}", None, None),
        ("peak RSS above baseline", f"{figures['peak_kb'] / 1024:.0f} MB", "<= 200 MB",
         figures["peak_kb"] <= 200 * 1024),
    ]
    res.notes += [
        f"{records:,} LLaVA-shaped records, each 640x480 picture named by two of them; {figures['prompts']:,} prompts, "
        f"{figures['rejects']:,} rejects, {figures['handed']:,} images handed to the sink (images.store: copy), in "
        f"{elapsed:.1f} s ({figures['cpu_s']:.1f} s of CPU).",
        f"image counts: {report['image_counts']}.",
        f"baseline RSS of the child after its imports: {figures['base_kb'] / 1024:.0f} MB; the pictures were written "
        "just before (read from the page cache).",
    ]
    return res
