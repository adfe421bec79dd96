"""Which run directory a `regen generate` opens, and when a run's identity binds (docs/resume-and-drift.md).

- A run binds its identity at its first commit (a record or a terminal failure). Before that it has no data to
  protect: a rerun takes the config as it is now (the difference is logged), forgets what the preflight pinned
  (weight version, engines, determinism) and re-reads the prompt set if the prompt identity changed.
- A plain rerun resumes the newest run of its name (`<run>`, `<run>-r2`, ...) whose identity (the config's
  identity and the source files' digests) matches the config, and says so loudly when that is not the newest. If
  none matches, the newest run is taken only if it has committed nothing; otherwise the rerun is refused, listing
  each candidate with its difference.
- `--run-dir DIR` names the run to resume; the drift guard still decides.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..core.config import RunConfig
from ..core.errors import ConfigError, DriftError, RunLocked
from ..core.paths import PATH_RULE
from ..core.identity import (IDENTITY_VERSION, StoredRecords, check_identity, flat_diff, samples_per_prompt,
                             spec_renames, with_spec_keys)
from .lock import RunLock
from .promptset import check_source_files
from .records import stored_records, stored_samples
from .rundir import RunDir, _numbered_runs, resolve_run_dir, successor_run_dir

log = logging.getLogger("regen")

# What a run's preflight pins into run.json; a run that has committed nothing forgets them when it is rerun.
PREFLIGHT_PINS = ("weight_version", "engines", "deterministic")
# What a rerun of a run that has committed nothing keeps of its run.json (besides what the config gives).
KEPT_WHEN_UNBOUND = ("created_at", "identity_rebound")


def committed_nothing(run_dir: RunDir) -> bool:
    """No record and no terminal failure: the run's identity is not bound yet."""
    return not run_dir.parts(run_dir.data) and not run_dir.parts(run_dir.failures)


def prompt_set_unrecorded(run_dir: RunDir, manifest: dict[str, Any]) -> bool:
    """A prompt-set version was committed after the one run.json records (a start killed between the two writes):
    it may be another config's set, so the prompt set is read again (a run.json older than the record: unknown)."""
    recorded = manifest.get("prompt_set_version")
    return recorded is not None and recorded != len(run_dir.prompt_set_versions())


def records_of_older(run_dir: RunDir, manifest: dict[str, Any]) -> StoredRecords:
    """What the records of a run started by older regen show (its run.json did not record how they were made)."""
    if manifest.get("identity_version", 1) >= IDENTITY_VERSION:
        return StoredRecords()
    return stored_records(run_dir)


def identity_drift(cfg: RunConfig, run_dir: RunDir, refresh_prompts: bool, add_samples: bool = False) -> list[str]:
    """How the config differs from the run's recorded identity (empty: it may resume the run)."""
    manifest = run_dir.read_manifest()
    held = stored_samples(run_dir) if cfg.samples_per_prompt < samples_per_prompt(manifest.get("generation")) else None
    check = check_identity(manifest, cfg.identity(), refresh_prompts=refresh_prompts,
                           records=records_of_older(run_dir, manifest), add_samples=add_samples, stored_samples=held)
    files = [] if refresh_prompts else check_source_files(cfg, manifest).drift
    return with_prompt_advice(check.drift + files, bool(files))


def with_prompt_advice(drift: list[str], files_changed: bool) -> list[str]:
    if files_changed or any(line.startswith("prompts.") for line in drift):
        return drift + [PROMPTS_ADVICE]
    return drift


PROMPTS_ADVICE = ("the prompt set changed: --refresh-prompts re-reads the sources into this run (done prompts are "
                  "kept), --new-run starts a new run")


@dataclass
class ChosenRun:
    run_dir: RunDir
    notice: str | None = None  # said loudly once the run's log is open (log + stderr)


def choose_run(cfg: RunConfig, *, new_run: bool, refresh_prompts: bool, run_dir: str | None = None,
               add_samples: bool = False) -> ChosenRun:
    """The run directory a `regen generate` opens (see the module docstring). With --new-run, --add-samples does
    not make a run of another k match: --new-run asks for a new run whenever the config differs."""
    add_samples = add_samples and not new_run
    if run_dir is not None:
        named = RunDir(run_dir)
        if not named.exists():
            raise ConfigError(f"--run-dir {run_dir}: no run there (it has no run.json); without --run-dir "
                              f"regen picks the run of {cfg.run_name!r} in {cfg.output_dir}")
        theirs = named.read_manifest().get("run_name")
        if theirs is not None and theirs != cfg.run_name:
            # rebinding would rename it, resuming would mix two runs' names: the user means another run or config
            raise ConfigError(f"--run-dir {run_dir}: that is a run of {theirs!r}, and this config's run_name is "
                              f"{cfg.run_name!r}; set run_name: {theirs} to resume it, or name a run of "
                              f"{cfg.run_name!r}")
        return ChosenRun(named)
    runs = _numbered_runs(cfg.output_dir, cfg.run_name)
    started = [RunDir(runs[n]) for n in sorted(runs, reverse=True) if (runs[n] / "run.json").exists()]
    if not started:
        refuse_a_run_left_behind(cfg)
        return ChosenRun(resolve_run_dir(cfg.output_dir, cfg.run_name, False))
    newest, diffs = started[0], []
    for run in started:
        diffs.append(identity_drift(cfg, run, refresh_prompts, add_samples))
        if not diffs[-1]:
            if run is newest:
                return ChosenRun(run)
            return ChosenRun(run, f"resuming {run.path}, NOT the newest run of {cfg.run_name!r} ({newest.path}): "
                                  f"{run.path} is the newest whose identity matches this config (name it with "
                                  "--run-dir to say so; --new-run starts a new run only when none matches)")
    if committed_nothing(newest):
        return ChosenRun(newest)  # open_run takes the config, and logs the difference
    if new_run:
        refuse_beside_a_starting_run([RunDir(path) for path in runs.values() if not (path / "run.json").exists()])
        return ChosenRun(successor_run_dir(cfg.output_dir, cfg.run_name))
    if len(started) == 1:
        raise refusal_of(newest, DriftError(str(newest.path), diffs[0]))
    lines = []
    for run, diff in zip(started, diffs):
        lines += [f"{run.path}{' (newest)' if run is newest else ''}:"] + [f"  {line}" for line in diff]
    raise refusal_of(newest, DriftError(
        f"no run of {cfg.run_name!r} in {cfg.output_dir} matches this config: each", lines,
        "Restore the values of the run to resume, name one with --run-dir (the drift guard still applies), or pass "
        "--new-run to start a new run directory with this config."))


