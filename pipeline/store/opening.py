"""Opening a run for `regen generate`: create it, or check that the config may resume it (the drift guard), or
let a run that has committed nothing take the config (its identity binds at its first commit). What this
writes is undone if the command is then refused before its first commit (store/untouched.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import DriftError
from ..core.identity import check_identity, new_samples, resumed_manifest, samples_per_prompt
from ..core.config import RunConfig
from .promptset import check_schema_takes_samples, check_source_files
from .records import stored_samples
from .resume import committed_nothing, prompt_set_unrecorded, rebind, records_of_older, with_prompt_advice
from .rundir import RunDir, now_utc

log = logging.getLogger("regen")


@dataclass
class OpenedRun:
    manifest: dict[str, Any]
    restage: bool = False  # the prompt set is read again (a run that has committed nothing, whose sources changed)


@dataclass(frozen=True)
class OpenFlags:
    refresh_prompts: bool = False
    add_samples: bool = False


def open_run(cfg: RunConfig, flags: OpenFlags, run_dir: RunDir, fresh: Callable[[], dict[str, Any]]) -> OpenedRun:
    """Create the run directory, or check that the config may resume it (the drift guard). A run that has
    committed nothing takes the config instead (its identity binds at its first commit). `fresh`: run.json as a
    new run of this config has it."""
    run_dir.create()
    for tmp in run_dir.cleanup_temp():
        log.info("removed uncommitted temporary file %s", tmp.name)
    if run_dir.exists():
        check_schema_takes_samples(cfg.samples_per_prompt, run_dir.read_manifest().get("schema_version"))
    if not run_dir.exists():
        manifest = fresh()
        run_dir.write_manifest(manifest)
        # a prompt set no run.json names (a start killed while it put a refused new run back) is no run's: the
        # new run reads its own sources (a new version past it), never takes that set for its own
        leftover = bool(run_dir.prompt_set_versions())
        if leftover:
            log.warning("%s holds a prompt set no run.json names (left by a start that was killed): this new run "
                        "reads its prompts from the sources", run_dir.path)
        return OpenedRun(manifest, restage=leftover)
    manifest = run_dir.read_manifest()
    if committed_nothing(run_dir):
        return rebind_unbound(cfg, flags, run_dir, manifest, fresh())
    identity = cfg.identity()
    check = check_identity(manifest, identity, refresh_prompts=flags.refresh_prompts,
                           records=records_of_older(run_dir, manifest), add_samples=flags.add_samples,
                           stored_samples=samples_stored_if_lowered(run_dir, manifest, cfg))
    # the source files: a changed size or mtime is drift only if the digest differs too (a copy is not drift)
    files = None if flags.refresh_prompts else check_source_files(cfg, manifest)
    drift = with_prompt_advice(check.drift + (files.drift if files else []), bool(files and files.drift))
    if drift:
        raise DriftError(str(run_dir.path), drift)
    updated = resumed_manifest(manifest, identity, check)
    if flags.refresh_prompts and "prompts" in manifest:
        updated["prompts"] = manifest["prompts"]  # recorded by materialise once the new set is committed
    if files:
        for note in files.notes:
            log.info("%s", note)
        updated["source_files"] = files.recorded
    log_samples_change(check)
    if check.adopted:
        log.warning("run.json (identity version %s) did not record %s; recorded from this config, compared from "
                    "now on", manifest.get("identity_version", 1),
                    ", ".join(f"{key} = {value!r}" for key, value in check.adopted.items()))
    if updated != manifest:
        run_dir.write_manifest(updated)
    unrecorded = prompt_set_unrecorded(run_dir, manifest)
    if unrecorded:
        log.warning("the newest prompt set of %s was committed by a start killed before run.json recorded it: "
                    "it is read again from the sources (done prompts are kept)", run_dir.path)
    return OpenedRun(updated, unrecorded)


def samples_stored_if_lowered(run_dir: RunDir, manifest: dict[str, Any], cfg: RunConfig) -> int | None:
    """How many samples of a prompt the ledger holds (1 + the highest sample index of a record or a failure),
    read only when the config asks for fewer than run.json records: a lowering is judged by what is stored."""
    if cfg.samples_per_prompt >= samples_per_prompt(manifest.get("generation")):
        return None
    return stored_samples(run_dir)


def log_samples_change(check) -> None:
    if check.raised_samples:
        old, new = check.raised_samples
        log.warning("samples_per_prompt raised from %d to %d (--add-samples): %s of every prompt %s added to this "
                    "run; its committed samples are kept, run.json records %d (undone if this command is refused "
                    "before its first commit)", old, new, new_samples(old, new), "is" if new - old == 1 else "are",
                    new)
    if check.unbound_samples:
        recorded, stored, new = check.unbound_samples
        log.warning("samples_per_prompt: run.json says %d, but the run holds no record of a sample past %d (a raise "
                    "binds when its first new sample commits, and none did): this run takes %d", recorded,
                    stored - 1, new)


def rebind_unbound(cfg: RunConfig, flags: OpenFlags, run_dir: RunDir, manifest: dict[str, Any],
                   fresh: dict[str, Any]) -> OpenedRun:
    """A run with no record and no failure has no data to protect: it takes this config (logging the
    difference), forgets what the preflight pinned, and reads its prompt set again if that changed."""
    rebound = rebind(cfg, run_dir, manifest, fresh, flags.refresh_prompts, now_utc().isoformat(timespec="seconds"))
    if rebound.diff:
        log.warning("%s has committed nothing yet, so it takes this config (a run's identity binds at its first "
                    "commit); changed since its last start:", run_dir.path)
        for line in rebound.diff:
            log.warning("  %s", line)
    if rebound.reset:
        log.info("forgot what the earlier preflight pinned (%s): this session's preflight pins them again",
                 ", ".join(f"{key} = {value!r}" for key, value in rebound.reset.items()))
    if rebound.restage and manifest.get("prompts") is not None:
        log.info("the prompt set is read again from the sources")
    run_dir.write_manifest(rebound.manifest)
    return OpenedRun(rebound.manifest, rebound.restage)
