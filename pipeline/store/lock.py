"""One driver per run directory.

On POSIX the OS lock (`run.lock`) dies with its process, so a stale lock left by a SIGKILL is taken over at
once; `lock.json` names the holder for the refusal message.

An object store has no lock and pyarrow offers no conditional write, so `lock.json` is a lease: the holder
rewrites it every RENEW_S with an expiry LEASE_S ahead. A new driver refuses a live lease, takes over an
expired one (or one whose holder was on this host and is dead), writes its own and re-reads it after
SETTLE_S to catch a driver that raced it. A holder that finds someone else's lease on renewal has lost the
run and stops the way SIGTERM stops it: commits its buffer, exits, and a rerun resumes. Leases compare
wall clocks across hosts, so clocks must agree to within a fraction of LEASE_S (NTP does).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Callable

import filelock

from ..core.errors import RunLocked, StorageError
from .storage import Location

log = logging.getLogger("regen")

LEASE_S = 60.0
RENEW_S = 15.0
SETTLE_S = 1.0


def _stop_like_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, run_dir, on_lost: Callable[[], None] = _stop_like_sigterm,
                 lease_s: float = LEASE_S, renew_s: float = RENEW_S, settle_s: float = SETTLE_S):
        self.folder: Location = run_dir.path
        self.holder_path = self.folder / "lock.json"
        self.previous_holder: dict[str, Any] | None = None
        self.on_lost, self.lease_s, self.renew_s, self.settle_s = on_lost, lease_s, renew_s, settle_s
        self._os_lock = filelock.FileLock(os.fspath(self.folder / "run.lock"), timeout=0) if self.folder.local else None
        self._me = {"pid": os.getpid(), "host": socket.gethostname(), "owner": uuid.uuid4().hex}
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.holder_path.read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def _write_holder(self) -> None:
        record = {**self._me, "since": self._me.setdefault("since", _now_iso())}
        if not self.folder.local:
            record["expires"] = time.time() + self.lease_s
        self.holder_path.write_atomic(json.dumps(record).encode())

    def _live_lease(self, holder: dict[str, Any] | None) -> bool:
        """Someone else's lease that still binds us."""
        if not holder or holder.get("owner") == self._me["owner"]:
            return False
        if holder.get("host") == self._me["host"] and not _pid_alive(int(holder.get("pid", 0))):
            return False
        return float(holder.get("expires", 0)) > time.time()

    def _refuse(self, holder: dict[str, Any] | None, extra: str = "") -> RunLocked:
        holder = holder or {}
        return RunLocked(f"{self.folder} is in use by another regen driver (pid {holder.get('pid', '?')} on "
                         f"{holder.get('host', '?')}, since {holder.get('since', '?')}){extra}")

    def acquire(self) -> "RunLock":
        self.folder.mkdir()
        if self._os_lock is not None:
            try:
                self._os_lock.acquire()
            except filelock.Timeout:
                raise self._refuse(self.holder()) from None
            self.previous_holder = self.holder()  # a holder file under a free lock: a stale lock, taken over
            self._write_holder()
            return self
        current = self.holder()
        if self._live_lease(current):
            left = float(current.get("expires", 0)) - time.time()
            raise self._refuse(current, f"; its lease expires in {left:.0f} s if that driver is gone")
        self.previous_holder = current
        self._write_holder()
        time.sleep(self.settle_s)
        if (self.holder() or {}).get("owner") != self._me["owner"]:
            raise self._refuse(self.holder(), "; it took the lease at the same moment")
        self._renewer = threading.Thread(target=self._renew, name="regen-lease", daemon=True)
        self._renewer.start()
        return self

    def _renew(self) -> None:
        while not self._stop_renewing.wait(self.renew_s):
            try:
                if (self.holder() or {}).get("owner") != self._me["owner"]:
                    log.error("lost the lease on %s to %s: stopping", self.folder, self.holder())
                    self.on_lost()
                    return
                self._write_holder()
            except (OSError, StorageError) as exc:  # transient store trouble: the lease has LEASE_S of slack
                log.warning("could not renew the lease on %s: %s", self.folder, exc)

    def is_held(self) -> bool:
        if self._os_lock is None:
            return self._live_lease(self.holder())
        probe = filelock.FileLock(os.fspath(self.folder / "run.lock"), timeout=0)
        try:
            probe.acquire()
        except filelock.Timeout:
            return True
        probe.release()
        return False

    def release(self) -> None:
        self._stop_renewing.set()
        if self._renewer is not None:
            self._renewer.join()
        if (self.holder() or {}).get("owner") == self._me["owner"]:
            self.holder_path.unlink()
        if self._os_lock is not None:
            self._os_lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _now_iso() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")
