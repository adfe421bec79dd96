"""Sources: a spec (spec.py) names what to read; the readers stream its records, in file order.

A reader yields `RawRecord`s (or a `Reject` for a record that cannot even be parsed); a format adapter
(`adapters.py`) turns a record into raw OpenAI-style messages; validation is `prompt_set.normalise`'s job.
The readers: local files (localfiles.py, jsonarray.py) and datasets (hf.py). This module is the interface the
rest of regen imports.
"""
from __future__ import annotations

from typing import Iterator

from .adapters import source_ref, to_messages  # noqa: F401  (part of this module's interface)
from .hf import read_hf
from .localfiles import read_file, resolve_files  # noqa: F401
from .reading import BOM, ReadStats, cut_or_salvage, first_bytes  # noqa: F401
from .records import RAW_MAX_CHARS, InvalidRecord, RawRecord, Reject, RejectCode  # noqa: F401
from .spec import DEFAULT_FIELD, FORMATS, KINDS, SourceSpec, SourceSpecFile, load_source_spec  # noqa: F401


def read_records(spec: SourceSpec, stats: ReadStats | None = None,
                 stream_hub: bool = False) -> Iterator[RawRecord | Reject]:
    """Stream the records of a source, in file order. Unparseable records come out as `Reject`s; a source that
    cannot be read at all raises SourceError. `stream_hub`: stream a hub dataset rather than download it."""
    stats = stats if stats is not None else ReadStats()
    if spec.kind == "hf":
        yield from read_hf(spec, stats, stream_hub)
        return
    for file in resolve_files(spec):
        yield from read_file(spec, file, spec.kind, stats)
