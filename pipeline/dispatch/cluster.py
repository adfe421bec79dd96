"""The Ray cluster a run's actors live on, and the fleet as it is now: an embedded single-machine cluster bound
to loopback, or the cluster regen joins; the endpoints file re-read during a run."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable

from ..core.config import RunConfig
from ..core.errors import ConfigError

log = logging.getLogger("regen")

LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's: "0" makes a local cluster take 127.0.0.1


def embedded_ray(address: str | None, environ: dict[str, str]) -> bool:
    """No address anywhere (or Ray's `local`): regen starts its own single-machine cluster."""
    chosen = address or environ.get("RAY_ADDRESS") or None
    return chosen is None or chosen == "local"


def init_ray(address: str | None) -> None:
    """Join the cluster at `address` (`auto`: the local head), or start an embedded one on loopback."""
    if not embedded_ray(address, dict(os.environ)):
        import ray  # joining a real cluster keeps Ray's own address choice (secure it with Ray's token auth)

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        return
    # An embedded single-machine cluster must not listen on the network: an unauthenticated Ray head runs
    # anyone's code. Ray binds its GCS, raylet and workers to 127.0.0.1 only when it takes the node's address
    # to be the loopback one, which this switch (read when Ray is first imported) makes it do. It is put back
    # once the cluster runs, so that nothing started later inherits it.
    os.environ.pop("RAY_ADDRESS", None)  # an empty one would make Ray look for a cluster
    saved = os.environ.get(LOOPBACK_SWITCH)
    os.environ[LOOPBACK_SWITCH] = "0"
    import ray
    from ray._private import ray_constants

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before the switch was set
    try:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            from .reaper import watch

            watch(session_dir())  # its agents would outlive a SIGKILLed driver by a minute (reaper.py)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was
        if saved is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = saved


def session_dir() -> str | None:
    """The directory of the running cluster's logs and sockets (Ray's private API: None if it moved)."""
    try:
        from ray._private import worker

        return worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - the reaper then knows the cluster's processes of its start only
        return None


def join_ray(address: str | None, stop: Any) -> None:
    """init_ray under the run's signal handling: a SIGTERM while Ray starts stops the run (KeyboardInterrupt, as
    before dispatch), and the run's handlers are put back (ray.init replaces the SIGTERM one)."""
    try:
        init_ray(address)
        stop.install()  # inside: a SIGTERM just before it is Ray's handler's SystemExit
    except SystemExit as exc:  # ray.init's own SIGTERM handler, in place while it runs
        if exc.code == signal.SIGTERM:
            raise KeyboardInterrupt from None
        raise


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
