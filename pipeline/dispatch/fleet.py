"""The fleet as a run sees it before dispatch: the preflight, the weight version the run is pinned to, whether
the fleet is deterministic and which engines serve it (all recorded in run.json)."""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..core.config import RunConfig
from ..core.errors import DriftError, PreflightError
from ..store.rundir import RunDir

log = logging.getLogger("regen.fleet")


class FleetDrift(DriftError):
    """The fleet is not the one the run was made by (--new-run starts a successor then)."""


class WeightVersionDrift(FleetDrift):
    """The fleet serves other weights than the run is pinned to."""


class EngineDrift(FleetDrift):
    """The fleet runs another inference engine than the run's earlier sessions."""


# run.json `engines` entry for the sessions of a run made before regen recorded engines (schema_version < 3)
UNRECORDED_ENGINE = {"engine": None, "version": None,
                     "note": "the sessions before regen recorded engines (schema_version < 3): unknown"}


@dataclass(frozen=True)
class FleetFacts:
    """What the preflight found that the dispatch needs."""

    weight_version: str | None  # the version the run is pinned to (None: not reported)
    engines: dict  # each endpoint's engine adapter, by label
    unreachable: set[str]  # endpoints that did not answer: they start with their circuit open
    run_engines: list = field(default_factory=list)  # run.json's known engines: a readmission must run one
    # --start-with-passing: endpoints the preflight refused, with why; they start with their circuit open and join
    # once they pass the preflight again
    refused: dict[str, str] = field(default_factory=dict)
    tools: bool = False  # the prompt set has tools: a readmitted endpoint must return tool_calls too
    # the endpoints the preflight judged: one listed since (the endpoints file) joins through its own preflight
    probed: frozenset[str] | None = None
    images: bool = False  # the prompt set has images: a readmitted endpoint must take them too


class EarlyProbe:
    """The preflight's probes of the fleet, run in a thread while the driver reads the ledger and scans the prompt
    set (a resume at 1M prompts spends seconds there, the probes wait on the endpoints). Only the probing: what the
    preflight decides and records (run.json's pins) is done by `fleet_preflight` once the run knows it has work, and
    a run with nothing pending cancels the probes (`cancel`) and never reads them."""

    def __init__(self, cfg: RunConfig, start_with_passing: bool, tools: bool, images: bool = False,
                 wait: Callable[[threading.Event], None] | None = None):
        """`wait`: how the driver waits for the probes (the run's StopFlag.wait: a signal is obeyed there)."""
        self.wait = wait or _short_waits
        self.loop = asyncio.new_event_loop()
        api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
        self.arguments = (cfg, api_keys, dict(announce=False, start_with_passing=start_with_passing, tools=tools,
                                              images=images))
        self.task: asyncio.Task | None = None
        self.done = threading.Event()
        self.reports: list | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="regen-preflight", daemon=True).start()

    def _run(self) -> None:
        try:
            # imported here, in this thread: the preflight's modules import the OpenAI SDK (0.3 s of CPU, seconds
            # on a loaded machine), which the main thread does not wait for
            from ..endpoints.preflight import preflight_async

            cfg, api_keys, options = self.arguments
            self.task = self.loop.create_task(preflight_async(cfg, api_keys, **options))
            self.reports = self.loop.run_until_complete(self.task)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it (or cancelled it)
            self.error = exc
        finally:
            self.loop.close()
            self.done.set()

    def __call__(self) -> list:
        """The reports, once the probes are done (a PreflightError refusing the fleet is raised here)."""
        self.wait(self.done)
        if self.error is not None:
            raise self.error
        return self.reports

    def cancel(self) -> None:
        if not self.done.is_set():
            try:
                self.loop.call_soon_threadsafe(lambda: self.task is not None and self.task.cancel())
            except RuntimeError:  # the loop closed meanwhile: the probes are done
                pass


def _short_waits(done: threading.Event) -> None:
    while not done.wait(0.1):  # a short wait: a signal still reaches the main thread at once
        pass


def fleet_preflight(cfg: RunConfig, run_dir: RunDir, start_with_passing: bool = False,
                    tools: bool = False, probed: EarlyProbe | None = None, images: bool = False) -> FleetFacts:
    """Probe the fleet before any prompt; pin the run to the weight version it reports (or check it) and
    record whether it is deterministic. `start_with_passing`: endpoints refused for problems of their own are
    held out (FleetFacts.refused) instead of refusing the run; only the passing ones decide the pins. `tools`: the
    prompt set has tools (the fleet must return tool_calls), `images` images (the fleet must take them). `probed`:
    the probes, started early (EarlyProbe)."""
    from ..endpoints.preflight import announce_reports, preflight

    api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
    try:
        if probed is None:
            reports = preflight(cfg, api_keys, start_with_passing=start_with_passing, tools=tools, images=images)
        else:
            reports = probed()
            announce_reports(reports, cfg, start_with_passing)
    except PreflightError as refused:
        log_verdicts(getattr(refused, "reports", []), getattr(refused, "fleet_problems", []))
        raise
    log_verdicts(reports, [])
    check_engines(run_dir, reports)
    weight_version = pin_weight_version(run_dir, reports)
    record_determinism(run_dir, reports)
    engines = record_engines(run_dir, reports)
    return FleetFacts(weight_version, {r.label: r.engine for r in reports if r.engine is not None},
                      {r.label for r in reports if not r.reachable}, [e for e in engines if e.get("engine")],
                      {r.label: "; ".join(r.problems) for r in reports if r.problems},
                      tools, frozenset(r.label for r in reports), images)


