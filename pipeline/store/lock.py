"""One driver per run directory.

On POSIX the OS lock (`run.lock`) dies with its process, so a stale lock left by a SIGKILL is taken over at
once; `lock.json` names the holder for the refusal message.

An object store has no lock and pyarrow offers no conditional write, so `lock.json` is a lease: the holder
rewrites it every RENEW_S with an expiry LEASE_S ahead. A new driver refuses a live lease, takes over an
expired one (or one whose holder was on this host and is dead), writes its own and re-reads it after
SETTLE_S to catch a driver that raced it. A holder that finds someone else's lease on renewal has lost the
run: it stops the way SIGTERM stops it, and its Committer commits nothing more (`check()` raises LeaseLost),
since the new holder may be committing the same prompts. So does a holder whose renewals have failed until
less than one renewal period of its lease is left. Leases compare wall clocks across hosts, so clocks must
agree to within a fraction of LEASE_S (NTP does).

Trouble with the store never leaves a lock half-taken: an acquire that fails releases what it took, and a
release always frees the OS lock (a `lock.json` it could not delete is taken over by the next driver).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ..core.errors import LeaseLost, RunLocked, StorageError
from .seam import io_seam, storage_errors
from .storage import Location

log = logging.getLogger("regen")

LEASE_S = 60.0
RENEW_S = 15.0
SETTLE_S = 1.0
CHECK_RETRY_S, CHECK_RETRY_MAX_S = 0.2, 5.0  # check()'s retries of a failed read of lock.json, doubling,
CHECK_BUDGET_S = RENEW_S  # for at most this long (and never past the lease's slack)


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
                 lease_s: float = LEASE_S, renew_s: float = RENEW_S, settle_s: float = SETTLE_S,
                 check_budget_s: float = CHECK_BUDGET_S):
        self.folder: Location = run_dir.path
        self.holder_path = self.folder / "lock.json"
        self.previous_holder: dict[str, Any] | None = None
        self.on_lost, self.lease_s, self.renew_s, self.settle_s = on_lost, lease_s, renew_s, settle_s
        self.check_budget_s = check_budget_s
        self._os_lock: int | None = None  # the descriptor holding the OS lock (POSIX)
        self._me = {"pid": os.getpid(), "host": socket.gethostname(), "owner": uuid.uuid4().hex}
        self._leased = False  # object store: this driver wrote its lease and has not released it
        self._expires = 0.0  # object store: the expiry of the lease this driver last wrote
        self._lost = threading.Event()
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None
        # set by a driver whose new run failed before it wrote anything (a source that fails): the folder it
        # created for the lock is removed on release, so the failure leaves no run directory
        self.remove_folder_on_release = False

    def holder(self) -> dict[str, Any] | None:
        """The holder record; None if there is none (or it is unreadable JSON). StorageError if the store
        cannot be read."""
        try:
            return json.loads(self.holder_path.read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def _write_holder(self) -> None:
        expires = time.time() + self.lease_s
        record = {**self._me, "since": self._me.setdefault("since", _now_iso())}
        if not self.folder.local:
            record["expires"] = expires
        self.holder_path.write_atomic(json.dumps(record).encode())
        self._expires = expires

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

    def _holder_for_message(self) -> dict[str, Any] | None:
        try:
            return self.holder()
        except StorageError:
            return None

    def acquire(self) -> "RunLock":
        """Take the run, or raise RunLocked (someone else has it) or StorageError (the store failed: nothing
        is left held)."""
        self.folder.mkdir()
        if self.folder.local:
            os_lock = take_os_lock(self.folder / "run.lock")
            if os_lock is None:
                raise self._refuse(self._holder_for_message())
            try:
                self.previous_holder = self.holder()  # a holder file under a free lock: a stale lock, taken over
                self._write_holder()
            except BaseException:
                os.close(os_lock)
                raise
            self._os_lock = os_lock
            return self
        current = self.holder()
        if self._live_lease(current):
            left = float(current.get("expires", 0)) - time.time()
            raise self._refuse(current, f"; its lease expires in {left:.0f} s if that driver is gone")
        self.previous_holder = current
        try:
            self._write_holder()
            time.sleep(self.settle_s)
            now = self.holder()
        except BaseException:
            self._drop_own_lease()
            raise
        if (now or {}).get("owner") != self._me["owner"]:
            raise self._refuse(now, "; it took the lease at the same moment")
        self._leased = True
        self._renewer = threading.Thread(target=self._renew, name="regen-lease", daemon=True)
        self._renewer.start()
        return self

    def _renew(self) -> None:
        while not self._stop_renewing.wait(self.renew_s):
            try:
                if not self.renew_once():
                    return
            except Exception:  # noqa: BLE001 - the thread must not die silently; an unrenewed lease runs out
                log.exception("the lease renewal on %s failed", self.folder)

    def renew_once(self) -> bool:
        """Renew the lease; False once it is lost (on_lost has then been called). Store trouble is only
        logged: the lease has LEASE_S of slack, and check() stops commits before it runs out."""
        try:
            holder = self.holder()
            if (holder or {}).get("owner") != self._me["owner"]:
                return self._lose(f"lost the lease on {self.folder} to {holder}")
            self._write_holder()
        except StorageError as exc:
            log.warning("could not renew the lease on %s: %s", self.folder, exc)
        if self._expiring():
            return self._lose(f"the lease on {self.folder} runs out: it could not be renewed")
        return True

    def _expiry_margin(self) -> float:
        return min(self.renew_s, self.lease_s / 4)

    def _expiring(self) -> bool:
        return time.time() >= self._expires - self._expiry_margin()

    def _lose(self, why: str) -> bool:
        log.error("%s: stopping, and committing nothing more", why)
        self._lost.set()
        self.on_lost()
        return False

    def check(self) -> None:
        """Raise LeaseLost unless this driver still holds the run (the Committer asks before each part). On an
        object store lock.json is read again: a driver that raced this one past SETTLE_S, or took over between
        renewals, holds the run from the moment its lease is written (one small GET per part). A read that fails
        is retried for up to `check_budget_s`, within the lease's slack; then nothing is committed either."""
        if self.folder.local:
            if self._os_lock is None:
                raise LeaseLost(f"{self.folder}: this driver does not hold the run lock")
            return
        delay, unread, give_up = CHECK_RETRY_S, None, time.monotonic() + self.check_budget_s
        while self._leased and not self._lost.is_set() and not self._expiring():
            try:
                holder = self.holder()
            except StorageError as exc:
                if unread is None:
                    log.warning("could not read the lease %s (%s); retrying", self.holder_path, exc)
                unread = exc
                if time.monotonic() >= give_up:
                    raise  # the store, not another driver: the run stops resumable
                time.sleep(max(0.0, min(delay, self._expires - self._expiry_margin() - time.time())))
                delay = min(2 * delay, CHECK_RETRY_MAX_S)
                continue
            if (holder or {}).get("owner") == self._me["owner"]:
                return
            log.error("lost the lease on %s to %s: committing nothing more", self.folder, holder)
            self._lost.set()  # the LeaseLost raised here stops the run: no signal needed
            break
        else:
            if unread is not None and not self._lost.is_set():
                raise unread  # the store, not another driver: the run stops resumable
        raise LeaseLost(f"{self.folder}: this driver's lease was taken over or ran out; it commits nothing "
                        "more (the records it held are regenerated by the run's holder)")

    def is_held(self) -> bool:
        if not self.folder.local:
            return self._live_lease(self.holder())
        try:
            probe = take_os_lock(self.folder / "run.lock", create=False)
        except FileNotFoundError:
            return False
        if probe is None:
            return True
        os.close(probe)
        return False

    def _drop_own_lease(self) -> None:
        """Best effort: delete lock.json if it is still this driver's (an unreadable one is left to expire)."""
        try:
            if (self.holder() or {}).get("owner") == self._me["owner"]:
                self.holder_path.unlink()
        except StorageError as exc:
            log.warning("could not remove the lease %s (%s); it expires in %.0f s", self.holder_path, exc,
                        self.lease_s)

    def release(self) -> None:
        """Never raises for store trouble (a run's outcome must not be replaced by it): the OS lock is always
        freed; a lock.json left behind is taken over by the next driver."""
        self._stop_renewing.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._os_lock is not None:
            try:
                self.holder_path.unlink()  # ours: written under the OS lock
            except StorageError as exc:
                log.warning("could not remove %s (%s); the next driver takes it over", self.holder_path, exc)
            finally:
                if self.remove_folder_on_release:
                    self._remove_empty_folder()  # still holding the lock: no other driver is in it
                os.close(self._os_lock)  # closing the descriptor releases the lock
                self._os_lock = None
        elif self._leased:
            self._leased = False
            self._drop_own_lease()
            if self.remove_folder_on_release:
                self._remove_empty_prefix()

    def _remove_empty_prefix(self) -> None:
        """An object store: the marker key that keeps an emptied prefix listed as a folder (pyarrow writes one where
        it deletes the last key under a prefix), so a failed new run leaves nothing a listing shows (the next
        --new-run's number, store/rundir.py). Only if nothing else is under it."""
        try:
            with storage_errors("delete", self.folder):
                if not self.folder.iterdir():
                    io_seam("delete", self.folder.path)
                    self.folder.fs.delete_dir(self.folder.path)
        except StorageError as exc:
            log.warning("could not remove %s (%s)", self.folder, exc)

    def _remove_empty_folder(self) -> None:
        try:
            os.unlink(self.folder / "run.lock")
            os.rmdir(self.folder)  # only if empty: anything else in it is not this driver's to remove
        except OSError as exc:
            log.warning("could not remove %s (%s)", self.folder, exc)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _now_iso() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def take_os_lock(where: Location, create: bool = True) -> int | None:
    """An exclusive flock on a local file: the descriptor holding it (close it to release), or None if
    another open of the file holds it. It dies with its process: a lock left by a SIGKILL is free at once.
    `create=False`: FileNotFoundError if the file is not there (then nobody holds it)."""
    with storage_errors("lock", where):
        io_seam("lock", where.path)
        fd = os.open(where.path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
