"""Test-only fault plans for the storage seam (`seam.io_seam`), enumerated the way SQLite tests its I/O errors:
run an operation once per I/O call in it, faulting the N-th call, N = 1, 2, ... until a run sees no fault.

An I/O call is one storage primitive (`OPS`). A plan counts the calls it selects (`ops`, a `where`
substring of the path) from 1 while it is armed; call `at` gets `fault`, and with `persistent` every call
after it too (an outage rather than a glitch). Disarmed (the default), the seam costs one global lookup.

A plan can also come from the environment (`REGEN_FAULT`, read when storage.py is imported), for a test that
runs the real `regen` command: `kill@3:link,rename,copy:/data/part-` SIGKILLs the process at the third
publish of a data part.
"""
from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass, field

FAULT_ENV = "REGEN_FAULT"
# open/write/fsync/close/delete a file, publish it (POSIX link or rename; object store: server-side copy),
# fsync its folder, list a folder, stat or read a file, make a folder, take the OS lock
OPS = ("open", "write", "fsync", "close", "link", "rename", "copy", "fsync_dir", "list", "stat", "read",
       "delete", "mkdir", "lock")
ERRNO_FAULTS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES}
# "short": a write(2) that writes only part of its bytes; "interrupt": a second SIGINT arriving at the call;
# "term": a real SIGTERM sent to the process at the call (its handler runs, or it is held), then the call goes on
FAULTS = (*ERRNO_FAULTS, "short", "interrupt", "kill", "term")


@dataclass
class Faults:
    at: int
    fault: str
    persistent: bool = False
    ops: frozenset[str] = frozenset()  # empty: every op
    where: str = ""
    also_at: frozenset[int] = frozenset()  # more call numbers that get the fault (two faults in one run)
    calls: list[tuple[str, str]] = field(default_factory=list)  # every counted call: (op, path)
    fired: list[tuple[str, str]] = field(default_factory=list)  # the calls that got the fault

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {FAULTS}")
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown storage ops {sorted(unknown)}; the ops are {OPS}")

    def hit(self, op: str, path: str) -> bool:
        """Count the call; raise its fault, kill the process, or return True for a short write."""
        if (self.ops and op not in self.ops) or self.where not in path:
            return False
        self.calls.append((op, path))
        n = len(self.calls)
        if not (n == self.at or n in self.also_at or (self.persistent and n > self.at)):
            return False
        self.fired.append((op, path))
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        if self.fault == "interrupt":
            raise KeyboardInterrupt(f"injected at {op} {path}")
        if self.fault == "short":
            return op == "write"
        code = ERRNO_FAULTS[self.fault]
        raise OSError(code, os.strerror(code), path)

    def env_value(self) -> str:
        return f"{self.fault}@{self.at}:{','.join(sorted(self.ops))}:{self.where}"

    @classmethod
    def from_env(cls, value: str | None) -> "Faults | None":
        if not value:
            return None
        head, _, rest = value.partition(":")
        ops, _, where = rest.partition(":")
        fault, _, at = head.partition("@")
        return cls(int(at), fault, ops=frozenset(o for o in ops.split(",") if o), where=where)


def kill_at_data_part(n: int) -> dict[str, str]:
    """The environment that SIGKILLs a `regen` process at its n-th data part's commit point: the part's bytes
    are written and fsynced (uploaded), the part is not yet published under its name."""
    plan = Faults(n, "kill", ops=frozenset({"link", "rename", "copy"}), where="/data/part-")
    return {FAULT_ENV: plan.env_value()}
