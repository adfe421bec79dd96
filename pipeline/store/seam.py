"""The one seam every storage primitive passes (`io_seam(op, path)`, which a test arms with a fault plan, faults.py),
and what an OSError becomes: a StorageError naming the file and the reason."""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from ..core.errors import StorageError
from .faults import FAULT_ENV, Faults

_armed: Faults | None = Faults.from_env(os.environ.get(FAULT_ENV))


def arm(plan: Faults | None) -> Faults | None:
    """Test-only: make `plan` the seam's fault plan (None disarms). Returns the plan it replaces."""
    global _armed
    previous, _armed = _armed, plan
    return previous


def io_seam(op: str, path: str) -> bool:
    """The seam every storage primitive passes first. True: make this write a short one."""
    return _armed is not None and _armed.hit(op, path)


@contextlib.contextmanager
def storage_errors(doing: str, where: object) -> Iterator[None]:
    """OSError -> StorageError naming the file and the reason; a missing file stays FileNotFoundError."""
    try:
        yield
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as exc:
        raise storage_error(exc, where, doing=doing) from exc


def storage_error(exc: OSError, where: object, maybe_committed: bool = False, doing: str = "write") -> StorageError:
    reason = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only filesystem"}.get(
        exc.errno, os.strerror(exc.errno) if exc.errno else str(exc)
    )
    error = StorageError(f"cannot {doing} {where}: {reason}. Nothing committed was lost; fix it and rerun to resume.")
    error.maybe_committed = maybe_committed
    return error
