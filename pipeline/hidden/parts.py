"""Hidden parts on disk: writer, listing, garbage collection and the loader (of RUN/capture, pipeline/capture.py).

Layout: `<capture>/hidden/part-<tag>-<prompt>-<turn>-<seq>.parquet`, schema `schema.HIDDEN`: a sample is a few
consecutive rows of about CHUNK_BYTES, one row per row group (so the writer streams one chunk at a time and a
reader loads one sample at a time). Names are unique by construction: `tag` names the writer (a capture actor),
`prompt` and `turn` its first sample, and `seq` counts the actor's parts. Every commit is exclusive (storage: it
never replaces a file), so an actor restarted with its counter back at 1, retrying a sample it wrote before,
finds the name taken and moves to the next `seq`. Many actors write into the same folder without coordinating.
The `hidden` column is stored PLAIN, uncompressed, without dictionary or statistics, so a part is the bf16
bytes plus a few hundred bytes per sample.

Commit order: an actor commits its hidden part (atomically: storage.py) before the ledger row that references it
(`hidden_part` = the part's file name, `hidden_row` = the row; the ledger is the capture's data/). A crash in
between leaves a hidden part that no ledger row references; `garbage_hidden_parts` lists those (and killed
writers' temporary files) for deletion on resume, while no writer is running.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from os import PathLike

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import PartExists
from ..store import schema
from ..store.rundir import PART_RE, TMP_PREFIX, RunDir
from ..store.storage import Location

HIDDEN_PART_RE = re.compile(r"^part-([a-z0-9]{1,32})-([a-z0-9]{1,32})-(\d+)-(\d{6,})\.parquet$")
_MAX_NAME_TRIES = 1000  # names taken by earlier incarnations of the same actor (each a retried sample)
_HIDDEN_COL = "hidden"
CHUNK_BYTES = 8 << 20  # a sample is stored in rows of about this size, so writing never holds it twice
_OTHER_COLS = [f.name for f in schema.HIDDEN if f.name != _HIDDEN_COL]

try:  # optional: a real bfloat16 dtype for users; uint16 bit patterns otherwise
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BF16 = np.dtype(np.uint16)


RunLike = RunDir | Location | PathLike[str] | str


def hidden_dir(run_dir: RunLike) -> Location:
    return _run_dir(run_dir).path / "hidden"


def _run_dir(run_dir: RunLike) -> RunDir:
    return run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)


def hidden_parts(run_dir: RunLike) -> list[Location]:
    """Committed hidden parts (any writer), sorted by name."""
    return sorted(p for p in hidden_dir(run_dir).iterdir()
                  if HIDDEN_PART_RE.match(p.name) or PART_RE.match(p.name))


def _name_field(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())[:32]


def _sanitize_tag(tag: str | None) -> str:
    """A writer's tag: readable (the label's letters and digits) and unique (a hash of the whole label: labels
    that differ only in punctuation or past the cut, such as two ports of one long host name, stay apart)."""
    if not tag:
        return uuid.uuid4().hex[:8]
    return _name_field(tag)[:23] + hashlib.sha256(tag.encode()).hexdigest()[:8]


class HiddenPartWriter:
    """Buffers samples of one writer (a capture actor) and commits them as one hidden part.

    `add()` keeps a reference to each matrix (no copy); `commit()` writes them with one atomic rename and
    returns (part file name, {(prompt_id, turn_index): row}); the caller then commits the ledger rows with
    hidden_part/hidden_row. Memory: the buffered matrices plus the encoded part (about the same size).
    """

    def __init__(self, run_dir: RunLike, tag: str | None = None, counter: Iterator[int] | None = None):
        """`counter`: the actor's part counter, shared by all the writers one actor makes."""
        self.run_dir = _run_dir(run_dir)
        self.tag = _sanitize_tag(tag)
        self.counter = counter if counter is not None else itertools.count(1)
        self._rows: list[dict] = []
        self._mats: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def pending_bytes(self) -> int:
        return sum(m.nbytes for m in self._mats)

    def add(self, prompt_id: str, turn_index: int, token_ids, n_prompt: int, hidden: np.ndarray) -> None:
        """One sample: `token_ids` = prompt + completion ids (T), `hidden` = [T, width] bf16 (row t: the states
        after feeding token t), as uint16 bit patterns or ml_dtypes.bfloat16."""
        if hidden.ndim != 2 or hidden.dtype.itemsize != 2:
            raise ValueError(f"hidden must be a 2-D bf16/uint16 matrix, got {hidden.dtype} {hidden.shape}")
        token_ids = np.asarray(token_ids, dtype=np.int32)
        if hidden.shape[0] != len(token_ids):
            raise ValueError(f"{hidden.shape[0]} hidden rows for {len(token_ids)} tokens; expected one a token")
        if any(r["prompt_id"] == prompt_id and r["turn_index"] == turn_index for r in self._rows):
            raise ValueError(f"({prompt_id!r}, {turn_index}) is already pending in this part")
        self._rows.append({"prompt_id": prompt_id, "turn_index": int(turn_index), "token_ids": token_ids,
                           "n_prompt": int(n_prompt), "n_rows": int(hidden.shape[0]),
                           "width": int(hidden.shape[1]), "dtype": "bf16"})
        self._mats.append(np.ascontiguousarray(hidden).view(np.uint16))

    def _table(self) -> tuple[pa.Table, list[int]]:
        """The pending samples as rows of about CHUNK_BYTES each (one row group each), without copying the
        matrices: every sample's `hidden` values are slices of its own numpy buffer. Returns the table and
        each sample's first row."""
        columns: dict[str, list] = {name: [] for name in schema.HIDDEN.names if name != _HIDDEN_COL}
        pieces: list[pa.Array] = []
        first_rows: list[int] = []
        for meta, matrix in zip(self._rows, self._mats):
            first_rows.append(len(columns["chunk"]))
            step = max(1, CHUNK_BYTES // max(1, matrix.shape[1] * 2))
            n_chunks = max(1, -(-matrix.shape[0] // step))
            offsets = np.minimum(np.arange(n_chunks + 1, dtype=np.int64) * step, matrix.shape[0]) * matrix.shape[1] * 2
            pieces.append(pa.LargeBinaryArray.from_buffers(
                pa.large_binary(), n_chunks, [None, pa.py_buffer(offsets), pa.py_buffer(matrix)]))
            for chunk in range(n_chunks):
                for name in columns:
                    value = {"chunk": chunk, "n_chunks": n_chunks}.get(name, meta.get(name))
                    columns[name].append(value if name != "token_ids" or chunk == 0 else [])
        arrays = [pa.chunked_array(pieces, type=f.type) if f.name == _HIDDEN_COL else pa.array(columns[f.name], f.type)
                  for f in schema.HIDDEN]
        return pa.Table.from_arrays(arrays, schema=schema.HIDDEN), first_rows

    def commit(self) -> tuple[str, dict[tuple[str, int], int]]:
        """Write the pending samples as one part; ("", {}) if nothing is pending."""
        if not self._rows:
            return "", {}
        folder = hidden_dir(self.run_dir)
        folder.mkdir()
        first = self._rows[0]
        stem = f"part-{self.tag}-{_name_field(first['prompt_id']) or 'x'}-{first['turn_index']}"
        table, first_rows = self._table()
        for _ in range(_MAX_NAME_TRIES):
            name = f"{stem}-{next(self.counter):06d}.parquet"
            try:  # streamed by the Parquet writer: the encoded part is never held in memory next to the matrices;
                # direct: on an object store, no server-side copy of a large part (it counts once a row names it)
                (folder / name).write_parquet_atomic(
                    table, exclusive=True, direct=True, row_group_size=1,
                    compression={c: ("none" if c == _HIDDEN_COL else "zstd") for c in schema.HIDDEN.names},
                    use_dictionary=_OTHER_COLS, write_statistics=_OTHER_COLS)
                break
            except PartExists:
                continue  # written by an earlier incarnation of this actor (a retried sample): the next seq
        else:
            raise PartExists(f"{folder}/{stem}-*: {_MAX_NAME_TRIES} names taken")
        rows = {(r["prompt_id"], r["turn_index"]): first for r, first in zip(self._rows, first_rows)}
        self._rows, self._mats = [], []
        return name, rows


def referenced_hidden_parts(run_dir: RunLike) -> set[str]:
    """Hidden part names referenced by committed ledger rows (reads only the `hidden_part` column)."""
    rd = _run_dir(run_dir)
    names: set[str] = set()
    for part in rd.parts(rd.data):
        if "hidden_part" not in part.parquet_schema().names:
            continue
        names.update(n for n in part.read_parquet(columns=["hidden_part"]).column(0).to_pylist() if n)
    return names


def garbage_hidden_parts(run_dir: RunLike, referenced: set[str] | None = None) -> list[Location]:
    """Hidden parts no committed ledger row references, plus temporary files of killed writers. Call on resume
    before any writer starts (a part committed a moment ago whose ledger row is still pending looks the same)."""
    if referenced is None:
        referenced = referenced_hidden_parts(run_dir)
    garbage = [p for p in hidden_parts(run_dir) if p.name not in referenced]
    return garbage + sorted(p for p in hidden_dir(run_dir).iterdir() if p.name.startswith(TMP_PREFIX))


def remove_garbage_hidden_parts(run_dir: RunLike) -> int:
    """Delete what `garbage_hidden_parts` lists (left by a kill or a retried call). The capture driver does this
    at every start, before any writer starts, also when nothing is pending. Returns how many."""
    if not any(True for _ in hidden_dir(run_dir).iterdir()):
        return 0  # nothing captured yet: do not read the ledger
    garbage = garbage_hidden_parts(run_dir)
    for part in garbage:
        part.unlink()
    return len(garbage)


@dataclass
class HiddenSample:
    prompt_id: str
    turn_index: int
    token_ids: np.ndarray  # int32 [T]: prompt + completion
    n_prompt: int
    hidden: np.ndarray  # bf16 [T, W], ml_dtypes.bfloat16 or uint16 bits
    loss_mask: np.ndarray  # uint8 [T]: 0 on the prompt, 1 on the completion

    @property
    def n_rows(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def width(self) -> int:
        return int(self.hidden.shape[1])


def _references(rd: RunDir) -> dict[str, list[tuple[int, str, int]]]:
    by_part: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    cols = ["prompt_id", "turn_index", "hidden_part", "hidden_row"]
    for part in rd.parts(rd.data):
        if "hidden_part" not in part.parquet_schema().names:
            continue
        t = part.read_parquet(columns=cols).to_pydict()
        for pid, turn, hp, row in zip(t["prompt_id"], t["turn_index"], t["hidden_part"], t["hidden_row"]):
            if hp is not None and row is not None:
                by_part[hp].append((int(row), pid, int(turn or 0)))
    return by_part


def read_sample(path: Location | PathLike[str] | str, row: int, pf: pq.ParquetFile | None = None) -> HiddenSample:
    """The sample starting at row `row` of one hidden part, reading only its row groups (one per row)."""
    path = Location.at(path)
    pf = pf or path.parquet_file()
    if row >= pf.metadata.num_row_groups:
        raise IndexError(f"{path.name} has no row {row}")
    table = pf.read_row_group(row)
    meta = {name: table.column(name)[0].as_py() for name in ("prompt_id", "turn_index", "chunk", "n_chunks",
                                                             "n_prompt", "n_rows", "width", "dtype")}
    if meta["dtype"] != "bf16" or meta["chunk"] != 0:
        raise ValueError(f"{path.name} row {row}: not the first chunk of a bf16 sample")
    hidden = np.empty((meta["n_rows"], meta["width"]), dtype=np.uint16)
    flat, filled = hidden.reshape(-1).view(np.uint8), 0
    for chunk in range(meta["n_chunks"]):
        group = table if chunk == 0 else pf.read_row_group(row + chunk, columns=[_HIDDEN_COL])
        value = np.frombuffer(group.column(_HIDDEN_COL)[0].as_buffer(), dtype=np.uint8)
        flat[filled:filled + len(value)] = value
        filled += len(value)
    if filled != hidden.nbytes:
        raise ValueError(f"{path.name} row {row}: {filled} bytes of hidden states for a {hidden.shape} matrix")
    if BF16 != np.uint16:
        hidden = hidden.view(BF16)
    token_ids = np.asarray(table.column("token_ids")[0].values.to_numpy(zero_copy_only=False), dtype=np.int32)
    loss_mask = np.zeros(len(token_ids), dtype=np.uint8)
    loss_mask[meta["n_prompt"]:] = 1
    return HiddenSample(meta["prompt_id"], int(meta["turn_index"]), token_ids, int(meta["n_prompt"]), hidden,
                        loss_mask)


def iter_hidden(run_dir: RunLike) -> Iterator[HiddenSample]:
    """Every hidden sample referenced by a committed ledger row, one part and one sample at a time, in part
    name order then row order. Unreferenced (garbage) parts and rows are skipped."""
    rd = _run_dir(run_dir)
    folder = hidden_dir(rd)
    for name, refs in sorted(_references(rd).items()):
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f"committed ledger rows reference {path}, which is missing")
        pf = path.parquet_file()
        for row, pid, turn in sorted(set(refs)):
            sample = read_sample(path, row, pf)
            if (sample.prompt_id, sample.turn_index) != (pid, turn):
                raise ValueError(f"{name} row {row} holds ({sample.prompt_id!r}, {sample.turn_index}), "
                                 f"but the ledger row says ({pid!r}, {turn})")
            yield sample
