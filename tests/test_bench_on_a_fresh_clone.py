"""`make bench` works on a fresh clone (issue 23, dead end 7): the target installs what its cases need (the verify
extra: torch, transformers; SmolLM2-135M as an HF folder), and a case whose needs are missing anyway is skipped
with a line saying what it needs, instead of failing the command after every other case has run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_make_bench_installs_the_verify_extra_and_the_model_before_it_runs(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # `make setup` done: the fresh clone's state, without the verify extra
    plan = subprocess.run(["make", "-n", "bench", f"VENV={venv}", f"MODELS_CACHE={tmp_path / 'models'}"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    model = tmp_path / "models" / "SmolLM2-135M-Instruct"
    steps = [next(i for i, line in enumerate(plan) if marker in line) for marker in
             ('-m pip install -q -e ".[verify]"', f"-m pipeline.tools.convert_smollm2 --out {model}",
              "-m pipeline.bench")]
    assert steps == sorted(steps), plan
    assert f"REGEN_VLLM_MODEL={model} " in plan[steps[-1]], "the bench reads the model the target converted"


def test_a_case_whose_needs_are_missing_is_skipped_with_a_line_saying_what_it_needs(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # `import torch` fails\n")
    out = subprocess.run([sys.executable, "-m", "pipeline.bench", "--only", "capture", "--out",
                          str(tmp_path / "BENCHMARKS.md")], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])})
    assert out.returncode == 0, out.stderr[-2000:]
    said = next(line for line in out.stderr.splitlines() if line.startswith("bench: capture skipped: it needs torch"))
    assert said.endswith("(the verify extra: pip install -e '.[verify]'; `make bench` installs it)")
    assert "Traceback" not in out.stderr and said.replace("bench: capture skipped", "skipped capture") in out.stdout
    assert "## Skipped\n\n- capture: needs torch" in (tmp_path / "BENCHMARKS.md").read_text()
