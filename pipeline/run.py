"""`regen generate`: config → run directory → prompt set → preflight → dispatch → commits.

Read end to end, this is the whole run. Everything it calls is one module of the data flow.
"""
from __future__ import annotations

import contextlib
import logging
import platform
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from . import __version__
from .store import schema
from .core.config import RunConfig, flat_diff, load_config
from .core.errors import ConfigError, DriftError, StorageError
from .prompts.prompt_set import PromptSet, build_prompt_set
from .prompts.sources import load_source_spec
from .store.rundir import Committer, RunDir, RunLock, now_utc, resolve_run_dir
from .store.records import RecordBuilder
from .core.work import DONE, Outcome

log = logging.getLogger("regen")

EXIT_INTERRUPTED = 130


@dataclass
class GenerateOptions:
    config: str
    new_run: bool = False
    refresh_prompts: bool = False
    retry_failures: bool = False
    force: bool = False  # start even if the hidden states' estimated size exceeds the free space


# --- the prompt set ------------------------------------------------------------------------------
def build_prompts(cfg: RunConfig) -> PromptSet:
    specs = []
    for ref in cfg.sources:
        spec = load_source_spec(ref.spec)
        specs.append((spec, ref.limit if ref.limit is not None else spec.limit))
    return build_prompt_set(specs, mode=cfg.mode, seed=cfg.selection_seed)


def prompt_tables(prompt_set: PromptSet) -> tuple[pa.Table, pa.Table]:
    prompts = pa.Table.from_pylist(
        [
            {"prompt_id": p.prompt_id, "source": p.source, "origin": p.origin, "source_ref": p.source_ref,
             "messages": list(p.messages), "reference": p.reference}
            for p in prompt_set.prompts
        ],
        schema=schema.PROMPTS,
    )
    rejects = pa.Table.from_pylist(
        [{"source": r.source, "origin": r.origin, "reason": r.reason, "raw": r.raw} for r in prompt_set.rejects],
        schema=schema.REJECTS,
    )
    return prompts, rejects


def materialise(cfg: RunConfig, run_dir: RunDir, refresh: bool) -> pa.Table:
    """The prompt set is read from the sources once; a resume uses the stored copy."""
    existing = run_dir.load_prompt_set()
    if existing is not None and not refresh:
        return existing
    prompt_set = build_prompts(cfg)
    prompts, rejects = prompt_tables(prompt_set)
    for report in prompt_set.reports:
        log.info("source %s: %d read, %d valid, %d rejected, %d selected, %d duplicates", report.name,
                 report.read, report.valid, report.rejected, report.selected, report.duplicates)
    if prompt_set.rejects:
        log.warning("%d invalid prompts written to %s with their reasons", len(prompt_set.rejects), run_dir.rejects)
    if prompt_set.duplicates:
        log.info("%d duplicate prompts collapsed", prompt_set.duplicates)
    if existing is not None:
        old, new = set(existing.column("prompt_id").to_pylist()), set(prompts.column("prompt_id").to_pylist())
        vanished = old - new
        log.warning("prompt set refreshed: %d added, %d vanished from the sources (their records are kept)",
                    len(new - old), len(vanished))
        for pid in sorted(vanished)[:20]:
            log.info("vanished prompt %s", pid)
    run_dir.write_prompt_set(prompts, rejects)
    return prompts


# --- the run directory -----------------------------------------------------------------------------
def manifest_for(cfg: RunConfig, config_path: str) -> dict[str, Any]:
    import openai
    import ray

    return {
        "schema_version": schema.SCHEMA_VERSION,
        "fingerprint": cfg.fingerprint(),
        "generation": cfg.generation_identity(),
        "prompts": cfg.prompt_identity(),
        "created_at": now_utc().isoformat(timespec="seconds"),
        "config_file": config_path,
        "versions": {"regen": __version__, "python": platform.python_version(), "ray": ray.__version__,
                     "pyarrow": pa.__version__, "openai": openai.__version__},
    }


def check_drift(cfg: RunConfig, run_dir: RunDir, manifest: dict[str, Any], refresh: bool) -> None:
    diff = flat_diff(manifest["generation"], cfg.generation_identity())
    if not refresh:
        diff += [f"prompt set {line}" for line in flat_diff(manifest["prompts"], cfg.prompt_identity())]
    if diff:
        raise DriftError(str(run_dir.path), diff)


def open_run(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir) -> None:
    run_dir.create()
    for tmp in run_dir.cleanup_temp():
        log.info("removed uncommitted temporary file %s", tmp.name)
    if run_dir.exists():
        manifest = run_dir.read_manifest()
        check_drift(cfg, run_dir, manifest, opts.refresh_prompts)
        if opts.refresh_prompts and manifest["prompts"] != cfg.prompt_identity():
            run_dir.write_manifest({**manifest, "prompts": cfg.prompt_identity()})
    else:
        run_dir.write_manifest(manifest_for(cfg, opts.config))


