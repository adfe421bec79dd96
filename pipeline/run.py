"""`regen generate`: config → run directory → prompt set → preflight → dispatch → commits.

Read end to end, this is the whole run. Everything it calls is one module of the data flow.
"""
from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from . import IMPORTED_AT, __version__
from .store import schema
from .core import exits
from .core.background import Background
from .core.config import RunConfig, load_config
from .core.errors import DriftError, LeaseLost, QualityGateStopped, StorageError
from .core.identity import IDENTITY_VERSION
from .prompts.prompt_set import PromptSet, build_prompt_set
from .prompts.report import report_lines
from .prompts.tokens import load_length_check
from .endpoints.image_fetch import image_fetcher
from .store.promptset import (StagedPromptSet, check_schema_takes_parts, check_schema_takes_tools, report_document,
                              source_specs, stage_prompt_set)
from .store.committer import Committer, signals_deferred
from .store.goodput import summary_line
from .store.progress import duration, held_out, records_of
from .store.status import counts_line, run_goodput
from .store.opening import OpenFlags, open_run
from .store.resume import ChosenRun, choose_run, committed_nothing
from .store.untouched import Untouched
from .store.rundir import RunDir, RunLock, now_utc, successor_run_dir
from .dispatch.fleet import EarlyProbe, FleetDrift, check_fleet_first, fleet_preflight
from .dispatch.needs import has_images
from .store.prompt_reader import PendingScan, PromptSetReader
from .store.records import RecordBuilder
from .dispatch.session import run_dispatch, session_start
from .dispatch.stopping import StopFlag, end_the_log_of, log_the_end, setup_logging

log = logging.getLogger("regen")

EXIT_INTERRUPTED = exits.INTERRUPTED.code


@dataclass
class GenerateOptions:
    config: str
    new_run: bool = False
    refresh_prompts: bool = False
    retry_failures: bool = False
    start_with_passing: bool = False  # endpoints the preflight refuses are held out; they join once they pass
    run_dir: str | None = None  # --run-dir: the run to resume (the drift guard still applies)
    add_samples: bool = False  # --add-samples: a config raising samples_per_prompt resumes the run, adding samples


# --- the prompt set ------------------------------------------------------------------------------
def has_tools(prompts: PromptSetReader) -> bool:
    """Some prompt is sent with tools (the preflight then checks that the fleet returns tool_calls)."""
    return prompts.has_tools()


def build_prompts(cfg: RunConfig) -> PromptSet:
    """The whole prompt set in memory (regen simulate); a run streams it through stage_prompt_set."""
    specs = list(source_specs(cfg).values())
    check = load_length_check(cfg.max_prompt_tokens, cfg.tokenizer_path(), cfg.served_chat_template(),
                              cfg.images.tokens_per_image)
    return build_prompt_set(specs, mode=cfg.mode, seed=cfg.selection_seed, length_check=check, images=cfg.images,
                            fetch=image_fetcher(cfg.images))


def read_sources(cfg: RunConfig) -> StagedPromptSet:
    """The sources read into a staged set, http(s) images fetched here (endpoints/: the prompts layer does no
    HTTP) unless `images.remote: refuse`."""
    return stage_prompt_set(cfg, fetch=image_fetcher(cfg.images))


def materialise(cfg: RunConfig, run_dir: RunDir, refresh: bool,
                staged: StagedPromptSet | None = None) -> PromptSetReader:
    """The prompt set is read from the sources once; a resume uses the stored copy. The sources are read into
    a staged set first (`staged`: already read), so a source that fails writes nothing into the run. Returns the
    version this run reads, pinned, never loaded whole (store/prompt_reader.py)."""
    # the version run.json records (store/resume.py; a run.json older than the record: the newest)
    existing = run_dir.prompt_set_reader(run_dir.read_manifest().get("prompt_set_version"))
    if existing is not None and not refresh:
        if staged is not None:
            staged.discard()
        return existing
    staged = staged or read_sources(cfg)
    schema_version = run_dir.read_manifest().get("schema_version")
    check_schema_takes_tools(staged, schema_version)  # each discards the staged set if it refuses
    check_schema_takes_parts(staged, schema_version)
    report = report_document(staged)
    for line in report_lines(report["sources"], indent=""):
        log.info("%s", line)
    if report["rejects"]:
        log.warning("%d invalid prompts written to %s with their reasons", report["rejects"], run_dir.rejects)
    if report["duplicates"]:
        log.info("%d duplicate prompts collapsed", report["duplicates"])
    staged.commit(run_dir)
    version = len(run_dir.prompt_set_versions())
    prompts = run_dir.prompt_set_reader(version)
    # recorded once the set is committed: a kill before this leaves the old identity, refused as drift
    run_dir.write_manifest({**run_dir.read_manifest(), "prompts": cfg.prompt_identity(),
                            "source_files": staged.files, "prompt_report": report,
                            "prompt_set_version": version})
    if existing is not None:
        added, vanished, first = prompts.refreshed_from(existing)
        log.warning("prompt set refreshed: %d added, %d vanished from the sources (their records are kept)",
                    added, vanished)
        for pid in first:
            log.info("vanished prompt %s", pid)
    return prompts


