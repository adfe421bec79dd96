"""Where the paths of a run config point: relative ones resolve against the config file's folder, so the same
config gives the same run from any working directory (docs/resume-and-drift.md, "Paths").

`sources[].spec`, `output_dir` (unless a URI), `endpoints_file` and `local_fleet`'s `chat_template`, `model_path`
and `allowed_local_media_path` are resolved when the config is loaded (`~` expands);
`tokenizer` is resolved when it is loaded (the run identity records it as written). A source spec's own `path:`
resolves against the spec's folder (prompts/sources.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

PATH_RULE = "relative paths in a run config resolve against the config file's folder"
EXPLICIT_PATH_PREFIXES = ("./", "../", "/", "~")  # a tokenizer written so is a path, never a hub id
FLEET_PATHS = ("chat_template", "model_path", "allowed_local_media_path")  # local_fleet's paths


def resolve_against(base: Path | None, written: str) -> str:
    """A path of a run config as regen uses it: absolute, relative ones joined to the config file's folder."""
    path = Path(written).expanduser()
    return os.path.normpath(path if path.is_absolute() or base is None else base / path)


def resolve_tokenizer(written: str, base: Path | None) -> str:
    """A local tokenizer folder (relative to the config file's folder) if that exists, else the hub id as written.
    A tokenizer written as a path (./, ../, /, ~) that does not exist is an error naming both."""
    resolved = resolve_against(base, written)
    if os.path.exists(resolved):
        return resolved
    if written.startswith(EXPLICIT_PATH_PREFIXES):
        raise ConfigError(f"tokenizer {written!r} resolves to {resolved}, which does not exist ({PATH_RULE})")
    return written


def resolve_config_paths(raw: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """The raw config with its paths resolved against the config file's folder (checked by `check_config_paths`
    once the keys are known to be right, so a typo in a key is reported first)."""
    base = config_file.resolve().parent
    raw = dict(raw)
    if isinstance(raw.get("output_dir"), str) and "://" not in raw["output_dir"]:
        raw["output_dir"] = resolve_against(base, raw["output_dir"])
    if isinstance(raw.get("endpoints_file"), str):
        raw["endpoints_file"] = resolve_against(base, raw["endpoints_file"])
    fleet = raw.get("local_fleet")
    if isinstance(fleet, dict):
        raw["local_fleet"] = {**fleet, **{key: resolve_against(base, fleet[key]) for key in FLEET_PATHS
                                          if isinstance(fleet.get(key), str)}}
    if isinstance(raw.get("sources"), list):
        raw["sources"] = [{**ref, "spec": resolve_against(base, ref["spec"])}
                          if isinstance(ref, dict) and isinstance(ref.get("spec"), str) else ref
                          for ref in raw["sources"]]
    return raw


def check_config_paths(raw: dict[str, Any], config_file: Path) -> None:
    """A source spec or endpoints file that does not exist is an error naming the path as written and the one
    resolved."""
    base = config_file.resolve().parent
    if isinstance(raw.get("endpoints_file"), str):
        _existing(config_file, "endpoints_file", raw["endpoints_file"], base)
    fleet = raw.get("local_fleet")
    if isinstance(fleet, dict) and isinstance(fleet.get("chat_template"), str):
        _existing(config_file, "local_fleet.chat_template", fleet["chat_template"], base)
    for i, ref in enumerate(raw.get("sources") or []):
        if isinstance(ref, dict) and isinstance(ref.get("spec"), str):
            _existing(config_file, f"sources[{i}].spec", ref["spec"], base)


def _existing(config_file: Path, key: str, written: str, base: Path) -> str:
    resolved = resolve_against(base, written)
    if not os.path.exists(resolved):
        raise ConfigError(f"{config_file}: {key} {written!r} resolves to {resolved}, which does not exist "
                          f"({PATH_RULE}: {base})")
    return resolved
