"""Where a run lives: a POSIX path (local disk, NFS, Lustre) or an object-store URI (`s3://`, `gs://`, ...),
through pyarrow's filesystem layer. `Location` is the small path-like surface the store needs.

What an atomic commit is on each backend (invariant 4: the ledger is the set of committed parts):
- POSIX: the bytes go to a hidden temporary name and are fsynced; the file is renamed over its final name
  (an exclusive commit, every part: hard-linked, which fails if the name exists), and the folder fsynced.
  A reader sees the whole file or none of it; a killed writer leaves a `.tmp-*` file, removed on resume.
- Object stores: a whole-object PUT and a server-side copy are atomic. A file is uploaded under a temporary
  name and copied to its final name, so that name only ever holds complete bytes (pyarrow has no abort: an
  upload stream dropped after an error or a second SIGINT is completed with what it held). An exclusive
  commit first checks that the name is free (no conditional PUT: names are unique by construction, each
  with one writer). `direct` uploads go straight to the final name, sparing a large object the copy: only
  hidden parts, which count once a ledger row names them; a failed one is deleted, a killed one never completes.
A failure at or after the rename, link or copy leaves the outcome unknown (the file may be committed):
`StorageError.maybe_committed` says so, and the caller looks (rundir.committed_part).

Every primitive passes one seam, `_io(op, path)` (seam.py), which a test arms (faults.py); Parquet is written through a
Python sink so that its writes pass it too. Errors other than a missing file are StorageErrors naming the
file and the reason. Credentials never appear in a URI (it is written to run.json and the logs): pyarrow
reads them from the environment or the instance's role, as the AWS and Google SDKs do.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import posixpath
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..core.errors import ConfigError, PartExists
from ..core.uri import check_uri
from .seam import arm, storage_error  # noqa: F401 (arm: the tests' switch of the seam)
from .seam import io_seam as _io, storage_errors as _errors

TMP_PREFIX = ".tmp-"
WRITE_CHUNK = 1 << 20  # the sink hands the Parquet writer's many small writes to the store in chunks this big

@functools.lru_cache(maxsize=None)
def _filesystem(scheme: str, netloc: str, query: str) -> pafs.FileSystem:
    if scheme == "s3" and "allow_delayed_open" not in query:  # a small file is one PUT, not a 3-request upload
        query = "&".join(q for q in (query, "allow_delayed_open=true") if q)
    uri = f"{scheme}://{netloc}/" + (f"?{query}" if query else "")
    try:
        return pafs.FileSystem.from_uri(uri)[0]
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise ConfigError(f"output location {scheme}://{netloc}: pyarrow cannot open it ({exc})") from exc


@dataclass(frozen=True)
class Location:
    """A file or folder on a pyarrow filesystem. `uri` rebuilds it anywhere (a Ray actor on another node);
    local locations are plain absolute paths and also work as `os.PathLike`."""

    path: str  # local: an absolute path; remote: bucket/key, as pyarrow names it
    scheme: str = ""  # "" for local
    query: str = ""  # backend options such as endpoint_override; never credentials
    fs: pafs.FileSystem = field(default=None, compare=False, repr=False)

    @classmethod
    def at(cls, where: "str | os.PathLike[str] | Location") -> "Location":
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        parts = check_uri(text)
        if len(parts.scheme) <= 1:  # no scheme (or a Windows drive letter): a local path
            return cls(os.path.abspath(text))
        if parts.scheme == "file":
            return cls(os.path.abspath(urllib.parse.unquote(parts.path)))
        _filesystem(parts.scheme, parts.netloc, parts.query)
        return cls(f"{parts.netloc}{parts.path}".rstrip("/"), parts.scheme, parts.query)

    def __post_init__(self) -> None:
        if self.fs is None:
            fs = pafs.LocalFileSystem() if self.local else _filesystem(self.scheme, self.path.split("/")[0], self.query)
            object.__setattr__(self, "fs", fs)

    def __reduce__(self):  # rebuilt from the URI on the other side: a filesystem object is never shipped
        return (Location, (self.path, self.scheme, self.query))

    # --- naming -----------------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        return not self.scheme

    @property
    def uri(self) -> str:
        if self.local:
            return self.path
        return f"{self.scheme}://{self.path}" + (f"?{self.query}" if self.query else "")

    def __str__(self) -> str:  # for messages: without backend options
        return self.path if self.local else f"{self.scheme}://{self.path}"

    def __fspath__(self) -> str:
        if not self.local:
            raise TypeError(f"{self} is on an object store, not a local path")
        return self.path

    def __truediv__(self, name: str) -> "Location":
        return Location(posixpath.join(self.path, name), self.scheme, self.query, self.fs)

    def __lt__(self, other: "Location") -> bool:
        return self.path < other.path

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "Location":
        return Location(posixpath.dirname(self.path), self.scheme, self.query, self.fs)

    def _temp(self, folder: "Location | None" = None) -> "Location":
        return (folder or self.parent) / f"{TMP_PREFIX}{self.name}.{uuid.uuid4().hex[:8]}"

    # --- reading ------------------------------------------------------------------------------------
    def exists(self) -> bool:
        with _errors("read", self):
            _io("stat", self.path)
            return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def iterdir(self) -> list["Location"]:
        """The folder's entries (none if it does not exist)."""
        with _errors("list", self):
            _io("list", self.path)
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return [Location(info.path, self.scheme, self.query, self.fs) for info in infos]

    def entry_stamps(self) -> dict[str, tuple[int, int | None]]:
        """(size, modification time in ns) of each file in the folder, by name, from one listing (none if it does
        not exist)."""
        with _errors("list", self):
            _io("list", self.path)
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return {posixpath.basename(info.path): (info.size, info.mtime_ns) for info in infos
                if info.type == pafs.FileType.File}

    def read_bytes(self) -> bytes:
        """Raises FileNotFoundError on every backend when the file is missing (pyarrow maps it so)."""
        with _errors("read", self):
            _io("read", self.path)
            with self.fs.open_input_stream(self.path) as handle:
                return handle.read()

    def size(self) -> int:
        with _errors("read", self):
            _io("stat", self.path)
            return self.fs.get_file_info(self.path).size

    def read_parquet(self, columns: list[str] | None = None) -> pa.Table:
        with _errors("read", self):
            _io("read", self.path)
            return pq.read_table(self.path, filesystem=self.fs, columns=columns)

    def parquet_schema(self) -> pa.Schema:
        with _errors("read", self):
            _io("read", self.path)
            return pq.read_schema(self.path, filesystem=self.fs)

    def parquet_file(self) -> pq.ParquetFile:
        with _errors("read", self):
            _io("read", self.path)
            return pq.ParquetFile(self.fs.open_input_file(self.path))

    # --- writing ------------------------------------------------------------------------------------
    def mkdir(self) -> None:
        """A folder and its parents. An object store has no folders (a key needs no parent): nothing to do."""
        if not self.local:
            return
        with _errors("write", self):
            _io("mkdir", self.path)
            self.fs.create_dir(self.path, recursive=True)

    def unlink(self) -> None:
        """Delete the file if it is there."""
        with _errors("delete", self):
            _delete(self)

    def write_atomic(self, data: bytes, *, exclusive: bool = False) -> None:
        """The file either does not exist or is complete (see the module docstring). `exclusive`: refuse
        (PartExists) to replace an existing file."""
        self._commit(lambda sink: sink.write(data), exclusive=exclusive)

    def copy_atomic(self, local_file: str, *, exclusive: bool = False) -> None:
        """Like write_atomic, from a local file, streamed: its bytes are never all in memory."""
        def copy(sink: "_Sink") -> None:
            with open(local_file, "rb") as src:
                while chunk := src.read(1 << 20):
                    sink.write(chunk)

        self._commit(copy, exclusive=exclusive)

    def write_with(self, write: Callable[["_Sink"], object], temp_folder: "Location | None" = None) -> None:
        """Like write_atomic, the bytes written by `write(sink)` (an exception it raises commits nothing), under a
        temporary name in `temp_folder` (default: beside the file; a folder cleaned on resume)."""
        self._commit(write, exclusive=False, temp_folder=temp_folder)

    def write_parquet_atomic(self, table: pa.Table, *, exclusive: bool = False, direct: bool = False,
                             **options) -> None:
        """Like write_atomic, but the Parquet writer streams: the encoded file is never held in memory.
        `direct` (exclusive only): on an object store, upload straight under the final name (hidden parts)."""
        self._commit(lambda sink: pq.write_table(table, sink, **options), exclusive=exclusive, direct=direct)

    def _commit(self, write: Callable[["_Sink"], object], exclusive: bool, direct: bool = False,
                temp_folder: "Location | None" = None) -> None:
        if exclusive and not self.local and self.exists():
            raise PartExists(f"{self} already exists: a committed object is never replaced")
        upload = self if direct and not self.local else self._temp(temp_folder)
        # what to delete at the end: the temporary name (unless a rename took it), or a direct upload that
        # failed (its dropped stream may have been completed, torn)
        leftover: Location | None = upload
        publishing = False
        try:
            with _Sink.open(upload) as sink:
                write(sink)
            if upload is not self:
                publishing = True
                _publish(upload, self, exclusive)
                if self.local and not exclusive:
                    leftover = None
            else:
                leftover = None
            if self.local:
                _io("fsync_dir", self.parent.path)
                _fsync_folder(self.parent.path)
        except FileExistsError:
            raise PartExists(f"{self} already exists: a committed file is never replaced") from None
        except OSError as exc:
            raise storage_error(exc, self, maybe_committed=publishing) from exc
        finally:
            if leftover is not None:
                with contextlib.suppress(OSError):  # cleanup must not hide the original error
                    _delete(leftover)


