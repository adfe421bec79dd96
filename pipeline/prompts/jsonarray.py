"""kind: json: one JSON array of records, or an object holding one under `records_field`, streamed.

The file is fed in chunks to ijson's incremental parser (its C backend, yajl2_c): memory holds one chunk and
one record, never the file. A UTF-8 BOM is skipped and raw NUL bytes (invalid anywhere in JSON text) are
taken out. A file cut short, or invalid before its end, is a `Cut`: where the last complete record ends,
found exactly by a second pass that feeds the parser one byte at a time in the chunks that matter.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ijson
import orjson

from .errors import Cut, SourceError
from .records import RAW_MAX_CHARS, RawRecord, Reject, RejectCode
from .reading import BOM, ReadStats, cut_or_salvage, first_bytes
from .spec import SourceSpec

log = logging.getLogger("regen")

CHUNK_BYTES = 256 * 1024
# A \uD800-\uDFFF escape that is not half of a pair: yajl2_c turns it into "?" without a word. It is replaced,
# same length, by \uFFFF (a noncharacter) before parsing, and a record holding one is rejected.
_HIGH, _LOW = rb"\\u[dD][89abAB][0-9a-fA-F]{2}", rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE_SURROGATE = re.compile(rb"(?<!\\)((?:\\\\)*)(?:" + _HIGH + rb"(?!" + _LOW + rb")|(?<!" + _HIGH + rb")" + _LOW + rb")")
_NONCHARACTER = "\uffff"
_SCAN_LIMIT = 16 * 1024 * 1024  # how far to look for the key of an object's first array, for an error message


@functools.cache
def backend() -> Any:
    """ijson's C backend; its pure-Python one (about 30 times slower) only if the C one cannot be loaded."""
    try:
        return ijson.get_backend("yajl2_c")
    except ImportError as exc:
        log.warning("ijson's C backend yajl2_c is not available (%s): JSON sources are parsed by the pure-Python "
                    "backend, about 30 times slower; reinstall ijson to get it back", exc)
        return ijson.get_backend("python")


def read_json(spec: SourceSpec, file: Path, shown: str, stats: ReadStats) -> Iterator[RawRecord]:
    prefix = records_prefix(spec, file, shown)
    stats.containers[shown] = (f"JSON object, records under {spec.records_field!r}" if spec.records_field
                               else "JSON array")
    size = file.stat().st_size
    records, record_chunk, error_chunk = 0, -1, None
    sink = ijson.sendable_list()
    parser = backend().items_coro(sink, prefix, use_float=True)
    surrogates = _Surrogates()
    for chunk_index, (_, _, clean) in enumerate(_chunks(file, stats, surrogates)):
        try:
            parser.send(clean)
        except ijson.JSONError:
            error_chunk = chunk_index
        if sink:
            record_chunk = chunk_index
        for data in sink:  # records completed before an error in the same chunk are whole: they count
            yield from _record(spec, f"{shown}#{records}", data, surrogates)
            records += 1
        del sink[:]
        if error_chunk is not None:
            break
    if error_chunk is None:
        try:
            parser.close()
        except ijson.JSONError:
            error_chunk = -1  # the end of the file came inside a record
    if error_chunk is None:
        if records == 0 and spec.records_field:
            raise SourceError(spec.name, f"{shown} has no records under {spec.records_field!r} (the key is missing, "
                                         "or does not hold an array)", "check `records_field`")
        return
    if spec.records_field and json_lines(file, None):  # the records' own field named as the container's key
        raise SourceError(spec.name, f"{shown} is JSON Lines (one record per line), not one JSON object",
                          "use `kind: jsonl` without `records_field`")
    offset, error_at = locate_cut(file, prefix, records, record_chunk, error_chunk)
    truncated = error_chunk == -1
    cut_or_salvage(spec, Cut(shown, offset, records, size, size if truncated else error_at, truncated=truncated,
                             unclosed=truncated and records > 0 and _only_separators(file, offset, size)), stats)


def _only_separators(file: Path, start: int, end: int) -> bool:
    """Nothing of a record between `start` and the end: whitespace, commas, closing brackets."""
    if end - start > 4096:
        return False
    with file.open("rb") as fh:
        fh.seek(start)
        return not fh.read(end - start).translate(None, b" \t\r\n,]}")


def _record(spec: SourceSpec, origin: str, data: Any, surrogates: "_Surrogates") -> Iterator[RawRecord | Reject]:
    if surrogates.seen and _NONCHARACTER in (text := orjson.dumps(data).decode()):
        yield Reject(spec.name, origin, "a string holds a lone UTF-16 surrogate escape (half of a character, such "
                     "as \\ud83d without its pair): its text cannot be kept exactly", text[:RAW_MAX_CHARS],
                     RejectCode.BAD_JSON.value)
    else:
        yield RawRecord(spec.name, origin, data)


def records_prefix(spec: SourceSpec, file: Path, shown: str) -> str:
    """The ijson prefix of the records; a file of another shape is named at once, with the spec key to set."""
    head = first_bytes(file)
    if not head:
        raise SourceError(spec.name, f"{shown} is empty")
    if spec.records_field:
        if not head.startswith(b"{"):
            hint = "remove `records_field`: the records are the array itself" if head.startswith(b"[") else ""
            raise SourceError(spec.name, f"{shown} is not a JSON object, so it has no key {spec.records_field!r}",
                              hint)
        return f"{spec.records_field}.item"
    if head.startswith(b"["):
        return "item"
    if head.startswith(b"{"):
        if json_lines(file, spec.conversation_field):
            raise SourceError(spec.name, f"{shown} is JSON Lines (one record per line), not a JSON array",
                              "use `kind: jsonl`")
        key = _first_array_key(file)
        hint = (f"set `records_field: {key}` (its first key holding an array)" if key
                else "set `records_field` to the key that holds the records")
        raise SourceError(spec.name, f"{shown} is a JSON object, not an array of records", hint)
    raise SourceError(spec.name, f"{shown} does not start with a JSON array or object (it starts with "
                                 f"{head[:16]!r})", "for JSON Lines set `kind: jsonl`")


