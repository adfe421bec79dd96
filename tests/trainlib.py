"""The training libraries' own loaders, run as the authority on regen's exports.

specforge 0.2.0 and speculators 0.9.0 are unpacked with --no-deps into a cache folder (`make trainlib-wheels`),
never into the venv (their pins conflict with each other and with vLLM's). Their code runs in a subprocess of
this interpreter with that folder on PYTHONPATH: tests/trainlib_checks.py calls the loaders on the exported files
and saves what they return (torch tensors) for the test to compare. No glue code in between.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
KEY = "specforge-0.2.0_speculators-0.9.0"


def trainlib_dir() -> Path:
    base = os.environ.get("REGEN_TRAINLIB_DIR") or Path.home() / ".cache" / "regen" / "trainlib"
    return Path(base) / KEY


def require_trainlib() -> Path:
    folder = trainlib_dir()
    if not (folder / ".installed").exists():
        pytest.skip(f"the training libraries are not unpacked at {folder}: make trainlib-wheels")
    return folder


def run_checks(task: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """Run one task of tests/trainlib_checks.py under the libraries; returns its JSON answer."""
    folder = require_trainlib()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200", "SPECULATORS_BIN": str(folder / "bin")}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "trainlib_checks.py"), json.dumps(task)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{task['check']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
