"""A refused command leaves the run as it was (DESIGN invariant 6, docs/resume-and-drift.md).

A command that is refused, or fails, before its first commit leaves the run's identity file (`run.json`;
capture: `capture.json`), its prompt set (`prompts/`, `rejects/`, `images/`) and its ledgers (`data/`,
`failures/`) exactly as they were; only `logs/`, the lock and `status.json` may change, and a refused new run (or
new capture) leaves no directory behind.

A start writes before it can still be refused (run.json takes a raised samples_per_prompt, a rebound config, the
preflight's pins; a refresh commits a new prompt set and its images; a new run materialises its prompt set), so
the rule is kept by undoing: `Untouched.take` notes what is there before the command writes anything, and, if the
command ends by an exception with nothing committed, `restore` puts run.json back byte for byte and removes what
the command added to the prompt set (a new run: the whole directory). A SIGKILL cannot undo anything: what it
leaves is what a killed start leaves (a run that has committed nothing takes the next config; a raised k that
no committed sample carries binds nothing: core/identity.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow.fs as pafs

from ..core.errors import LeaseLost, RunLocked, StorageError
from ..core.images import IMAGES_DIR
from .storage import Location

log = logging.getLogger("regen")

PROMPT_SET = ("prompts", "rejects", IMAGES_DIR)  # what a materialisation writes: files it added are removed
LEDGERS = ("data", "failures")  # a new file here is a commit: from then on nothing is undone
KEPT = ("logs", "run.lock", "lock.json", "status.json")  # what a refused command may change (a new run: removed)


def _files(root: Location, folder: str) -> frozenset[str]:
    """The files under root/folder, recursively, as paths relative to root (none if it does not exist)."""
    base = root / folder
    infos = base.fs.get_file_info(pafs.FileSelector(base.path, recursive=True, allow_not_found=True))
    return frozenset(f"{folder}/{info.path[len(base.path) + 1:]}" for info in infos
                     if info.type == pafs.FileType.File)


@dataclass(frozen=True)
class Untouched:
    """What a command found in a run directory (or capture directory) before it wrote anything."""

    root: Location
    manifest_name: str
    manifest: bytes | None  # None: there was no run (a new run: restore removes the directory)
    prompt_set: frozenset[str]
    ledger: frozenset[str]
    found: frozenset[str] = frozenset()  # the folder's entries, but the lock, logs and status.json

    @classmethod
    def take(cls, root: Location, manifest_name: str = "run.json") -> "Untouched":
        try:
            manifest = (root / manifest_name).read_bytes()
        except FileNotFoundError:
            manifest = None
        return cls(root, manifest_name, manifest, frozenset().union(*(_files(root, f) for f in PROMPT_SET)),
                   frozenset().union(*(_files(root, f) for f in LEDGERS)),
                   frozenset(entry.name for entry in root.iterdir()) - frozenset(KEPT))

    @property
    def new(self) -> bool:
        """No run was here, nor anything else: the undo removes the folder. A folder holding more but no run.json
        (a copy of a run still under way: `aws s3 sync` and rsync write run.json after capture/ and data/; a
        run.json deleted by hand) is never removed: only what the command added to it is."""
        return self.manifest is None and not self.found

    def committed(self) -> bool:
        """Something was committed since: a part in a ledger that was not there."""
        return bool(frozenset().union(*(_files(self.root, f) for f in LEDGERS)) - self.ledger)

    def undo_after(self, exc: BaseException) -> bool:
        """Whether a command ended by `exc` is undone: it committed nothing, and the run is still this driver's
        (a lost lease or a lock held by another driver: the run is not ours to touch)."""
        if isinstance(exc, (LeaseLost, RunLocked)):
            return False
        try:
            return not self.committed()
        except StorageError as error:
            log.warning("could not tell whether %s committed anything (%s): left as it is", self.root, error)
            return False

    def restore(self) -> list[str]:
        """Put the run back as it was; returns what was undone, in words. A new run's directory is emptied of
        everything but its lock (RunLock.remove_folder_on_release removes the folder on release)."""
        if self.new:
            removed = []
            # the manifest last: a folder cut short here still has it, so it is a run that has committed nothing
            # (store/opening.py), never a prompt set that no run.json names
            entries = sorted(self.root.iterdir(), key=lambda entry: entry.name == self.manifest_name)
            for entry in entries:
                if entry.name in ("run.lock", "lock.json"):
                    continue
                info = entry.fs.get_file_info(entry.path)
                if info.type == pafs.FileType.Directory:
                    entry.fs.delete_dir(entry.path)
                else:
                    entry.unlink()
                removed.append(entry.name)
            return [f"removed the new run's {', '.join(sorted(removed))}"] if removed else []
        undone = []
        manifest = self.root / self.manifest_name
        try:
            now = manifest.read_bytes()
        except FileNotFoundError:
            now = None
        if now != self.manifest:  # first: a kill after it leaves a prompt set run.json does not name (read again)
            if self.manifest is None:
                manifest.unlink()
                undone.append(f"{self.manifest_name} removed (there was none)")
            else:
                manifest.write_atomic(self.manifest)
                undone.append(f"{self.manifest_name} restored")
        added = sorted(frozenset().union(*(_files(self.root, f) for f in PROMPT_SET)) - self.prompt_set)
        for name in added:
            (self.root / name).unlink()
        if added:
            undone.append(f"{len(added)} file(s) this command added to the prompt set removed "
                          f"({', '.join(added[:3])}{', ...' if len(added) > 3 else ''})")
        return undone
