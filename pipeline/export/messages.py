"""A record's messages as the exports read them, and where each image's bytes are for a trainer.

Records hold each message as a Parquet struct row; `message_of` turns it back into the normalised message
(core/images.py): `content` a string, or a list of parts when the message has parts (records schema 6: `parts`
beside a null `content`, each part with the keys it has), with the tool keys only where present. An image part's
bytes are at `part["path"]` (images.store: reference) or in the run directory at `stored_image_path(sha256)`
(images.store: copy); a trainer
reads them from its own filesystem, so `ImagePaths` rewrites a path's prefix (`--image-prefix OLD=NEW`) and
refuses a path that is not an absolute local one after that (an object-store URI: no trainer opens it).
"""
from __future__ import annotations

import posixpath
from typing import Any, Iterable, Mapping

from ..core.errors import ConfigError
from ..core.images import IMAGE, has_images, is_parts, stored_image_path
from ..prompts.tool_calls import message_from_row
from ..store.storage import Location


class ImagePathError(ConfigError):
    """An image's path cannot be given to a trainer as an absolute local path (e.g. an object-store URI)."""


def message_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """A MESSAGE struct row of any records schema as the normalised message (prompts/tool_calls.py)."""
    return message_from_row(row)


def normalise_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its messages normalised (in place; returned for chaining)."""
    record["messages"] = [message_of(m) for m in record.get("messages") or []]
    return record


def record_has_images(record: Mapping[str, Any]) -> bool:
    return has_images(record.get("messages") or [])


def image_label(part: Mapping[str, Any]) -> str:
    """How the card and the summaries show an image: `[image WxH]`."""
    return f"[image {part.get('width')}x{part.get('height')}]"


def content_with_labels(content: Any) -> str:
    """A message's text with each image as its label (the card's examples)."""
    if not is_parts(content):
        return content or ""
    return "\n".join(image_label(p) if p["type"] == IMAGE else (p.get("text") or "") for p in content)


def parse_prefixes(specs: Iterable[str] | None) -> list[tuple[str, str]]:
    """`OLD=NEW` pairs (the CLI's --image-prefix, repeatable), the longest OLD first."""
    pairs = []
    for spec in specs or ():
        old, sep, new = spec.partition("=")
        if not sep or not old:
            raise ConfigError(f"--image-prefix {spec!r}: expected OLD=NEW (a path prefix of the run's images, and "
                              "the same folder as the trainer's machines see it)")
        pairs.append((old, new))
    return sorted(pairs, key=lambda pair: -len(pair[0]))


class ImagePaths:
    """The absolute path a trainer opens for each image part of one run."""

    def __init__(self, run_path: Location, prefixes: list[tuple[str, str]] | None = None):
        self.run = str(run_path) if run_path.local else run_path.uri
        self.prefixes = prefixes or []
        self.rewritten = 0  # image parts whose path a prefix rewrote

    def stored(self, part: Mapping[str, Any]) -> str:
        """Where regen reads the image: its `path` (reference), else the run directory's copy."""
        return part.get("path") or posixpath.join(self.run, stored_image_path(part["sha256"]))

    def path_of(self, part: Mapping[str, Any]) -> str:
        where = self.stored(part)
        for old, new in self.prefixes:
            if _under(where, old):  # a whole folder: /data/run does not rewrite /data/run2/...
                where = new.rstrip("/") + where[len(old.rstrip("/")):]
                self.rewritten += 1
                break
        if "://" in where or not posixpath.isabs(where):
            raise ImagePathError(
                f"image {part['sha256'][:12]}... is at {where}, which a trainer cannot open as a local file: give "
                "--image-prefix OLD=NEW to map it to the folder the trainer's machines see (e.g. a mount of the "
                "bucket, or a copy of RUN/images)")
        return where


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")
