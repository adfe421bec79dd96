"""Where a run lives: a POSIX path (local disk, NFS, Lustre) or an object-store URI (`s3://`, `gs://`, ...),
through pyarrow's filesystem layer. `Location` is the small path-like surface the store needs.

What an atomic commit is on each backend (invariant 4: the ledger is the set of committed parts):
- POSIX: the bytes go to a hidden temporary name, are fsynced, then renamed over the final name, and the
  folder is fsynced. A rename is atomic, so a reader sees the whole part or none of it; a killed writer leaves
  a `.tmp-*` file that the next start removes. An exclusive commit (every part: a committed part is never
  replaced) hard-links the temporary file to the final name instead, which fails if that name exists.
- Object stores have no rename, but a whole-object PUT (or a completed multipart upload) is atomic: the
  object appears complete or not at all. A part is written straight under its final name, once, from its
  complete encoded bytes. A writer killed mid-upload leaves an incomplete multipart upload, which no
  listing shows (a bucket lifecycle rule that aborts incomplete uploads after a day reclaims its space).
  An exclusive commit first checks that the name is free (pyarrow has no conditional PUT, so this guards
  against a name reused by mistake, not against two writers racing for one name: names are unique by
  construction, and each is written by one writer).
A failure after the rename or link leaves the outcome unknown to the caller (the part may be committed):
`StorageError.maybe_committed` says so, and the caller resolves it by looking (`committed_part`).

Credentials never appear in a URI (it is written to run.json and the logs): pyarrow reads them from the
environment or the instance's role, as the AWS and Google SDKs do.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import posixpath
import shutil
import signal
import urllib.parse
import uuid
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..core.errors import ConfigError, PartExists, StorageError
from ..core.uri import check_uri

TMP_PREFIX = ".tmp-"
# Test-only fault injection: SIGKILL this process after a part's bytes are written and before they are
# committed (the rename, or the upload's completion), on the Nth part.
FAULT_KILL_BEFORE_RENAME = "REGEN_FAULT_KILL_BEFORE_RENAME"
_parts_committed = 0


@functools.lru_cache(maxsize=None)
def _filesystem(scheme: str, netloc: str, query: str) -> pafs.FileSystem:
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

    # --- reading ------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def iterdir(self) -> list["Location"]:
        """The folder's entries (none if it does not exist)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return [Location(info.path, self.scheme, self.query, self.fs) for info in infos]

    def read_bytes(self) -> bytes:
        """Raises FileNotFoundError on every backend when the file is missing (pyarrow maps it so)."""
        with self.fs.open_input_stream(self.path) as handle:
            return handle.read()

    def size(self) -> int:
        return self.fs.get_file_info(self.path).size

    def read_parquet(self, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path, filesystem=self.fs, columns=columns)

    def parquet_schema(self) -> pa.Schema:
        return pq.read_schema(self.path, filesystem=self.fs)

    def parquet_file(self) -> pq.ParquetFile:
        return pq.ParquetFile(self.fs.open_input_file(self.path))

    # --- writing ------------------------------------------------------------------------------------
    def mkdir(self) -> None:
        try:
            self.fs.create_dir(self.path, recursive=True)
        except OSError as exc:
            raise storage_error(exc, self) from exc

    def unlink(self) -> None:
        """Delete the file if it is there."""
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass

    def write_atomic(self, data: bytes, *, fault_point: bool = False, exclusive: bool = False) -> None:
        """The file either does not exist or is complete (see the module docstring). `exclusive`: refuse
        (PartExists) to replace an existing file."""
        if self.local:
            self._posix_commit(lambda tmp: _write_file(tmp, data), fault_point, exclusive)
        else:
            self._object_commit(lambda stream: stream.write(data), fault_point, exclusive)

    def copy_atomic(self, local_file: str, *, exclusive: bool = False) -> None:
        """Like write_atomic, from a local file, streamed: its bytes are never all in memory."""
        def copy(out) -> None:
            with open(local_file, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)

        if self.local:
            self._posix_commit(lambda tmp: shutil.copyfile(local_file, tmp), False, exclusive)
        else:
            self._object_commit(copy, False, exclusive)

    def write_parquet_atomic(self, table: pa.Table, *, exclusive: bool = False, **options) -> None:
        """Like write_atomic, but the Parquet writer streams: the encoded file is never held in memory."""
        if self.local:
            self._posix_commit(lambda tmp: pq.write_table(table, tmp, **options), False, exclusive)
        else:
            self._object_commit(lambda stream: pq.write_table(table, stream, **options), False, exclusive)

    def _posix_commit(self, write, fault_point: bool, exclusive: bool) -> None:
        tmp = posixpath.join(posixpath.dirname(self.path), f"{TMP_PREFIX}{self.name}.{uuid.uuid4().hex[:8]}")
        renamed = False
        try:
            write(tmp)
            _fsync_path(tmp)
            if fault_point:
                _maybe_inject_kill()
            if exclusive:
                _link_exclusive(tmp, self.path)
            else:
                os.replace(tmp, self.path)
            renamed = True
            _fsync_path(posixpath.dirname(self.path))
        except FileExistsError:
            raise PartExists(f"{self} already exists: a committed file is never replaced") from None
        except OSError as exc:
            raise storage_error(exc, self, maybe_committed=renamed) from exc
        finally:
            if exclusive or not renamed:  # the link leaves the temporary name behind; a failure too
                with contextlib.suppress(OSError):  # cleanup must not hide the original error
                    os.unlink(tmp)

    def _object_commit(self, write, fault_point: bool, exclusive: bool) -> None:
        stream, closing = None, False
        try:
            if exclusive and self.exists():
                raise PartExists(f"{self} already exists: a committed object is never replaced")
            stream = self.fs.open_output_stream(self.path)
            write(stream)
            if fault_point:
                _maybe_inject_kill()
            closing = True
            stream.close()  # completes the upload: the object appears now, whole
        except BaseException as exc:
            # pyarrow completes an upload when its stream is closed or dropped, so an upload that failed (or was
            # interrupted) before its close is completed here, at a known moment, and removed. A failed close may
            # still have completed the upload: the caller then looks (maybe_committed).
            if stream is not None and not closing:
                with contextlib.suppress(BaseException):
                    stream.close()
                with contextlib.suppress(OSError):  # cleanup must not hide the original error
                    self.unlink()
            if isinstance(exc, OSError):
                raise storage_error(exc, self, maybe_committed=closing) from exc
            raise