def refusal_of(run: RunDir, error: DriftError) -> DriftError:
    """The refusal, naming the run whose log should end with it (`refused_run`)."""
    error.refused_run = run
    return error


def refuse_a_run_left_behind(cfg: RunConfig) -> None:
    """No run of this name where output_dir now resolves (against the config's folder), but one where an older
    regen put it (the same text taken from the working directory): starting anew would silently redo that run."""
    old = cfg.output_dir_before_the_path_rule()
    if old is None or not os.path.isdir(old):
        return
    theirs = sorted(str(path) for path in _numbered_runs(old, cfg.run_name).values() if (path / "run.json").exists())
    if theirs:
        raise ConfigError(
            f"output_dir {cfg._output_dir_written!r} resolves to {cfg.output_dir} ({PATH_RULE}), where no run of "
            f"{cfg.run_name!r} exists; but where regen took it from before this rule (the working directory) there is "
            f"{', '.join(theirs)}. To resume it, set output_dir: {old} (or the path relative to the config's "
            f"folder); to start a new run under {cfg.output_dir} anyway, move that run, or run regen from the config's "
            "folder")


def refuse_beside_a_starting_run(unstarted: list[RunDir]) -> None:
    """A run folder without run.json whose lock is held: another driver is reading its sources for a new run
    (maybe this very config's --new-run). A successor started beside it would send the same prompts twice."""
    for run in unstarted:
        lock = RunLock(run)
        if lock.is_held():
            holder = lock.holder() or {}
            raise RunLocked(f"{run.path} is being started by another regen driver (pid {holder.get('pid', '?')} "
                            f"on {holder.get('host', '?')}; it has not written run.json yet): --new-run would "
                            "start a run beside it. Rerun once it has started: a run that matches is resumed")


@dataclass
class Rebound:
    """run.json for a rerun of a run that has committed nothing, and whether its prompt set must be read again."""

    manifest: dict[str, Any]
    restage: bool
    diff: list[str] = field(default_factory=list)
    reset: dict[str, Any] = field(default_factory=dict)  # what the preflight had pinned, now forgotten


def rebind(cfg: RunConfig, run_dir: RunDir, manifest: dict[str, Any], fresh: dict[str, Any],
           refresh_prompts: bool, now: str) -> Rebound:
    """The config's identity for a run that has committed nothing (`fresh`: run.json as a new run would have it).

    The prompt set is kept only if it was recorded for the same prompt identity and its source files are as they
    were; otherwise it is read again, and run.json keeps the old `prompts` until the new set is committed (so a
    kill in between reads it again)."""
    identity = {key: fresh[key] for key in ("generation", "prompts")}
    stored = {key: manifest.get(key) or {} for key in identity}
    stored["prompts"] = with_spec_keys(stored["prompts"], spec_renames(stored["prompts"], identity["prompts"]))
    diff = flat_diff(stored, identity)
    stored_check = check_identity(manifest, fresh, refresh_prompts=False)
    prompts_changed = any(line.startswith("prompts") for line in stored_check.drift) or "prompts" not in manifest
    files = None if prompts_changed or "source_files" not in manifest else check_source_files(cfg, manifest)
    restage = (refresh_prompts or prompts_changed or files is None or bool(files.drift)
               or not run_dir.prompt_set_versions() or prompt_set_unrecorded(run_dir, manifest))
    updated = {**fresh, **{key: manifest[key] for key in KEPT_WHEN_UNBOUND if key in manifest}}
    if restage:
        for key in ("prompts", "source_files", "prompt_report", "prompt_set_version"):
            updated.pop(key, None)
            if key in manifest and key != "prompt_report":
                updated[key] = manifest[key]  # replaced by materialise once the new set is committed
    else:
        updated.update(source_files=files.recorded, prompt_report=manifest.get("prompt_report"))
        if "prompt_set_version" in manifest:
            updated["prompt_set_version"] = manifest["prompt_set_version"]
    if files is not None:
        diff += files.drift
    if diff:
        updated["identity_rebound"] = [*manifest.get("identity_rebound", []), {"at": now, "diff": diff}]
    reset = {key: manifest[key] for key in PREFLIGHT_PINS if key in manifest}
    return Rebound(updated, restage, diff, reset)
