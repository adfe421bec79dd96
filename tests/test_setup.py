"""`make setup` and the declared Python: a Python older than 3.11 is refused before any venv is made.

The interpreter is a stand-in `python3` first on PATH: it runs `-c` code as the real one would but reports the
version it is told to, and records any other call (such as `-m venv`) instead of doing it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parent.parent


def fake_python(folder: Path, version: tuple[int, int, int]) -> Path:
    """A `python3` on PATH that claims to be `version`; returns the file its other calls are recorded in."""
    calls = folder / "calls.log"
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python3"
    shim.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.version_info = {version + ("final", 0)!r}
    sys.version = "{'.'.join(map(str, version))} (a stand-in)"
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<string>", "exec"), {{"__name__": "__main__"}})
else:
    with open({str(calls)!r}, "a") as log:
        log.write(" ".join(args) + "\\n")
    sys.exit(3)
""")
    shim.chmod(0o755)
    return calls


def make(target: str, shim_dir: Path, venv: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MAKELEVEL")}
    env["PATH"] = f"{shim_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), target, f"VENV={venv}"],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(autouse=True)
def _needs_make():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")


def test_make_setup_refuses_python_3_10_before_making_a_venv(tmp_path):
    calls = fake_python(tmp_path / "bin", (3, 10, 14))
    venv = tmp_path / "venv"
    result = make("setup", tmp_path / "bin", venv)
    assert result.returncode != 0
    assert "regen needs Python >= 3.11" in result.stderr and "Python 3.10.14" in result.stderr, result.stderr
    assert not venv.exists(), "no venv is made with a Python that is too old"
    assert not calls.exists(), f"nothing else was run with it: {calls.read_text() if calls.exists() else ''}"


@pytest.mark.parametrize("version", [(3, 11, 0), (3, 13, 1)])
def test_the_python_check_passes_3_11_and_newer(tmp_path, version):
    fake_python(tmp_path / "bin", version)
    result = make("check-python", tmp_path / "bin", tmp_path / "venv")
    assert result.returncode == 0, result.stderr


def test_requires_python_is_3_11_and_the_makefile_checks_the_same_minimum():
    declared = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.10.14" not in declared and "3.11.0" in declared
    checked = re.search(r"^PYTHON_MIN\s*:=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert SpecifierSet(f">={checked}") == declared