# --- the run directory -----------------------------------------------------------------------------
def manifest_for(cfg: RunConfig, config_path: str) -> dict[str, Any]:
    import openai
    import ray

    return {
        "schema_version": schema.SCHEMA_VERSION,
        "identity_version": IDENTITY_VERSION,
        "fingerprint": cfg.fingerprint(),
        "run_name": cfg.run_name,  # a successor `<run>-rN` names its run; a run called `<x>-r2` names itself
        **cfg.identity(),
        "created_at": now_utc().isoformat(timespec="seconds"),
        "config_file": config_path,
        "versions": {"regen": __version__, "python": platform.python_version(), "ray": ray.__version__,
                     "pyarrow": pa.__version__, "openai": openai.__version__},
    }


# --- generate ---------------------------------------------------------------------------------------
def generate(opts: GenerateOptions) -> int:
    cfg = load_config(opts.config)
    cfg.check_secrets()
    stop = StopFlag()
    stop.install()
    try:
        chosen = choose_run(cfg, new_run=opts.new_run, refresh_prompts=opts.refresh_prompts, run_dir=opts.run_dir,
                            add_samples=opts.add_samples)
    except DriftError as refused:
        end_the_log_of(getattr(refused, "refused_run", None), refused)
        raise
    try:
        return generate_in(cfg, opts, chosen, stop)
    except FleetDrift as drift:
        if not opts.new_run:
            raise
        run_dir = successor_run_dir(cfg.output_dir, cfg.run_name)
        log.warning("%s was made by another fleet (%s); --new-run: starting %s", drift.run_dir,
                    "; ".join(drift.diff), run_dir.path)
        return generate_in(cfg, opts, ChosenRun(run_dir), stop)


def generate_in(cfg: RunConfig, opts: GenerateOptions, chosen: ChosenRun, stop: StopFlag) -> int:
    run_dir = chosen.run_dir
    if opts.new_run and run_dir.exists() and not committed_nothing(run_dir):
        check_fleet_first(cfg, run_dir, opts.start_with_passing)
    # the lock first: a second driver is refused at once, before it reads any source
    with RunLock(run_dir) as lock:
        # a new run reads its sources before it writes anything: a source that fails leaves no run directory
        # (nor the folder a start killed here left: only its lock files are in it, removed under the lock)
        try:
            staged = None if run_dir.exists() else read_sources(cfg)
        except BaseException:
            lock.remove_folder_on_release = not run_dir.exists()
            raise
        # what a command refused (or failed) before its first commit puts back (store/untouched.py)
        before = Untouched.take(run_dir.path)
        setup_logging(run_dir)
        undo = False
        try:  # from here every way this session ends is the last line of the run's log (a refusal as drift too)
            if chosen.notice:
                log.warning("%s", chosen.notice)
            if lock.previous_holder:
                log.warning("took over a stale lock left by pid %s", lock.previous_holder.get("pid"))
            log.info("run directory %s", run_dir.path)
            log.info("%.2f s since the process started (imports, the config, the run's lock); Arrow's memory pool: %s",
                     time.monotonic() - IMPORTED_AT, pa.default_memory_pool().backend_name, extra={"file_only": True})
            flags = OpenFlags(opts.refresh_prompts, opts.add_samples and not opts.new_run)
            opened = open_run(cfg, flags, run_dir, lambda: manifest_for(cfg, opts.config))
            prompts = materialise(cfg, run_dir, opts.refresh_prompts or opened.restage, staged)
            return dispatch_pending(cfg, opts, run_dir, opened.manifest, prompts, stop, lock)
        except BaseException as exc:
            with signals_deferred():  # a signal waits for the decision (a listing), then for the undo (below)
                undo = before.undo_after(exc)
            if undo and not before.new:
                log.warning("nothing was committed: the run is left as it was", extra={"file_only": True})
            log_the_end(run_dir, exc)
            raise
        finally:
            try:
                run_dir.publish_logs()
            except StorageError as exc:
                log.warning("logs not uploaded (%s); they stay in %s", exc, run_dir.local_logs())
            finally:
                if undo:
                    with signals_deferred():  # never left half put back by a signal
                        put_back(before, lock)


