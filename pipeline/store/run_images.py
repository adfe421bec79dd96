"""The images of a run (`images.store: copy`): staged while the sources are read, copied once into the run
directory when the prompt set is committed, and read back when a prompt is sent.

- Staging (`StagedImages`, held by the staged prompt set): a local image is only listed (its path, a line in a
  temporary file: memory does not grow with the image count); bytes the sources fetched or decoded (http(s),
  `data:` URLs, a `datasets` Image column's bytes) are written into the staging folder, one file per image.
  Nothing is written into the run directory: a source that fails, or a refused set, leaves no image behind.
- Commit (`StagedImages.commit`), before the prompt set's own files, so that a committed prompt set always has
  all of its images: each image not yet in RUN/images/ (one listing of the folder) is written to a temporary name
  in RUN/images/ and published as RUN/images/<sha[:2]>/<sha> (storage.Location.write_with: rename, or an object
  store's server-side copy), a few at a time. A local file is hashed again while it is copied: bytes that are no
  longer those read are ImageChanged, naming the file, and the prompt set is not committed. A SIGKILL in the
  middle leaves whole images and temporary files (removed on resume, RunDir.cleanup_temp); the next start reads the
  sources again and copies only what is missing. An image already there is never copied again: its name is its
  content, and it was checked before it was published.
- Reading (`image_location`, `read_image`): where a part's bytes are, for the endpoint worker that sends them
  (and checks their sha256 then: a resume never reads the images).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator, Mapping

import orjson
import pyarrow.fs as pafs

from ..core.errors import ImageChanged, StorageError
from ..core.images import IMAGES_DIR, stored_image_path
from .seam import io_seam, storage_errors
from .storage import Location

log = logging.getLogger("regen")

COPY_THREADS = 8  # images copied at once (an object store's PUT and copy wait on the network)
CHUNK = 1 << 20
LOG_EVERY_S = 30.0


def images_folder(run_dir: str | os.PathLike[str] | Location) -> Location:
    return Location.at(run_dir) / IMAGES_DIR


def image_location(run_dir: str | os.PathLike[str] | Location, part: Mapping[str, Any]) -> Location:
    """Where an image part's bytes are: its `path` (images.store: reference; a local path or a URI), else the run
    directory's copy, RUN/images/<sha[:2]>/<sha>. `run_dir`: the run directory's URI (RunDir.path.uri), which
    any node can open (an object store with its own credentials)."""
    if part.get("path"):
        return Location.at(part["path"])
    return Location.at(run_dir) / stored_image_path(part["sha256"])


def read_image(run_dir: str | os.PathLike[str] | Location, part: Mapping[str, Any]) -> bytes:
    """The bytes of an image part, as stored (the caller checks them against `part["sha256"]`). Raises
    FileNotFoundError when they are not there (on every backend), StorageError when the store fails."""
    return image_location(run_dir, part).read_bytes()


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class StagedImages:
    """The images of a prompt set being built, until it is committed. `store`: images.store (`reference`: local
    files stay where they are and are not staged; bytes are always staged)."""

    def __init__(self, folder: Path, store: str = "copy"):
        self.folder = folder / "images"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.store = store
        self._listed = open(folder / "local-images.jsonl", "wb")  # noqa: SIM115 - closed by close()
        self._listed_path = folder / "local-images.jsonl"
        self.local = 0  # local files listed, to copy
        self.held = 0  # images staged as bytes
        self.held_bytes = 0
        self.copied = self.copied_bytes = self.present = 0  # of the last commit
        self.skipped = 0  # staged images no committed prompt names (their records were rejected, or not selected)
        self.named: set[bytes] = set()  # the digests the prompts' parts name (~100 bytes an image)

    @property
    def count(self) -> int:
        return self.local + self.held

    def name(self, sha256: str) -> None:
        """A committed prompt names this image (a part without `path`): only named images are copied (the sources
        hand over each image when they read it, before they know whether its record is kept)."""
        self.named.add(bytes.fromhex(sha256))

    def add(self, sha256: str, source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> None:
        """One distinct image of the set: a local path (or URI) to copy at the commit, or its bytes (checked
        against `sha256` now: the caller hashed them)."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            target = self.folder / sha256
            if target.exists():
                return
            found = sha256_hex(source)
            if found != sha256:
                raise ValueError(f"the bytes staged as image {sha256} have sha256 {found}")
            target.write_bytes(source)
            self.held += 1
            self.held_bytes += len(source)
            return
        if self.store == "reference":
            return  # read in place when sent, from the part's `path`
        self._listed.write(orjson.dumps([sha256, os.fspath(source)]) + b"\n")
        self.local += 1

    def close(self) -> None:
        if not self._listed.closed:
            self._listed.close()

    def _sources(self) -> Iterator[tuple[str, str, bool]]:
        """(sha256, where, staged bytes?) of every staged image."""
        self.close()
        with open(self._listed_path, "rb") as listed:
            for line in listed:
                sha, path = orjson.loads(line)
                yield sha, path, False
        for entry in os.scandir(self.folder):
            yield entry.name, entry.path, True

    def commit(self, run_dir: Location, threads: int = COPY_THREADS) -> None:
        """Copy every staged image that RUN/images/ lacks (see the module docstring). Raises ImageChanged or
        StorageError; images published before the error stay (whole, named by their content)."""
        if not self.count or not self.named:
            self.skipped = self.count
            return
        folder = images_folder(run_dir)
        present = stored_names(folder)
        self.copied = self.copied_bytes = self.present = self.skipped = 0
        started = last_log = time.monotonic()
        lock = threading.Lock()
        made: set[str] = set()  # local prefix folders made by this commit

        def copy(sha: str, where: str, staged: bool) -> None:
            target = folder / stored_image_path(sha)[len(IMAGES_DIR) + 1:]
            if target.local:
                prefix = target.parent.path
                with lock:
                    if prefix not in made:
                        target.parent.mkdir()
                        made.add(prefix)
            size = copy_checked(Location.at(where), target, sha, folder, staged)
            with lock:
                self.copied += 1
                self.copied_bytes += size

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="regen-images") as pool:
            running: set = set()
            try:
                for sha, where, staged in self._sources():
                    if bytes.fromhex(sha) not in self.named:
                        self.skipped += 1
                        continue
                    if sha in present:
                        self.present += 1
                        continue
                    present.add(sha)  # a local file listed twice (never, from the sources) is copied once
                    running.add(pool.submit(copy, sha, where, staged))
                    if len(running) >= 4 * threads:
                        done, running = wait(running, return_when=FIRST_EXCEPTION)
                        for future in done:
                            future.result()
                    if time.monotonic() - last_log >= LOG_EVERY_S:
                        last_log = time.monotonic()
                        log.info("images: %d copied into %s (%.1f MB), %d already there", self.copied, folder,
                                 self.copied_bytes / 1e6, self.present)
                done, running = wait(running, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()
            finally:
                for future in running:
                    future.cancel()
        log.info("images: %d copied into %s (%.1f MB) in %.1f s, %d already there", self.copied, folder,
                 self.copied_bytes / 1e6, time.monotonic() - started, self.present)


def stored_names(folder: Location) -> set[str]:
    """The images already in RUN/images/ (one recursive listing; temporary files are not images)."""
    with storage_errors("list", folder):
        io_seam("list", folder.path)
        infos = folder.fs.get_file_info(pafs.FileSelector(folder.path, recursive=True, allow_not_found=True))
    return {os.path.basename(info.path) for info in infos
            if info.type == pafs.FileType.File and info.path.count("/") - folder.path.count("/") == 2}


def copy_checked(source: Location, target: Location, sha256: str, temp_folder: Location, staged: bool) -> int:
    """Copy `source` to `target` atomically, hashing it on the way: bytes other than `sha256` publish nothing
    and raise ImageChanged (a staged file was checked when it was staged: only a local file can change). Returns
    the bytes copied."""
    digest = hashlib.sha256()
    size = 0

    def write(sink) -> None:
        nonlocal size
        try:
            with (open(source.path, "rb") if source.local else source.fs.open_input_stream(source.path)) as src:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            raise ImageChanged(str(source), sha256, None) from None
        except OSError as exc:  # reading the source, not writing the run: said as the source's
            if staged:
                raise
            raise StorageError(f"cannot read image {source}: {exc.strerror or exc}") from exc
        if digest.hexdigest() != sha256:
            raise ImageChanged(str(source), sha256, digest.hexdigest())

    target.write_with(write, temp_folder=temp_folder)
    return size