def committed_part(where: Location, expected_rows: int) -> bool:
    """Resolve a commit whose outcome is unknown by looking: True if the part is there under its final name
    and reads back whole (its footer names `expected_rows` rows), False if it is not there. A part that is
    there but does not read back is removed, so it can never be mistaken for committed. Raises StorageError
    if the store cannot be read (the outcome stays unknown)."""
    try:
        if not where.exists():
            return False
        try:
            if where.parquet_file().metadata.num_rows == expected_rows:
                return True
        except pa.ArrowInvalid:  # there, but not a whole Parquet file (an OSError is the store's, not the file's)
            pass
        where.unlink()
        return False
    except OSError as exc:
        raise storage_error(exc, where, maybe_committed=True) from exc


def storage_error(exc: OSError, where: object, maybe_committed: bool = False) -> StorageError:
    reason = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only filesystem"}.get(
        exc.errno, os.strerror(exc.errno) if exc.errno else str(exc)
    )
    error = StorageError(f"cannot write {where}: {reason}. Nothing committed was lost; fix it and rerun to resume.")
    error.maybe_committed = maybe_committed
    return error


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS}


def _link_exclusive(tmp: str, final: str) -> None:
    """Give `tmp` the name `final` unless `final` exists (FileExistsError). A hard link is atomic and never
    replaces; on a filesystem without hard links, a checked rename (one writer per name makes it safe)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if os.path.samefile(tmp, final):  # NFS: the link was made, but its reply was lost and retried
                return
        raise
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "exists", final) from None
        os.rename(tmp, final)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _maybe_inject_kill() -> None:
    global _parts_committed
    _parts_committed += 1
    target = os.environ.get(FAULT_KILL_BEFORE_RENAME)
    if target and int(target) == _parts_committed:
        os.kill(os.getpid(), signal.SIGKILL)