def log_verdicts(reports, fleet_problems: list[str]) -> None:
    """Each endpoint's preflight verdict, into the run's log (the console has the refusal or the warnings)."""
    for r in reports:
        if r.problems:
            verdict = "REFUSED: " + "; ".join(r.problems)
        elif not r.reachable:
            verdict = f"unreachable ({r.down_reason}); it gets work once it answers and passes the preflight"
        else:
            engine = f"{r.engine.engine} {r.engine.version or '(version unknown)'}" if r.engine else "engine unknown"
            verdict = (f"ok: {engine}, weight version {r.weight_version or 'not reported'}, context "
                       f"{r.context or 'unknown'}")
        level = logging.INFO if r.ok else logging.WARNING
        log.log(level, "preflight: endpoint %s (%s) %s", r.label, r.url, verdict, extra={"file_only": True})
    for problem in fleet_problems:
        log.warning("preflight: fleet REFUSED: %s", problem, extra={"file_only": True})


def check_fleet_first(cfg: RunConfig, run_dir: RunDir, start_with_passing: bool = False) -> None:
    """--new-run about to resume a run pinned to weights or made by a known engine: the fleet's are checked
    before anything of that run changes (run.json, the prompt set), so other weights or another engine start a
    successor and leave the old run as it was."""
    from ..endpoints.localfleet import local_fleet
    from ..endpoints.preflight import pinned_weight_version, preflight

    manifest = run_dir.read_manifest()
    pinned = manifest.get("weight_version")
    if pinned is None and not _known_engines(manifest):
        return
    with local_fleet(cfg.local_fleet, run_dir.local_logs()):
        reports = preflight(cfg, {e.label: cfg.api_key(e) for e in cfg.all_endpoints()},
                            start_with_passing=start_with_passing)
    check_engines(run_dir, reports)
    version = pinned_weight_version(reports)
    if pinned is not None and version is not None and version != pinned:
        raise WeightVersionDrift(str(run_dir.path),
                                 [f"weight_version: {pinned!r} -> {version!r} (reported by the fleet)"])


def _known_engines(manifest: dict) -> set[str]:
    return {e["engine"] for e in manifest.get("engines") or [] if isinstance(e, dict) and e.get("engine")}


def check_engines(run_dir: RunDir, reports) -> None:
    """A resume on another engine is drift: run.json's `engines` decide (its token ids, reasoning split and
    sampling differ). A run whose earlier sessions recorded no engine is accepted, with a note."""
    from ..endpoints.preflight import fleet_engines

    manifest = run_dir.read_manifest()
    known = _known_engines(manifest)
    now = sorted({e["engine"] for e in fleet_engines(reports)})
    if not known:
        if _unrecorded(run_dir, manifest):
            log.warning("the earlier sessions of %s did not record their inference engine (regen before schema 3): "
                        "regen cannot check that this fleet's (%s) made its records; run.json says they are unknown",
                        run_dir.path, ", ".join(now))
        return
    if set(now) - known:
        raise EngineDrift(str(run_dir.path), [f"engines: {sorted(known)} -> {now} (reported by the fleet)"])


def _unrecorded(run_dir: RunDir, manifest: dict) -> bool:
    """Records or failures exist but run.json names no engine: they were made before regen recorded it (a
    session of today's regen records the engines at its preflight, before any record)."""
    if "engines" in manifest:
        return False
    return bool(run_dir.parts(run_dir.data) or run_dir.parts(run_dir.failures))  # a listing: no ledger read


def pin_weight_version(run_dir: RunDir, reports) -> str | None:
    """The run is pinned to the weight version the fleet reports; a resume against other weights is drift."""
    from ..endpoints.preflight import pinned_weight_version

    version = pinned_weight_version(reports)
    if version is None:
        return None  # not reported (e.g. llama.cpp); a mixed fleet is refused by the preflight
    manifest = run_dir.read_manifest()
    pinned = manifest.get("weight_version")
    if pinned is None:
        run_dir.write_manifest({**manifest, "weight_version": version})
    elif pinned != version:
        raise WeightVersionDrift(str(run_dir.path),
                                 [f"weight_version: {pinned!r} -> {version!r} (reported by the fleet)"])
    return version


def record_determinism(run_dir: RunDir, reports) -> None:
    """run.json says whether every session of the run had a deterministic fleet (False once any had not)."""
    from ..endpoints.preflight import fleet_deterministic

    manifest = run_dir.read_manifest()
    now = fleet_deterministic(reports)
    before = manifest.get("deterministic", now)
    merged = False if False in (before, now) else (True if before is True and now is True else None)
    if "deterministic" not in manifest or merged != before:
        run_dir.write_manifest({**manifest, "deterministic": merged})


def record_engines(run_dir: RunDir, reports) -> list[dict]:
    """run.json names every engine (and version) that served the run, across its sessions, in order; the
    sessions of a run made before regen recorded engines are one entry of unknown engine. Returns the list."""
    from ..endpoints.preflight import fleet_engines

    manifest = run_dir.read_manifest()
    known = list(manifest.get("engines") or [])
    if not known and _unrecorded(run_dir, manifest):
        known = [dict(UNRECORDED_ENGINE)]
    added = [e for e in fleet_engines(reports) if e not in [{"engine": k.get("engine"), "version": k.get("version")}
                                                            for k in known]]
    if added or known != list(manifest.get("engines") or []):
        run_dir.write_manifest({**manifest, "engines": known + added})
    return known + added