def put_back(before: Untouched, lock: RunLock) -> None:
    """A command refused (or failed) before its first commit: the run as it was; a new run: no directory left."""
    try:
        for line in before.restore():
            log.info("%s", line, extra={"file_only": True})
    except (OSError, StorageError) as exc:  # the refusal is what the user must see: never hide it
        log.warning("could not put %s back as it was (%s)", before.root, exc)
    lock.remove_folder_on_release = before.new


def dispatch_pending(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir, manifest: dict[str, Any],
                     prompts: PromptSetReader, stop: StopFlag, lock: RunLock | None = None) -> int:
    """Three things start at once, each waiting on something else: the ledger read and the pending scan (a thread:
    Arrow reads files), the fleet's probes (EarlyProbe: they wait on the endpoints) and, with the session, the
    first endpoint actors (they wait on Ray). The probes start early unless the run starts local servers (only once
    it knows it has work) or its status says it is complete; they start once the first actors are asked for, so
    that their imports (the OpenAI SDK, in their thread) do not delay the first actor's start."""
    tools, images = has_tools(prompts), has_images(prompts)
    scanning = Background(lambda: pending_scan(cfg, opts, run_dir, prompts), "regen-ledger")
    probe = None
    try:
        with session_start(cfg, run_dir, stop) as (early, metrics):
            if cfg.local_fleet is None and (run_dir.read_status() or {}).get("state") != "complete":
                probe = EarlyProbe(cfg, opts.start_with_passing, tools, images, wait=stop.wait)
            return dispatch_started(cfg, opts, run_dir, manifest, prompts, stop, lock, early, metrics, tools,
                                    lambda: scanning.result(stop.wait), probe, images)
    finally:
        if probe is not None:
            probe.cancel()  # nothing pending, or the run stopped: the probes' answers are not needed
        scanning.wait()  # a run stopped early (a signal, /metrics' port taken) exits with no read in flight


def pending_scan(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir, prompts: PromptSetReader) -> PendingScan:
    """The units to run: the ledger, as Arrow arrays of unit ids (no Python object per committed unit), against the
    pinned prompt set. A few bytes per pending unit (its id, row and routing key); messages are read as work is
    handed out. Each prompt is samples_per_prompt units; committed and failed are unit ids."""
    started = time.monotonic()
    committed, failed = run_dir.ledger(run_dir.data), run_dir.ledger(run_dir.failures)
    read = time.monotonic()
    scan = prompts.pending(committed.ids, failed.ids, not opts.retry_failures, cfg.prefix_affinity_chars,
                           samples=cfg.samples_per_prompt)
    scan.unindexed = {run_dir.data.name: committed.unindexed, run_dir.failures.name: failed.unindexed}
    log.info("ledger read in %.2f s (%d committed, %d failed rows; %d parts from %d index segments, %d read one "
             "by one), pending scan in %.2f s", read - started, len(committed.ids), len(failed.ids),
             committed.covered + failed.covered, committed.segments + failed.segments,
             len(committed.unindexed) + len(failed.unindexed), time.monotonic() - read, extra={"file_only": True})
    del committed, failed
    pa.default_memory_pool().release_unused()  # the reads' buffers, kept by the allocator: a resume's peak RSS
    return scan


