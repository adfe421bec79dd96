"""What the readers of a source share: the statistics of what they saw, and the handling of a file cut short."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import Cut, TruncatedSource
from .spec import SourceSpec

BOM = b"\xef\xbb\xbf"


@dataclass
class ReadStats:
    """What the readers of one source saw, beyond the records themselves."""

    containers: dict[str, str] = field(default_factory=dict)  # file or dataset -> what it turned out to be
    cuts: list[Cut] = field(default_factory=list)  # salvaged files: where each was cut
    nul_bytes_removed: int = 0  # raw NUL bytes taken out of JSON text (JSON allows none outside escapes)
    file: Path | None = None  # the local data file being read: the default image_root is its folder


def first_bytes(file: Path, n: int = 4096) -> bytes:
    """The start of a file without its BOM and leading whitespace: enough to tell a JSON array from JSON Lines."""
    with file.open("rb") as fh:
        head = fh.read(n)
    return head.removeprefix(BOM).lstrip()


def cut_or_salvage(spec: SourceSpec, cut: Cut, stats: ReadStats) -> None:
    """A file cut short: an error unless the spec salvages what came before the cut."""
    if not spec.salvage:
        raise TruncatedSource(spec.name, cut.file, cut)
    stats.cuts.append(cut)
