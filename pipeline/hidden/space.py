"""The capture's free-space check: the bytes its hidden parts will take, against the disk that holds them."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .errors import InsufficientStorage


def estimate_bytes(n_samples: int, tokens_per_sample: int, width: int) -> int:
    """Bytes the hidden parts will take: samples x tokens x (2 x width bf16 + 4 for the token id).
    Parquet's own overhead is a few hundred bytes per sample (measured ratio ~1.000x), left out."""
    return int(n_samples) * int(tokens_per_sample) * (2 * int(width) + 4)


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human_bytes(n: float) -> str:
    """Decimal units, about 3 significant digits: 612 kB, 7.74 TB (a small need is never "0.00 TB")."""
    unit = "B"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            break
        n /= 1000
    digits = 0 if unit == "B" or abs(n) >= 100 else (1 if abs(n) >= 10 else 2)
    return f"{n:.{digits}f} {unit}"


def check_free_space(path: str | Path, needed_bytes: int, force: bool, advice: str) -> dict[str, Any]:
    """Refuse (InsufficientStorage) when `needed_bytes` exceed the free space of the filesystem holding
    `path` (or its nearest existing parent), unless `force`. `advice`: what the caller's user can change.
    Returns {needed_bytes, free_bytes, fits, message}."""
    where = _existing(Path(path))
    free = shutil.disk_usage(where).free
    fits = needed_bytes <= free
    message = (f"hidden states need about {human_bytes(needed_bytes)} ({needed_bytes:,} bytes); "
               f"{human_bytes(free)} free at {where}")
    if not fits and not force:
        raise InsufficientStorage(f"{message}. {advice}, or pass --force to start anyway.")
    return {"needed_bytes": int(needed_bytes), "free_bytes": int(free), "fits": fits, "message": message}
