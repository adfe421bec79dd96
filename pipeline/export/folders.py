"""Folder exports written whole or not at all: into a staging folder beside the target, renamed into place.

SpecForge loads every `*.ckpt` under its folder and speculators every `hs_*` file, so a target must never hold
another export's leftovers or a killed writer's temporary file. The export writes `.regen-staging-<name>-<pid>/`
next to the target (its temporary files end in `.partial`, matching no loader's glob), then swaps it in:
a target regen made (its manifest.json names a regen format) is replaced, every time; an empty one too; any other
non-empty folder is refused before anything is written. A kill leaves only dot-folders beside the target, which
the next export of that target removes.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson

from ..core.errors import ConfigError

STAGING, OLD = ".regen-staging-", ".regen-replaced-"
PARTIAL = ".partial"  # a file being written: never *.ckpt, *.safetensors or *.arrow


def made_by_regen(folder: Path, formats: tuple[str, ...]) -> bool:
    try:
        return orjson.loads((folder / "manifest.json").read_bytes()).get("format") in formats
    except (FileNotFoundError, NotADirectoryError, orjson.JSONDecodeError, AttributeError):
        return False


def start(target: Path, formats: tuple[str, ...]) -> Path:
    """A fresh staging folder for `target` (refused if `target` holds files regen did not write)."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not made_by_regen(target, formats))):
        raise ConfigError(f"--out {target}: a non-empty folder regen did not export into (no regen manifest.json); "
                          "an export replaces its whole folder, so choose an empty or new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    for left in target.parent.glob(f"{STAGING}{target.name}-*"):
        shutil.rmtree(left, ignore_errors=True)  # a killed export's (one export per target at a time)
    for left in target.parent.glob(f"{OLD}{target.name}-*"):
        shutil.rmtree(left, ignore_errors=True)
    stage = target.parent / f"{STAGING}{target.name}-{os.getpid()}"
    stage.mkdir()
    return stage


def finish(stage: Path, target: Path) -> None:
    """Swap the complete staging folder in place of `target`."""
    old = target.parent / f"{OLD}{target.name}-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(stage, target)
    shutil.rmtree(old, ignore_errors=True)


def partial(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)