def setup_logging(run_dir: RunDir) -> None:
    root = logging.getLogger("regen")
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir.local_logs() / "regen.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("regen: %(message)s"))
    root.addHandler(file_handler)
    root.addHandler(console)
    root.propagate = False


# --- records ----------------------------------------------------------------------------------------
class StopFlag:
    """SIGINT/SIGTERM ask for a clean stop: dispatch ends, the buffer is committed, exit non-zero."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # a second signal: stop now
        self.signal = signum
        log.warning("%s received: committing what is buffered, then stopping", signal.Signals(signum).name)

    def __call__(self) -> bool:
        return self.signal is not None


# --- generate ---------------------------------------------------------------------------------------
def generate(opts: GenerateOptions) -> int:
    cfg = load_config(opts.config)
    cfg.check_secrets()
    run_dir = resolve_run_dir(cfg.output_dir, cfg.run_name, cfg.fingerprint(), opts.new_run)
    with RunLock(run_dir) as lock:
        open_run(cfg, opts, run_dir)
        setup_logging(run_dir)
        if lock.previous_holder:
            log.warning("took over a stale lock left by pid %s", lock.previous_holder.get("pid"))
        log.info("run directory %s", run_dir.path)
        try:
            prompts = materialise(cfg, run_dir, opts.refresh_prompts)
            return dispatch_pending(cfg, opts, run_dir, prompts, lock)
        finally:
            try:
                run_dir.publish_logs()
            except StorageError as exc:
                log.warning("logs not uploaded (%s); they stay in %s", exc, run_dir.local_logs())


def dispatch_pending(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir, prompts: pa.Table,
                     lock: RunLock | None = None) -> int:
    from .store.progress import Progress

    all_ids = prompts.column("prompt_id").to_pylist()
    committed = run_dir.committed_ids()
    failed = run_dir.failed_ids() - committed
    done = committed | (set() if opts.retry_failures else failed)
    pending = [pid for pid in all_ids if pid not in done]
    rejects = run_dir.rejects_table()
    progress = Progress(run_dir, total=len(all_ids), already_done=len(committed & set(all_ids)),
                        failed_before=0 if opts.retry_failures else len(failed & set(all_ids)),
                        rejects=0 if rejects is None else rejects.num_rows, status_interval_s=cfg.status_interval_s)
    if not pending:
        progress.close()
        progress.write("complete")
        print(f"run {run_dir.path} is complete: {progress.already_done} records, "
              f"{progress.failed_before} failures, nothing pending", file=sys.stderr)
        return 0
    log.info("%d prompts pending of %d (%d done, %d failed)", len(pending), len(all_ids), len(committed), len(failed))
    prepare_hidden_states(cfg, opts, run_dir, prompts, pending)
    builder = RecordBuilder(prompts, cfg)
    committer = Committer(run_dir, done, cfg.flush_records, cfg.flush_interval_s, lock=lock)  # no lease: no commit
    stop = StopFlag()
    try:
        with local_fleet(cfg, run_dir):
            state = run_dispatch(cfg, run_dir, builder, pending, committer, progress, stop)
    except BaseException:
        salvage(committer, progress)
        raise
    committer.flush()
    progress.close()
    progress.write(state)
    if state == "interrupted":
        print(f"interrupted: {progress.done} new records committed; rerun to resume {run_dir.path}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"run {run_dir.path} is complete: {progress.already_done + progress.done} records, "
          f"{progress.failed_before + progress.failed} failures "
          f"({committer.dropped_duplicates} late duplicates dropped)", file=sys.stderr)
    return 0


def prepare_hidden_states(cfg: RunConfig, opts: GenerateOptions, run_dir: RunDir, prompts: pa.Table,
                          pending: list[str]) -> None:
    """Remove hidden parts no committed row references (left by a kill or a retried request), then check
    that the pending work's hidden states fit on the disk."""
    from .hidden.parse import check_free_space, estimate_bytes
    from .hidden.parts import garbage_hidden_parts

    garbage = garbage_hidden_parts(run_dir)
    for part in garbage:
        part.unlink()
    if garbage:
        log.info("removed %d unreferenced hidden-state parts", len(garbage))
    if not cfg.hidden_states.enabled:
        return
    chars = sum(len(m["content"]) for conv in prompts.column("messages").slice(0, 2000).to_pylist() for m in conv)
    mean_prompt_tokens = chars / max(1, min(2000, prompts.num_rows)) / 4  # ~4 characters a token
    tokens = int(mean_prompt_tokens + cfg.sampling.max_tokens)
    needed = estimate_bytes(len(pending), tokens, cfg.hidden_states.expected_width)
    if not run_dir.path.local:
        log.info("hidden states need about %.2f TB on %s (an object store: no capacity check)", needed / 1e12,
                 run_dir.path)
        return
    fit = check_free_space(run_dir.path, needed, force=opts.force)
    log.info("%s (about %d tokens a sample)%s", fit["message"], tokens, "" if fit["fits"] else ": forced")


