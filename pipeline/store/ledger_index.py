"""A derived index of the ledger: the unit ids of many committed parts in one file, so that a resume reads a few
segments instead of every part's footer and id column (a million prompts in 1,760 parts: 2.1 s of a resume's
first 5, in a run sharing two cores with Ray's start).

Never the truth (DESIGN invariants 3 and 4): the parts are. A segment, `RUN/index/<folder>/segment-*.parquet`,
names each part it covers with its size and modification time (from a listing); it is used only when every one of
those parts is there with that size and time and no segment read before it covers one of them. Otherwise it is passed over and its parts are read one by one. A
segment is written whole under a temporary name, then renamed (storage.Location.write_atomic): a SIGKILL at any
point leaves either no segment or a whole one, and the parts it would have covered are read as before.
Segments are written only by the committer, after a commit, so a refused command never writes one. Deleting
`index/` is always safe: the next resume reads every part and writes the segments again."""
from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.errors import StorageError
from ..core.work import SAMPLE_SEP
from .storage import Location

log = logging.getLogger("regen")

INDEX_DIR = "index"
SEGMENT_RE = re.compile(r"^segment-(\d{6})-(\d{6})-[0-9a-f]{8}\.parquet$")
PARTS_KEY = b"regen.index.parts"  # the footer's list of [part name, size in bytes, mtime in ns] it covers
SEGMENT_PARTS = 128  # parts a segment covers when the committer writes one (a 128-part tail is read part by part)
UNIT_ID = "unit_id"


@dataclass
class PartUnits:
    """One part as the index knows it: its name and the unit ids of its rows (one per row)."""

    name: str
    ids: pa.Array


@dataclass
class LedgerRead:
    """A folder's ledger: the unit ids of all its parts, and the parts no valid segment covered (read one by one:
    what the committer's next segment starts from)."""

    ids: pa.Array
    unindexed: list[PartUnits] = field(default_factory=list)
    segments: int = 0  # segments used
    covered: int = 0  # parts they cover
    passed_over: list[str] = field(default_factory=list)  # segments not used, each with why


def units_of(table: pa.Table) -> pa.Array:
    """The unit id of each row of a records or failures table: a record of sample j > 0 (`sample_index`) is
    `<prompt_id>#s<j>`; a failure row's prompt_id is its unit's id; a record whose sample_index is null or 0 is its
    prompt's sample 0, the prompt's own id. No Python object per row."""
    ids = table.column("prompt_id").combine_chunks()
    if "sample_index" in table.column_names:
        later = pc.fill_null(pc.greater(table.column("sample_index"), 0), False).combine_chunks()
        if pc.any(later).as_py():
            suffixed = pc.binary_join_element_wise(
                ids, pc.cast(table.column("sample_index"), pa.string()).combine_chunks(), SAMPLE_SEP)
            ids = pc.if_else(later, suffixed, ids)
    return ids


def index_folder(folder: Location) -> Location:
    return folder.parent / INDEX_DIR / folder.name


def read_ledger(folder: Location, parts: list[Location], read_parts: Callable[[list[Location]], list[pa.Array]],
                id_type: pa.DataType = pa.string()) -> LedgerRead:
    """The unit ids of `parts` (the folder's listing): from the valid segments, and from `read_parts` (one array
    of unit ids per part, in order) for the parts they do not cover. Nothing in the index can fail the read: an
    index that cannot be read is passed over, and every part is read."""
    if not parts:
        return LedgerRead(pa.array([], id_type))
    wanted = {part.name for part in parts}
    covered: set[str] = set()
    chunks: list[pa.Array] = []
    used, passed_over = 0, []
    try:
        segments, stamps = _segments(folder), folder.entry_stamps()
    except (StorageError, OSError) as exc:
        segments, stamps = [], {}
        passed_over.append(f"{index_folder(folder)}: not readable ({exc})")
    for segment in segments:
        try:
            listed = _covered_parts(segment)
            why = _invalid(listed, stamps, wanted, covered)
            if why:
                passed_over.append(f"{segment.name}: {why}")
                continue
            ids = segment.read_parquet([UNIT_ID]).column(0).combine_chunks()
            chunks.append(ids.cast(id_type) if ids.type != id_type else ids)
        except _UNREADABLE as exc:
            passed_over.append(f"{segment.name}: not readable ({type(exc).__name__}: {exc})")
            continue
        covered.update(name for name, _, _ in listed)
        used += 1
    rest = [part for part in parts if part.name not in covered]
    unindexed = [PartUnits(part.name, ids) for part, ids in zip(rest, read_parts(rest) if rest else [])]
    chunks.extend(p.ids.cast(id_type) if p.ids.type != id_type else p.ids for p in unindexed)
    ids = pa.concat_arrays(chunks) if chunks else pa.array([], id_type)
    return LedgerRead(ids, unindexed, used, len(covered), passed_over)