def dispatch_started(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir, manifest: dict[str, Any],
                     prompts: PromptSetReader, stop: StopFlag, lock: RunLock | None, early, metrics, tools: bool,
                     scanned: Callable[[], PendingScan], probe: EarlyProbe | None, images: bool = False) -> int:
    from .endpoints.localfleet import local_fleet
    from .store.progress import Progress, image_counts

    scan = scanned()
    pending = scan.pending
    samples = cfg.samples_per_prompt
    rejects = run_dir.rejects_count()

    def progress() -> Progress:
        return Progress(run_dir, total=scan.total, already_done=scan.done,
                        failed_before=0 if opts.retry_failures else scan.failed,
                        rejects=rejects, status_interval_s=cfg.status_interval_s,
                        log_interval_s=cfg.progress_log_interval_s,
                        # committed records' counts from the parts' footers: a kill after a commit loses none
                        goodput_before=run_goodput(run_dir, run_dir.read_status()),
                        samples_per_prompt=samples, image_prompts=image_counts(scan, opts.retry_failures))

    # --new-run also looks at the weights a complete run is pinned to: other weights make a successor
    if not pending and not (opts.new_run and manifest.get("weight_version") is not None):
        return report_complete(run_dir, progress(), cfg)
    with local_fleet(cfg.local_fleet, run_dir.local_logs()):
        fleet = fleet_preflight(cfg, run_dir, opts.start_with_passing, tools=tools, probed=probe, images=images)
        if not pending:
            return report_complete(run_dir, progress(), cfg)
        what = "prompts" if samples == 1 else f"samples ({samples} per prompt)"
        log.info("%d %s pending of %d (%d done, %d failed)", len(pending), what, scan.total, scan.done, scan.failed)
        run_progress = progress()
        builder = RecordBuilder(prompts, cfg, fingerprint=manifest.get("fingerprint"))
        # the committer's duplicate check starts from this session's commits: the ledger's units are never handed
        # out (the scan leaves them out, and the dispatcher finishes only the work it was given)
        committer = Committer(run_dir, set(), cfg.flush_records, cfg.flush_interval_s,  # no lease: no commit
                              schema.records_schema(manifest.get("schema_version")), lock=lock,
                              unindexed=scan.unindexed)
        try:
            state = run_dispatch(cfg, run_dir, builder, pending, committer, run_progress, stop, fleet, early,
                                 metrics)
        except BaseException as exc:
            salvage(committer, run_progress, "interrupted" if isinstance(exc, KeyboardInterrupt) else
                    "stopped_by_quality_gate" if isinstance(exc, QualityGateStopped) else "failed")
            raise
    committer.flush()
    run_progress.extra["commit_s"] = round(committer.commit_seconds, 3)  # writing parts, over the whole session
    run_progress.close()
    run_progress.write(state)
    log.info("%s", summary_line(run_progress.goodput_total().as_dict()))
    builder.tool_notes.log_to(log)
    held = held_out(run_progress.extra)
    session = (f"this session {run_progress.committed_done} records, {run_progress.committed_failed} failures in "
               f"{duration(run_progress.elapsed())}{held}")
    if state == "interrupted":
        log.warning("run ended (exit %d): interrupted: %d new records committed; %s; rerun to resume %s%s",
                    EXIT_INTERRUPTED, run_progress.committed_done, counts_line(run_dir), run_dir.path, held)
        return EXIT_INTERRUPTED
    log.info("run ended (exit 0): run %s is complete: %s, %d failures (%d late duplicates dropped); %s",
             run_dir.path, records_of(cfg.mode, cfg.samples_per_prompt, run_dir,
                                      run_progress.already_done + run_progress.committed_done),
             run_progress.failed_before + run_progress.committed_failed, committer.dropped_duplicates, session)
    return 0


def report_complete(run_dir: RunDir, progress, cfg: RunConfig) -> int:
    progress.close()
    progress.write_keeping_last_session("complete")
    log.info("run ended (exit 0): run %s is complete: %s, %d failures, nothing pending", run_dir.path,
             records_of(cfg.mode, cfg.samples_per_prompt, run_dir, progress.already_done), progress.failed_before)
    return 0


def salvage(committer: Committer, progress, state: str) -> None:
    """After a fatal error or a forced stop: commit what is buffered if the disk allows (and the run is still
    this driver's), and record the state. Never raises for either: the error that stopped the run is the one
    that ends it (the caller re-raises it)."""
    progress.close()
    try:
        committer.flush()
        progress.write(state)
    except LeaseLost as exc:  # another driver holds the run: its status is not ours to write either
        log.error("%s; besides the error that stopped this run (below)", exc)
    except StorageError as exc:
        log.error("could not commit the last buffer (%s); it will be regenerated on resume", exc)
