"""The identity of a source's local files: size and modification time, and a sha256 that decides when either
differs, so a copied or re-downloaded dataset is not drift but a changed one is.

Recorded in run.json (`source_files`: spec -> file -> size, mtime_ns, sha256) when the prompt set is built,
compared when a run resumes on its stored prompt set. Hashing runs only when the stat differs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SourceError, read_error
from .hf import local_data_files
from .sources import SourceSpec, resolve_files


def local_files(spec: SourceSpec) -> dict[str, Path]:
    """The local files a source reads, by the name messages give them. A hub dataset has none; a missing
    file is simply absent here (reading it is what fails)."""
    if spec.kind == "hf":
        files = local_data_files(spec)
    else:
        try:
            files = resolve_files(spec)
        except SourceError:
            files = []
    return {spec.shown(f): f for f in files}


def digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_identity(specs: dict[str, SourceSpec]) -> dict[str, dict[str, dict[str, Any]]]:
    """What run.json records: for each spec (as the config names it), each file's size, mtime and sha256."""
    identity: dict[str, dict[str, dict[str, Any]]] = {}
    for key, spec in specs.items():
        identity[key] = {}
        for name, path in local_files(spec).items():
            try:
                identity[key][name] = _entry(path, digest(path))
            except OSError as exc:
                raise read_error(spec.name, exc, name) from exc
    return identity


def _entry(path: Path, sha: str) -> dict[str, Any]:
    # `path` (where it was) is for `regen status`; only size, mtime and sha256 are compared
    return {**_stat(path), "sha256": sha, "path": str(path.resolve())}


@dataclass
class FilesCheck:
    drift: list[str] = field(default_factory=list)  # files whose content changed, or that are new
    notes: list[str] = field(default_factory=list)  # what was accepted: copies with the same content, files gone
    recorded: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # the identity to store now


def compare_files(stored: dict[str, dict[str, dict[str, Any]]], specs: dict[str, SourceSpec]) -> FilesCheck:
    """The stored file identity against the files as they are. A spec the stored identity does not name (run.json
    written before it was recorded) is not compared."""
    check = FilesCheck(recorded={key: dict(files) for key, files in stored.items()})
    for key, spec in specs.items():
        if key not in stored:
            continue
        old, now = stored[key], local_files(spec)
        for name in sorted(set(old) | set(now)):
            before, path = old.get(name), now.get(name)
            if before is None:
                check.drift.append(f"source file {name} ({key}): new since the prompt set was built "
                                   f"({path.stat().st_size:,} bytes)")
                continue
            if path is None:
                check.notes.append(f"source file {name} ({key}) is gone; the stored prompt set is used")
                continue
            try:
                stat = _stat(path)
                if (stat["size"], stat["mtime_ns"]) == (before.get("size"), before.get("mtime_ns")):
                    continue
                sha = digest(path)
            except OSError as exc:
                check.notes.append(f"source file {name} ({key}) changed and cannot be read to compare it "
                                   f"({exc.strerror or exc}); the stored prompt set is used")
                continue
            if sha == before.get("sha256"):
                check.recorded[key][name] = _entry(path, sha)
                check.notes.append(f"source file {name} ({key}) has a new size or modification time but the same "
                                   "content (copied or touched): not drift")
            else:
                check.drift.append(f"source file {name} ({key}): {before.get('size', 0):,} -> {stat['size']:,} "
                                   f"bytes, content changed (sha256 {str(before.get('sha256'))[:12]} -> {sha[:12]})")
    return check


def file_states(stored: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """`regen status`: each recorded source file that is no longer as it was (by its stat alone: no hashing)."""
    import os

    lines, unchanged = [], 0
    for key, files in stored.items():
        for name, entry in files.items():
            path = Path(entry.get("path") or name)
            try:
                stat = _stat(path)
            except FileNotFoundError:
                lines.append(f"source file {name} ({key}) is not at {path} here: a resume uses the stored "
                             "prompt set, --refresh-prompts could not read it")
                continue
            except OSError as exc:
                lines.append(f"source file {name} ({key}) cannot be read: {exc.strerror or exc}")
                continue
            if not os.access(path, os.R_OK):
                lines.append(f"source file {name} ({key}) cannot be read: permission denied")
            elif (stat["size"], stat["mtime_ns"]) != (entry.get("size"), entry.get("mtime_ns")):
                lines.append(f"source file {name} ({key}) changed since the prompt set was built "
                             f"({entry.get('size', 0):,} -> {stat['size']:,} bytes, or its time): the next start "
                             "compares its digest, and refuses to resume if the content differs")
            else:
                unchanged += 1
    return ([f"source files: {unchanged} unchanged since the prompt set was built"] if unchanged else []) + lines
