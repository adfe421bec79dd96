"""Bounded memory through the materialise step (issue 17): a source far larger than what is selected is read in
one streaming pass, with a bounded heap for `limit`; memory grows by a small fraction of the file, never by it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parent.parent

# ru_maxrss would start at the parent's size (Linux keeps it across exec): VmHWM is this process's own peak,
# reset to the current size by writing 5 to clear_refs.
MEASURE = r"""
import gc, sys
from pipeline.prompts.prompt_set import build_prompt_set
from pipeline.prompts.sources import SourceSpec

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

path, kind, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
build_prompt_set([(SourceSpec("warm", kind, sys.argv[4], "sharegpt"), 5)])  # imports and first allocations
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
ps = build_prompt_set([(SourceSpec("big", kind, path, "sharegpt"), limit)])
print(len(ps.prompts), ps.reports[0].read, (kb("VmHWM") - base) * 1024)
"""


def sharegpt_rows(n: int):
    for i in range(n):
        yield {"id": i, "conversations": [{"from": "human", "value": f"Question {i}: " + "why " * 60},
                                          {"from": "gpt", "value": f"Answer {i}: " + "because " * 200}]}


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_materialising_a_large_source_with_a_limit_stays_small(tmp_path, kind):
    # Regression: every valid prompt was held in memory before the limit was applied (and a JSON array
    # would have been read whole): memory grew by more than the file's size.
    n = 25_000
    big, warm = tmp_path / f"big.{kind}", tmp_path / f"warm.{kind}"
    for path, count in ((big, n), (warm, 10)):
        if kind == "jsonl":
            path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in sharegpt_rows(count)))
        else:
            path.write_bytes(orjson.dumps(list(sharegpt_rows(count))))
    size = big.stat().st_size
    assert size > 40e6
    out = subprocess.run([sys.executable, "-c", MEASURE, str(big), kind, "200", str(warm)], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    selected, read, grown = (int(x) for x in out.stdout.split())
    assert (selected, read) == (200, n)
    print(f"{kind}: {size / 1e6:.0f} MB source, memory grew by {grown / 1e6:.1f} MB")
    assert grown < 0.3 * size, f"memory grew by {grown / 1e6:.0f} MB for a {size / 1e6:.0f} MB source"
