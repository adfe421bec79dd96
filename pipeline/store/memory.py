"""Which allocator Arrow uses in regen's own process.

pyarrow's default pool is mimalloc. With its default purge (decommit freed pages, fault them back on reuse) a
resume's ledger read and pending scan took twice as long as with jemalloc or the system allocator: 5.1 s against
2.3 s for a million prompts, most of it in the kernel (BENCHMARKS.md, resume). regen takes jemalloc, which Arrow
configures to hand freed pages back within a second (a two-day driver's memory stays flat), else the system
allocator. A pool the user names in ARROW_DEFAULT_MEMORY_POOL (Arrow's own variable) is left as it is."""
from __future__ import annotations

import os

POOL_VARIABLE = "ARROW_DEFAULT_MEMORY_POOL"


def choose_arrow_pool() -> str:
    """Set the process's default Arrow pool (before any large Arrow allocation); returns its name and why."""
    import pyarrow as pa

    if os.environ.get(POOL_VARIABLE):
        return f"{pa.default_memory_pool().backend_name} (from {POOL_VARIABLE})"
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc (some platforms' wheels)
        pool = pa.system_memory_pool()
    pa.set_memory_pool(pool)
    return pool.backend_name