def salvage(committer: Committer, progress) -> None:
    """After a fatal error: commit what is buffered if the disk allows, and say the run failed."""
    progress.close()
    try:
        committer.flush()
        progress.write("failed")
    except StorageError as exc:
        log.error("could not commit the last buffer (%s); it will be regenerated on resume", exc)


@contextlib.contextmanager
def local_fleet(cfg: RunConfig, run_dir: RunDir):
    if cfg.local_fleet is None:
        yield
        return
    from .endpoints.localfleet import LocalFleetProcesses

    log.info("starting %d local llama.cpp servers", cfg.local_fleet.servers)
    with LocalFleetProcesses(cfg.local_fleet, run_dir.local_logs()):
        yield


def init_ray(address: str | None) -> None:
    """Join the cluster at `address` (`auto`: the local head), or start an embedded one on loopback."""
    import os

    if address is not None or "RAY_ADDRESS" in os.environ:
        import ray  # joining a real cluster keeps Ray's own address choice (secure it with Ray's token auth)

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        return
    # An embedded single-machine cluster must not listen on the network: an unauthenticated Ray head runs
    # anyone's code. Ray binds its GCS, raylet and workers to 127.0.0.1 only when it takes the node's address
    # to be the loopback one, which this switch (read when Ray is first imported) makes it do.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the switch was set
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level=logging.WARNING)


def pin_weight_version(run_dir: RunDir, reports) -> str | None:
    """The run is pinned to the weight version the fleet reports; a resume against other weights is drift."""
    from .endpoints.preflight import pinned_weight_version

    version = pinned_weight_version(reports)
    if version is None:
        return None  # not reported (e.g. llama.cpp); a mixed fleet is refused by the preflight
    manifest = run_dir.read_manifest()
    pinned = manifest.get("weight_version")
    if pinned is None:
        run_dir.write_manifest({**manifest, "weight_version": version})
    elif pinned != version:
        raise DriftError(str(run_dir.path), [f"weight_version: {pinned!r} -> {version!r} (reported by the fleet)"])
    return version


class EndpointsFileWatch:
    """Re-reads the endpoints file every `endpoints_file_interval_s`; None between reads or on a bad edit."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.next_read = cfg, 0.0

    def __call__(self):
        now = time.monotonic()
        if now < self.next_read:
            return None
        self.next_read = now + self.cfg.endpoints_file_interval_s
        try:
            fleet = self.cfg.all_endpoints()
            for endpoint in fleet:
                self.cfg.api_key(endpoint)
            return fleet
        except ConfigError as exc:  # a half-edited file must not stop a two-day run
            log.error("endpoints file not applied: %s", exc)
            return None


def run_dispatch(cfg, run_dir: RunDir, builder: RecordBuilder, pending: list[str], committer: Committer,
                 progress, stop) -> str:
    from .dispatch.dispatcher import Dispatcher, client_settings, make_actor_factory
    from .endpoints.preflight import preflight

    api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
    weight_version = pin_weight_version(run_dir, preflight(cfg, api_keys))
    init_ray(cfg.ray.address)
    stop.install()

    def on_outcome(outcome: Outcome, attempts: int) -> None:
        if outcome.kind == DONE:
            committer.add_records(builder.records(outcome, attempts))
            progress.record(True, sum(c.completion_tokens for c in outcome.completions))
        else:
            committer.add_failure(builder.failure(outcome, attempts))
            progress.record(False, 0)
            log.info("prompt %s failed terminally at %s: %s", outcome.prompt_id, outcome.endpoint, outcome.message)
        committer.maybe_flush()

    def on_tick(endpoints: dict[str, dict]) -> None:
        committer.maybe_flush()
        progress.tick(endpoints)

    dispatcher = Dispatcher(cfg, [builder.work_item(pid) for pid in pending], on_outcome, on_tick, stop,
                            make_actor_factory(cfg, client_settings(cfg, weight_version), cfg.api_key,
                                               run_dir.path.uri),
                            fleet_watch=EndpointsFileWatch(cfg) if cfg.endpoints_file else None)
    try:
        dispatcher.run()
    finally:
        dispatcher.shutdown()
    progress.extra = {"requeued": dispatcher.requeued, "actor_restarts": dispatcher.actor_restarts,
                      "hedged": len(dispatcher.hedged), "dropped_duplicates": committer.dropped_duplicates,
                      "fleet_changes": dispatcher.fleet_changes}
    return "interrupted" if stop() else "complete"