# what a file named like a segment may raise when it is not one (torn, another footer, another column)
_UNREADABLE = (StorageError, OSError, ValueError, TypeError, KeyError, IndexError, pa.ArrowException)
Stamp = tuple[int, "int | None"]  # a part's size in bytes and its modification time (ns), from a listing


def _segments(folder: Location) -> list[Location]:
    where = index_folder(folder)
    return sorted(p for p in where.iterdir() if SEGMENT_RE.match(p.name))


def _covered_parts(segment: Location) -> list[tuple[str, int, int | None]]:
    metadata = segment.parquet_schema().metadata or {}
    if PARTS_KEY not in metadata:
        raise ValueError("no list of parts in its footer")
    listed = orjson.loads(metadata[PARTS_KEY])
    if not isinstance(listed, list) or not all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], int)
            and (e[2] is None or isinstance(e[2], int)) for e in listed):
        raise ValueError("its list of parts is not [name, size, mtime] entries")
    return [(name, size, mtime) for name, size, mtime in listed]


def _invalid(listed: list[tuple[str, int, int | None]], stamps: dict[str, Stamp], wanted: set[str],
             covered: set[str]) -> str:
    """Why the segment cannot stand for its parts: one is gone, or was rewritten (another size or mtime)."""
    for name, size, mtime in listed:
        if name not in wanted:
            return f"its part {name} is not in the folder"
        if stamps.get(name) != (size, mtime):
            return f"its part {name} is {stamps.get(name)} (size, mtime), it indexed {(size, mtime)}"
        if name in covered:
            return f"its part {name} is covered by an earlier segment"
    return ""


def write_segment(folder: Location, parts: list[PartUnits], stamps: dict[str, Stamp] | None = None) -> Location:
    """One segment covering `parts` (ascending part names), written whole or not at all. `stamps`: a listing of
    the folder (taken here if not given), so that a resume's listing compares like with like."""
    stamps = folder.entry_stamps() if stamps is None else stamps
    missing = [p.name for p in parts if p.name not in stamps]
    if missing:
        raise ValueError(f"part {missing[0]} is not in {folder}")
    numbers = [int(p.name.split("-")[1]) for p in parts]
    where = index_folder(folder)
    where.mkdir()
    path = where / f"segment-{min(numbers):06d}-{max(numbers):06d}-{uuid.uuid4().hex[:8]}.parquet"
    ids = pa.concat_arrays([p.ids.cast(pa.string()) if p.ids.type != pa.string() else p.ids for p in parts])
    table = pa.table({UNIT_ID: ids}).replace_schema_metadata(
        {PARTS_KEY: orjson.dumps([[p.name, *stamps[p.name]] for p in parts])})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    path.write_atomic(sink.getvalue().to_pybytes())
    return path


class SegmentWriter:
    """The committer's side: the parts committed (after those a resume read one by one) gather until there are
    `every` of them, then become one segment (a resume's backlog: several, at its first commit). A failed write
    is logged and changes nothing else: those parts are read one by one, as without an index."""

    def __init__(self, folder: Location, carried: list[PartUnits] | None = None, every: int = SEGMENT_PARTS):
        self.folder, self.every = folder, every
        carried = list(carried or [])
        # the tail left waiting after the backlog's whole segments: copied, so that the resume's one large array of
        # unit ids is freed once those segments are written
        whole = len(carried) - len(carried) % every
        self.waiting = carried[:whole] + [PartUnits(p.name, pa.concat_arrays([p.ids])) for p in carried[whole:]]
        self.written = 0

    def committed(self, part: Location, table: pa.Table) -> None:
        """`table`: the part's rows, as committed."""
        self.waiting.append(PartUnits(part.name, units_of(table)))
        if len(self.waiting) < self.every:
            return
        try:
            stamps = self.folder.entry_stamps()
            while len(self.waiting) >= self.every:
                path = write_segment(self.folder, self.waiting[:self.every], stamps)
                log.info("ledger index: %s covers %d parts", path.name, self.every, extra={"file_only": True})
                self.waiting, self.written = self.waiting[self.every:], self.written + 1
        except _UNREADABLE as exc:  # derived: the commit stands without it
            log.warning("ledger index: could not write a segment for %d parts of %s (%s); a resume reads them "
                        "one by one", len(self.waiting), self.folder, exc)
            self.waiting = []