class _Sink:
    """A Python file object over a new file (POSIX: a raw descriptor; object store: an upload stream), so
    that the Parquet writer's writes pass the seam. Writes are gathered into WRITE_CHUNK pieces; on POSIX a
    short write(2) is followed by another for the rest, as a buffered file does. Leaving the `with` block
    normally makes the file durable (fsync, close; the upload completes)."""

    def __init__(self, where: Location, handle):
        self.where, self._handle = where, handle
        self._pending = bytearray()
        self._written = 0

    @classmethod
    @contextlib.contextmanager
    def open(cls, where: Location) -> Iterator["_Sink"]:
        _io("open", where.path)
        if where.local:
            handle = os.open(where.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        else:
            handle = where.fs.open_output_stream(where.path)
        sink = cls(where, handle)
        try:
            yield sink
            sink._drain()
            if where.local:
                _io("fsync", where.path)
                os.fsync(handle)
            _io("close", where.path)  # on an object store, this completes the upload
        except BaseException:
            # There is no abort: an upload stream is closed here too, which completes it with what it holds
            # (dropped, pyarrow would do the same, holding the GIL); the caller deletes what it left.
            with contextlib.suppress(OSError):
                _close(where, handle)
            raise
        finally:
            sink._handle = None
        _close(where, handle)

    @property
    def closed(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written + len(self._pending)

    def flush(self) -> None:
        pass  # durability comes with leaving the `with` block

    def close(self) -> None:
        pass  # likewise

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= WRITE_CHUNK:  # a large piece (a hidden-state chunk) goes out as it is, never copied
            self._drain()
            self._put(view)
        else:
            self._pending += view
            if len(self._pending) >= WRITE_CHUNK:
                self._drain()
        return len(view)

    def _drain(self) -> None:
        if self._pending:
            self._put(memoryview(self._pending))
            self._pending = bytearray()

    def _put(self, view: memoryview) -> None:
        self._written += len(view)
        if not self.where.local:
            _io("write", self.where.path)
            self._handle.write(view)
            return
        while view:
            short = _io("write", self.where.path)
            done = os.write(self._handle, view[: max(1, len(view) // 2)] if short else view)
            view = view[done:]


def _close(where: Location, handle) -> None:
    if where.local:
        os.close(handle)
    else:
        handle.close()


def _publish(upload: Location, final: Location, exclusive: bool) -> None:
    """Give the complete file `upload` the name `final` (the commit point)."""
    if not final.local:
        _io("copy", final.path)
        final.fs.copy_file(upload.path, final.path)
    elif exclusive:
        _link_exclusive(upload.path, final.path)
    else:
        _io("rename", final.path)
        os.replace(upload.path, final.path)


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS}


def _link_exclusive(tmp: str, final: str) -> None:
    """Give `tmp` the name `final` unless `final` exists (FileExistsError). A hard link is atomic and never
    replaces; on a filesystem without hard links, a checked rename (one writer per name makes it safe)."""
    try:
        _io("link", final)
        os.link(tmp, final)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if os.path.samefile(tmp, final):  # NFS: the link was made, but its reply was lost and retried
                return
        raise
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        _io("stat", final)
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "exists", final) from None
        _io("rename", final)
        os.rename(tmp, final)


def _fsync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete(where: Location) -> None:
    _io("delete", where.path)
    try:
        where.fs.delete_file(where.path)
    except FileNotFoundError:
        pass
