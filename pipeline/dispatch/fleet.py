"""The fleet as a run sees it before dispatch: the preflight, the weight version the run is pinned to, whether
the fleet is deterministic and which engines serve it (all recorded in run.json)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.config import RunConfig
from ..core.errors import DriftError
from ..store.rundir import RunDir


class WeightVersionDrift(DriftError):
    """The fleet serves other weights than the run is pinned to (--new-run starts a successor then)."""


@dataclass(frozen=True)
class FleetFacts:
    """What the preflight found that the dispatch needs."""

    weight_version: str | None  # the version the run is pinned to (None: not reported)
    engines: dict  # each endpoint's engine adapter, by label
    unreachable: set[str]  # endpoints that did not answer: they start with their circuit open
    longest_prompt: list | None = None  # checked against chunked_prefill_size here and at every readmission


def fleet_preflight(cfg: RunConfig, run_dir: RunDir, longest: list | None = None) -> FleetFacts:
    """Probe the fleet before any prompt; pin the run to the weight version it reports (or check it) and
    record whether it is deterministic."""
    from ..endpoints.preflight import preflight

    api_keys = {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}
    reports = preflight(cfg, api_keys, longest_prompt=longest)
    weight_version = pin_weight_version(run_dir, reports)
    record_determinism(run_dir, reports)
    record_engines(run_dir, reports)
    return FleetFacts(weight_version, {r.label: r.engine for r in reports if r.engine is not None},
                      {r.label for r in reports if not r.reachable}, longest)


def check_weights_first(cfg: RunConfig, run_dir: RunDir) -> None:
    """--new-run about to resume a run pinned to weights: the fleet's are checked before anything of that run
    changes (run.json, the prompt set), so other weights start a successor and leave the old run as it was."""
    from ..endpoints.localfleet import local_fleet
    from ..endpoints.preflight import pinned_weight_version, preflight

    pinned = run_dir.read_manifest().get("weight_version")
    if pinned is None:
        return
    with local_fleet(cfg.local_fleet, run_dir.local_logs()):
        version = pinned_weight_version(preflight(cfg, {e.label: cfg.api_key(e) for e in cfg.all_endpoints()}))
    if version is not None and version != pinned:
        raise WeightVersionDrift(str(run_dir.path),
                                 [f"weight_version: {pinned!r} -> {version!r} (reported by the fleet)"])


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


def record_engines(run_dir: RunDir, reports) -> None:
    """run.json names every engine (and version) that served the run, across its sessions, in order."""
    from ..endpoints.preflight import fleet_engines

    manifest = run_dir.read_manifest()
    known = list(manifest.get("engines") or [])
    added = [e for e in fleet_engines(reports) if e not in known]
    if added:
        run_dir.write_manifest({**manifest, "engines": known + added})