def json_lines(file: Path, field: str | None) -> bool:
    """JSON Lines saved as .json: its first values parsed (ijson, multiple_values), never a window of bytes, so
    a blank first line, a first record over any size, or a single record are told apart from one JSON document.

    True when a second top-level value follows an object, or the first object is a record: the records' own field
    (the spec's conversation field; None: only the first test) at its top level, and not in the items of an
    array under it (then it holds records); False for anything that is not valid JSON (the reader says where)."""
    depth, values, first_is_object, has_field = 0, 0, False, False
    with file.open("rb") as fh:
        try:
            for prefix, event, value in backend().parse(_WithoutBom(fh), multiple_values=True, use_float=True):
                if depth == 0 and event != "map_key":  # a top-level value starts
                    values += 1
                    if values == 2:
                        return first_is_object
                    first_is_object = event == "start_map"
                if event in ("start_map", "start_array"):
                    depth += 1
                elif event in ("end_map", "end_array"):
                    depth -= 1
                    if depth == 0 and has_field:
                        return True  # the whole first value is one record
                elif event == "map_key" and value == field and first_is_object and values == 1:
                    if depth > 1 and prefix.endswith(".item"):
                        return False  # records inside the object: a container
                    has_field = has_field or depth == 1
        except ijson.JSONError:
            return False
    return False


class _WithoutBom:
    """A file object whose leading UTF-8 BOM is skipped."""

    def __init__(self, fh: Any):
        self.fh, self.start = fh, True

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        if self.start and data:
            self.start = False
            data = data.removeprefix(BOM)
        return data


def _first_array_key(file: Path) -> str | None:
    key = None
    with file.open("rb") as fh:
        try:
            for prefix, event, value in backend().parse(_Limited(fh, _SCAN_LIMIT), use_float=True):
                if prefix == "" and event == "map_key":
                    key = value
                elif event == "start_array" and prefix == key:
                    return key
                elif prefix == "" and event == "end_map":
                    return None
        except ijson.JSONError:
            return None
    return None


class _Limited:
    """A file object that ends after `limit` bytes."""

    def __init__(self, fh: Any, limit: int):
        self.fh, self.left = fh, limit

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.fh.read(n)
        self.left -= len(data)
        return data.removeprefix(BOM)


@dataclass
class _Surrogates:
    seen: int = 0  # lone surrogate escapes replaced by \uFFFF so far


def _chunks(file: Path, stats: ReadStats | None = None,
            surrogates: _Surrogates | None = None) -> Iterator[tuple[int, bytes, bytes]]:
    """(offset of the raw chunk, the raw chunk, what the parser gets: without the BOM and NUL bytes, and with
    `surrogates`, lone surrogate escapes replaced). The chunks around give the escapes their context: 12 bytes
    of each side, read ahead, so one split across two chunks is seen whole."""
    offset, before = 0, b""
    with file.open("rb") as fh:
        raw = fh.read(CHUNK_BYTES)
        while raw:
            after = fh.read(CHUNK_BYTES)
            clean = raw
            if surrogates is not None:
                clean = _replace_lone_surrogates(before, raw, after[:12], surrogates)
                before = raw[-12:]
            clean = clean.removeprefix(BOM) if offset == 0 else clean
            if b"\x00" in clean:
                if stats is not None:
                    stats.nul_bytes_removed += clean.count(b"\x00")
                clean = clean.replace(b"\x00", b"")
            yield offset, raw, clean
            offset += len(raw)
            raw = after


def _replace_lone_surrogates(before: bytes, raw: bytes, after: bytes, surrogates: _Surrogates) -> bytes:
    window = before + raw + after
    if b"\\u" not in window:
        return raw
    start, end = len(before), len(before) + len(raw)
    fixed = bytearray(window)
    for match in _LONE_SURROGATE.finditer(window):
        escape = match.start() + len(match.group(1))
        fixed[escape:escape + 6] = b"\\uffff"  # same length: every offset stays the file's
        if start <= escape < end:
            surrogates.seen += 1
    return bytes(fixed[start:end])


def locate_cut(file: Path, prefix: str, records: int, record_chunk: int, error_chunk: int) -> tuple[int, int]:
    """(the byte just after the last complete record, the byte where the parser gave up), exactly.

    A second pass feeds whole chunks, except the chunk where the last record was completed and the chunk where
    the parser failed (`error_chunk`, -1: at the end of the file), which it feeds one byte at a time."""
    sink = ijson.sendable_list()
    parser = backend().items_coro(sink, prefix, use_float=True)
    count, offset = 0, 0 if records == 0 else None
    end = 0
    for index, (start, raw, clean) in enumerate(_chunks(file)):
        end = start + len(raw)
        if index not in (record_chunk, error_chunk):
            try:
                parser.send(clean)
            except ijson.JSONError:
                return offset or 0, end
            count += len(sink)
            del sink[:]
            continue
        skip = len(BOM) if start == 0 and raw.startswith(BOM) else 0
        for i in range(skip, len(raw)):
            byte = raw[i:i + 1]
            if byte == b"\x00":
                continue
            try:
                parser.send(byte)
            except ijson.JSONError:
                return offset or 0, start + i
            if sink:
                count += len(sink)
                del sink[:]
                if offset is None and count >= records:
                    offset = start + i + 1
                    if error_chunk == -1:
                        return offset, file.stat().st_size
    return offset or 0, end
