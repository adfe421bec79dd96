"""`regen validate`'s count of images: in the records it reads, the images read, how many are distinct (by their
sha256), by format, and the records rejected for an image, by reason, so a missing COCO folder or a wrong
`image_root` shows before a 55-hour run. Pure: it counts normalised messages and reject codes.

The probe (probe.py, which reads each record's images as generate does) holds one per source: `add` the messages
its image reader resolved for a kept record, `reject` each record's code, and print `lines()` under its summary."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..core.images import images_of
from .records import RejectCode

# the reject codes about an image (prompts/records.py; the contract's list, and any later one naming an image)
IMAGE_CODES = frozenset({"image_missing", "image_unreadable", "not_an_image", "image_format", "image_outside_root",
                         "image_marker_mismatch", "image_too_large", "too_many_images", "remote_image"}
                        | {code.value for code in RejectCode if "image" in code.value})


@dataclass
class ImageCensus:
    images: int = 0  # image parts read (an image in two records counts twice)
    prompts: int = 0  # records with an image
    by_format: Counter = field(default_factory=Counter)  # media type -> images
    rejects: Counter = field(default_factory=Counter)  # image reject code -> records
    _seen: set[bytes] = field(default_factory=set)  # the distinct images' digests (32 bytes each)

    @property
    def distinct(self) -> int:
        return len(self._seen)

    def add(self, messages: Iterable[Mapping[str, Any]]) -> None:
        """A record kept: count its image parts."""
        parts = images_of(messages)
        if not parts:
            return
        self.prompts += 1
        for part in parts:
            self.images += 1
            self.by_format[part.get("media_type") or "unknown"] += 1
            self._seen.add(bytes.fromhex(part["sha256"]))

    def reject(self, code: str) -> None:
        """A record rejected: counted here when the reason is an image's."""
        if code in IMAGE_CODES:
            self.rejects[code] += 1

    def lines(self, indent: str = "  ") -> list[str]:
        """What the probe's own image line (images read, bytes) does not say: distinct images, formats, rejects."""
        if not self.images and not self.rejects:
            return []
        formats = ", ".join(f"{media.removeprefix('image/')} {n}" for media, n in self.by_format.most_common())
        line = f"{indent}distinct images {self.distinct} of {self.images}" + (f" ({formats})" if formats else "")
        if self.rejects:
            line += "; records rejected for an image: " + ", ".join(
                f"{code} {n}" for code, n in self.rejects.most_common())
        return [line]
