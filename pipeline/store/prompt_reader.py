"""The stored prompt set, read by position a row group at a time: the driver never holds it whole.

A run pins one version of the prompt set (prompts-NNNNNN.parquet; a refresh adds a newer one) and reads only that
file. What the driver keeps per pending prompt is a `PendingPrompt`: its id, its row in the file and its routing
key (the `route_key` column, written when the set is staged; a set without it, or staged for another
`prefix_affinity_chars`, gets it computed from the messages in one streaming pass). A prompt's messages are read
from its row group when it is handed out (`rows`), through a small cache of row groups, and travel with the
in-flight work item until its record is built (records.py).

Every read passes the storage seam and is retried (a glitch of an object store is not the end of a run); what
still fails is a StorageError naming the file, and the run stops resumable.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, NamedTuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.errors import StorageError
from ..core.work import SAMPLE_SEP, affinity_key, split_unit, unit_id
from ..prompts.tool_calls import message_from_row
from .seam import io_seam, storage_errors
from .storage import Location

log = logging.getLogger("regen")

ROUTE_KEY = "route_key"
IMAGES = "images"  # the prompt set's count of each prompt's image parts (sets staged before issue 28 lack it)
ROUTE_CHARS = b"regen.route_key_chars"  # schema metadata: the prefix_affinity_chars the column was computed with
READ_ATTEMPTS = 4
READ_RETRY_S = 0.5  # doubled after each failed attempt
CACHED_GROUPS = 32  # row groups held at once (each at most 1024 prompts or ~1 MB of text): ~32 MB
PENDING_CHUNK = 1 << 16  # pending units made into Python objects at a time by the scan
# "tools", "source_ref": when the set has the column (every set has had source_ref)
ROW_COLUMNS = ("prompt_id", "source", "messages", "reference", "tools", "source_ref")


Units = Union[Collection[str], pa.Array, pa.ChunkedArray]  # unit ids: a set, or the ledger as Arrow (RunDir.unit_ids)


def _arrow_units(units: Units, type_: pa.DataType) -> pa.Array:
    if isinstance(units, pa.ChunkedArray):
        units = units.combine_chunks()
    if not isinstance(units, pa.Array):
        units = pa.array(list(units), pa.string())
    return units.cast(type_) if units.type != type_ else units


class PendingPrompt(NamedTuple):
    """What the driver holds for a unit of work (a sample of a prompt) not yet handed out: a few dozen bytes, never
    its messages. The samples of one prompt share its row and routing key (the same endpoint: prefix-cache hits)."""

    prompt_id: str  # the unit's id (core/work.py unit_id): the prompt's own id for sample 0, `<id>#s<j>` for j > 0
    position: int  # its row in the pinned prompt-set file
    affinity: int  # its routing key (core/work.py affinity_key; dispatch/routing.py)


@dataclass(frozen=True)
class PromptRow:
    """One prompt as the prompt set stores it, read when it is handed out."""

    prompt_id: str
    position: int
    source: str | None
    messages: list[dict[str, Any]]  # normalised (prompts/tool_calls.py message_from_row)
    reference: str | None
    tools: str | None  # canonical JSON of the tools list, as stored; None: the prompt has none
    affinity: int
    source_ref: str | None = None  # the source's own id of the prompt (records schema 6 carry it)


@dataclass
class PendingScan:
    """Counts of units: samples of prompts (prompts x samples_per_prompt; with k = 1, prompts)."""

    pending: list[PendingPrompt]
    total: int  # samples of the set's prompts
    done: int  # of them committed
    failed: int  # of them failed terminally (and not committed)
    waiting: int = 0  # pending samples (also when they are only counted)
    # of them, the samples of prompts with images (the set's `images` column; a set without it has none)
    image_total: int = 0
    image_done: int = 0
    image_waiting: int = 0
    # by ledger folder name, the parts no index segment covered (ledger_index.py): the committer's first segments
    unindexed: dict[str, list[Any]] = field(default_factory=dict)


def route_schema(table_schema: pa.Schema, affinity_chars: int) -> pa.Schema:
    """The prompt-set schema as staged: it records the prefix length its `route_key` column was computed with."""
    return table_schema.with_metadata({**(table_schema.metadata or {}), ROUTE_CHARS: str(affinity_chars).encode()})


class PromptSetReader:
    """One pinned prompt-set file. `max_rows_held` is the most rows of messages its cache has held at once."""

    def __init__(self, where: Location, cached_groups: int = CACHED_GROUPS):
        self.where = where
        self.cached_groups = max(1, cached_groups)
        self._file: pq.ParquetFile | None = None
        meta = self._retry("open", lambda f: f.metadata)
        self.schema: pa.Schema = self._retry("open", lambda f: f.schema_arrow)
        self.group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.starts = [0]
        for n in self.group_rows:
            self.starts.append(self.starts[-1] + n)
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self.groups_read = 0
        self.max_rows_held = 0

    @property
    def num_rows(self) -> int:
        return self.starts[-1]

    @property
    def name(self) -> str:
        return self.where.name

    def route_key_chars(self) -> int | None:
        if ROUTE_KEY not in self.schema.names:
            return None
        chars = (self.schema.metadata or {}).get(ROUTE_CHARS)
        return int(chars) if chars is not None else None

    # --- reading, retried ---------------------------------------------------------------------------
    def _open(self) -> pq.ParquetFile:
        if self._file is None:
            io_seam("read", self.where.path)
            self._file = pq.ParquetFile(self.where.fs.open_input_file(self.where.path))
        return self._file

    def _retry(self, what: str, read):
        """`read(parquet_file)`, retried with backoff on a storage error (the file is opened again). A missing
        file is not retried: a pinned version that vanished was deleted."""
        delay = READ_RETRY_S
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                with storage_errors("read", self.where):
                    return read(self._open())
            except StorageError as exc:
                self._file = None
                if attempt == READ_ATTEMPTS:
                    raise
                log.warning("reading the prompt set %s failed (%s: %s); retry %d of %d in %.1f s", self.where,
                            what, exc, attempt, READ_ATTEMPTS - 1, delay)
                time.sleep(delay)
                delay *= 2

    def read_group(self, group: int, columns: list[str]) -> pa.Table:
        def read(f: pq.ParquetFile) -> pa.Table:
            io_seam("read", self.where.path)
            return f.read_row_group(group, columns=columns)

        self.groups_read += 1
        return self._retry(f"row group {group}", read)

    def scan(self, columns: list[str]) -> Iterator[tuple[int, pa.Table]]:
        """(first position, table) of each row group in file order; one group in memory at a time."""
        present = [c for c in columns if c in self.schema.names]
        for group, start in enumerate(self.starts[:-1]):
            yield start, self.read_group(group, present)

    def has_tools(self) -> bool:
        """Some prompt has tools (a set written before tool calls has no such column: none has)."""
        return self.tool_prompts(first=True) > 0

    def tool_prompts(self, first: bool = False) -> int:
        """The prompts that have tools (`first`: stop at the first row group holding one). Told by the footer's
        statistics of each row group, read only where they are missing."""
        if "tools" not in self.schema.names:
            return 0
        meta = self._retry("footer", lambda f: f.metadata)
        found = 0
        for group in range(meta.num_row_groups):
            row_group = meta.row_group(group)
            leaf = next(row_group.column(k) for k in range(row_group.num_columns)
                        if row_group.column(k).path_in_schema == "tools")
            stats = leaf.statistics  # the footer's null count: no column read, where the writer kept it
            if stats is not None and stats.has_null_count:
                found += row_group.num_rows - stats.null_count
            else:
                found += row_group.num_rows - self.read_group(group, ["tools"]).column(0).null_count
            if first and found:
                break
        return found

    def read_small_columns(self, columns: list[str]) -> pa.Table:
        """Whole columns of a few bytes a prompt (ids, routing keys, image counts) of every row group, in file order,
        in one read: Arrow decodes the groups on its threads (a million prompts: 0.4 s against 0.65 s a group at a
        time). A column the set lacks is left out."""
        present = [c for c in columns if c in self.schema.names]

        def read(f: pq.ParquetFile) -> pa.Table:
            io_seam("read", self.where.path)
            return f.read(columns=present, use_threads=True)

        self.groups_read += len(self.group_rows)
        return self._retry("columns " + ", ".join(present), read)

    def id_array(self) -> pa.Array:
        """The prompt ids, in file order, as one Arrow array (a few bytes a prompt; no Python object per prompt)."""
        chunks = [table.column(0).combine_chunks() for _, table in self.scan(["prompt_id"])]
        return pa.concat_arrays(chunks) if chunks else pa.array([], pa.string())

    def refreshed_from(self, older: "PromptSetReader") -> tuple[int, int, list[str]]:
        """Against an older version of the set: (prompts added, prompts vanished, the first 20 vanished ids, sorted),
        computed in Arrow."""
        old, new = older.id_array(), self.id_array()
        new = new.cast(old.type) if new.type != old.type else new
        vanished = old.filter(pc.invert(pc.is_in(old, value_set=new)))
        added = len(new) - pc.sum(pc.is_in(new, value_set=old)).as_py() if len(new) else 0
        first = pc.take(vanished, pc.array_sort_indices(vanished)[:20]).to_pylist() if len(vanished) else []
        return int(added), len(vanished), first

    # --- the pending set ----------------------------------------------------------------------------
    def pending(self, committed: Units, failed: Units, skip_failed: bool, affinity_chars: int,
                listed: bool = True, samples: int = 1) -> PendingScan:
        """Each unit (sample 0 to `samples` - 1 of each prompt; `committed`, `failed` hold unit ids, as sets or as
        Arrow arrays such as RunDir.unit_ids) neither committed nor (with `skip_failed`) failed, in file order, a
        prompt's samples one after the other, with the prompt's routing key (`listed=False`: counted only).

        Vectorised: the id column is read whole (a few dozen bytes a prompt) and looked up in the ledger in Arrow;
        only the pending units become Python objects."""
        stored = affinity_chars > 0 and self.route_key_chars() == affinity_chars
        if listed and affinity_chars > 0 and not stored:
            log.info("prompt set %s has no routing keys for prefix_affinity_chars=%d: computing them from the "
                     "messages of the pending prompts", self.name, affinity_chars)
        if listed:
            log.info("prompt set %s: %d prompts in %d row groups, pinned for this run", self.name, self.num_rows,
                     len(self.group_rows))
        columns = ["prompt_id"] + ([ROUTE_KEY] if stored and listed else []) + [IMAGES]
        if not self.num_rows:
            return PendingScan([], 0, 0, 0)
        table = self.read_small_columns(columns)
        ids = table.column("prompt_id").combine_chunks()
        committed, failed = _arrow_units(committed, ids.type), _arrow_units(failed, ids.type)
        scan = PendingScan([], self.num_rows * samples, 0, 0)
        waiting = np.zeros((len(ids), samples), dtype=bool)
        committed_units = np.zeros((len(ids), samples), dtype=bool)
        for j in range(samples):
            units = ids if j == 0 else pc.binary_join_element_wise(ids, pa.scalar(str(j), ids.type), SAMPLE_SEP)
            done = pc.is_in(units, value_set=committed).to_numpy(zero_copy_only=False)
            failed_now = pc.is_in(units, value_set=failed).to_numpy(zero_copy_only=False) & ~done
            committed_units[:, j] = done
            scan.done += int(done.sum())
            scan.failed += int(failed_now.sum())
            waiting[:, j] = ~done & ~failed_now if skip_failed else ~done
        scan.waiting = int(waiting.sum())
        if IMAGES in table.column_names:  # a few bytes a prompt, read with the ids: no image is read
            with_images = pc.fill_null(pc.greater(table.column(IMAGES), 0), False).to_numpy(zero_copy_only=False)
            scan.image_total = int(with_images.sum()) * samples
            scan.image_waiting = int(waiting[with_images].sum())
            scan.image_done = int(committed_units[with_images].sum())
        del committed_units
        if not listed or not scan.waiting:
            return scan
        flat = np.flatnonzero(waiting.ravel())  # row-major: file order, a prompt's samples one after the other
        route_keys = table.column(ROUTE_KEY).combine_chunks().fill_null(0) if stored else None
        for lo in range(0, len(flat), PENDING_CHUNK):  # a chunk at a time: no list of a million temporaries
            rows, sample = np.divmod(flat[lo:lo + PENDING_CHUNK], samples)
            prompt_ids = ids.take(pa.array(rows)).to_pylist()
            if route_keys is not None:
                keys = route_keys.take(pa.array(rows)).to_pylist()
            elif affinity_chars > 0:
                keys = self._computed_keys(rows, affinity_chars)
            else:
                keys = [0] * len(rows)
            scan.pending.extend(PendingPrompt(unit_id(pid, j), position, key)
                                for pid, j, position, key in zip(prompt_ids, sample.tolist(), rows.tolist(), keys))
        return scan

    def _computed_keys(self, rows: np.ndarray, affinity_chars: int) -> list[int]:
        """The routing keys of these rows (ascending positions) from their messages: a set staged without a
        `route_key` column, or for another `prefix_affinity_chars`. Reads only the row groups that hold them."""
        keys: list[int] = []
        groups = np.searchsorted(np.asarray(self.starts), rows, side="right") - 1
        present = [c for c in ("messages", "tools") if c in self.schema.names]
        for group in np.unique(groups).tolist():
            table = self.read_group(group, present)
            offsets = (rows[groups == group] - self.starts[group]).tolist()
            messages = table.column("messages").take(offsets).to_pylist()
            tools = (table.column("tools").take(offsets).to_pylist() if "tools" in table.column_names
                     else [None] * len(offsets))
            for row_messages, t in zip(messages, tools):
                keys.append(affinity_key([message_from_row(m) for m in row_messages], affinity_chars,
                                         None if t is None else t.encode()))
        return keys

    # --- rows by position ---------------------------------------------------------------------------
    def rows(self, pending: list[PendingPrompt]) -> list[PromptRow]:
        """The stored rows of these prompts (or samples of prompts), in their order. Checks each row is the prompt
        asked for. A row's `prompt_id` is the prompt's own id, whichever sample asked for it."""
        by_group: dict[int, list[int]] = {}
        for i, p in enumerate(pending):
            if not 0 <= p.position < self.num_rows:
                raise StorageError(f"{self.where}: prompt {p.prompt_id} is at row {p.position}, past the "
                                   f"{self.num_rows} rows of the prompt set")
            by_group.setdefault(bisect.bisect_right(self.starts, p.position) - 1, []).append(i)
        out: list[PromptRow | None] = [None] * len(pending)
        for group, indexes in by_group.items():
            table = self._group(group)
            messages, sources = table.column("messages"), table.column("source")
            references = table.column("reference")
            tools = table.column("tools") if "tools" in table.column_names else None
            refs = table.column("source_ref") if "source_ref" in table.column_names else None
            ids = table.column("prompt_id")
            for i in indexes:
                p = pending[i]
                r = p.position - self.starts[group]
                base = split_unit(p.prompt_id)[0]
                if ids[r].as_py() != base:
                    raise StorageError(f"{self.where}: row {p.position} holds prompt {ids[r].as_py()}, not "
                                       f"{base}: the prompt set changed under the run")
                out[i] = PromptRow(base, p.position, sources[r].as_py(),
                                   [message_from_row(m) for m in messages[r].as_py()],
                                   references[r].as_py(), tools[r].as_py() if tools is not None else None,
                                   p.affinity, refs[r].as_py() if refs is not None else None)
        return out  # type: ignore[return-value]

    def _group(self, group: int) -> pa.Table:
        table = self._cache.get(group)
        if table is not None:
            self._cache.move_to_end(group)
            return table
        while len(self._cache) >= self.cached_groups:
            self._cache.popitem(last=False)
        table = self.read_group(group, [c for c in ROW_COLUMNS if c in self.schema.names])
        self._cache[group] = table
        self.max_rows_held = max(self.max_rows_held, sum(t.num_rows for t in self._cache.values()))
        return table


def pinned_reader(versions: list[Location], version: int | None = None) -> PromptSetReader | None:
    """One version of a run's prompt set, pinned: the run reads that file whatever is added later. `version`: the
    count of versions when it was committed (run.json's `prompt_set_version`); None, or a count no longer there:
    the newest (resume.py restages a set whose record does not match)."""
    if not versions:
        return None
    if version is not None and 1 <= version <= len(versions):
        return PromptSetReader(versions[version - 1])
    return PromptSetReader(versions[-1])
