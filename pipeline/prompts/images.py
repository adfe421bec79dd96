"""Read one image reference of a source into an image part (core/images.py), checked with Pillow.

A reference, as the sources write it (parts.py and image_records.py find them):
- a path, relative to the source's image folder (spec.py `image_folder`: `image_root`, else the data file's
  folder), or absolute; a `file://` URL;
- a `data:` URL (base64 or percent-encoded);
- a `datasets` Image value `{"bytes", "path"}`: the bytes win, a path alone is read as a path; raw bytes;
- an http(s) URL: fetched once while the prompt set is materialised, through the `fetch` callable the caller
  passes in (the prompts stage does no HTTP: it is made in endpoints/), or refused (`images.remote: refuse`).
Every local file must lie in the image folder once `..` and symbolic links are resolved (realpath).

The checks, in order, each a reject code (records.py) whose reason names the record and the reference:
missing (`image_missing`), outside the folder (`image_outside_root`), unreadable (`image_unreadable`: permissions,
a folder, a truncated or corrupt file, bad base64), over `images.max_bytes` before it is read (`image_too_large`),
not an image Pillow identifies (`not_an_image`), not a format sent or animated (`image_format`: video is out of
scope), over `images.max_pixels` from its header, before any decoding (`image_too_large`; Pillow's
decompression-bomb guard is set to the same limit), then its data: a JPEG that ends with its end-of-image marker
is whole (entropy-coded data cannot hold the marker), one that does not is decoded at 1/8 scale (every byte is
read: a file cut short fails, one with data after its end passes); a PNG's chunks are checked against their CRCs
(`verify`); GIF, WebP and BMP are decoded. Corrupt data inside a whole JPEG is not found (libjpeg only warns
on it; the servers' Pillow decodes it the same way). The sha256 is taken over the bytes as read.

Where the bytes go: under `images.store: reference` a local file's part carries `path` (its realpath) and nothing
is copied; otherwise the bytes are handed to `add_image(sha256, source)` (the PromptSink's, prompt_set.py) once
per sha256: a local file by its path (the store copies it and checks its hash), data:, http(s) and `datasets` bytes
as bytes. Nothing holds more than one image's bytes at a time.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import stat
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from PIL import Image, UnidentifiedImageError

from ..core.config_sections import Images
from ..core.errors import ImageFetchFailed
from ..core.images import MEDIA_TYPES, image_part
from .parts import IMAGE_REF
from .records import InvalidRecord, RejectCode, Tally

Fetch = Callable[[str], bytes]  # an http(s) URL -> its body (at most max_bytes + 1 of it); raises ImageFetchFailed
AddImage = Callable[[str, "str | bytes"], None]  # PromptSink.add_image
JPEG_END = b"\xff\xd9"  # EOI: entropy-coded data never holds it (a 0xFF there is followed by 0x00 or a restart)
FORMAT_ALIASES = {"MPO": "JPEG"}  # a camera's multi-picture JPEG: its first picture is a plain JPEG
CACHED = 65536  # parts of local files and URLs kept, so an image several records share is read once
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class _Refused(Exception):
    def __init__(self, code: RejectCode, problem: str):
        super().__init__(problem)
        self.code, self.problem = code, problem


class _Cache(OrderedDict):
    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        if len(self) > CACHED:
            self.popitem(last=False)


def shown(ref: Any) -> str:
    """A reference as a reason names it: a data: URL by its header and length, bytes by their count."""
    if isinstance(ref, str):
        if ref.startswith("data:"):
            return f"'{ref[:ref.find(',') + 1 if ',' in ref else 30]}...' ({len(ref):,} characters)"
        return repr(ref if len(ref) <= 200 else ref[:200] + "...")
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return f"of {len(ref['bytes']):,} bytes" + (f" ({ref['path']!r})" if ref.get("path") else "")
        return shown(ref.get("path") or ref.get("url"))
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return f"of {len(ref):,} bytes"
    return f"{ref!r}"


def check_folder(root: Path | None) -> str | None:
    """Why an image folder cannot be used (None: it can)."""
    if root is not None and not root.is_dir():
        return f"image_root {root} is not a folder"
    return None


class ImageReader:
    """Reads the image references of normalised messages into image parts, under the run's `images` settings."""

    def __init__(self, settings: Images | None = None, fetch: Fetch | None = None, add_image: AddImage | None = None,
                 unfetched_stand_in: bool = False):
        """`unfetched_stand_in` (regen validate, which contacts nothing): an http(s) image is not fetched; a part
        standing in for it is made, so the record is judged on the rest."""
        self.settings = settings or Images()
        self.fetch, self.add_image, self.stand_in = fetch, add_image, unfetched_stand_in
        Image.MAX_IMAGE_PIXELS = self.settings.max_pixels  # Pillow's own guard, for any decoding in this process
        self._handed: set[bytes] = set()  # the sha256 digests given to add_image
        self._files: _Cache = _Cache()  # realpath -> part
        self._urls: _Cache = _Cache()  # URL -> part, or the _Refused it gave
        self._roots: dict[Path, str] = {}  # image folder -> its realpath

    # --- a conversation ------------------------------------------------------------------------------------
    def resolve(self, messages: tuple[dict[str, Any], ...], root: Path | None,
                tally: Tally) -> tuple[dict[str, Any], ...]:
        """The messages with every image reference read into an image part; raises InvalidRecord (whose
        `reason_of(origin)` names the record)."""
        count = sum(1 for m in messages if type(m["content"]) is list
                    for p in m["content"] if p["type"] != "text")
        if count > self.settings.max_per_prompt:
            raise InvalidRecord(RejectCode.TOO_MANY_IMAGES, f"the prompt holds {count} images, over "
                                                            f"images.max_per_prompt {self.settings.max_per_prompt}")
        out = []
        for m in messages:
            content = m["content"]
            if type(content) is list and any(p["type"] == IMAGE_REF for p in content):
                m = {**m, "content": [self.part(p, root, tally) if p["type"] == IMAGE_REF else p
                                      for p in content]}
            out.append(m)
        if count:
            tally.image("prompts_with_images")
        return tuple(out)

    def part(self, ref_part: dict[str, Any], root: Path | None, tally: Tally) -> dict[str, Any]:
        """One image reference (parts.py's image_ref) read into an image part; raises InvalidRecord."""
        ref, at = ref_part["ref"], ref_part.get("at")
        where = f"message {at}: " if at else ""
        if ref is None:
            raise InvalidRecord(RejectCode.IMAGE_MARKER_MISMATCH,
                                f"{where}an image part holds no image, and the record has no images field to fill it")
        try:
            part, kind = self._read(ref, root)
        except _Refused as refused:
            raise InvalidRecord(refused.code, f"{where}the image {shown(ref)} {refused.problem}") from None
        tally.image("images")
        tally.image(f"from_{kind}")
        tally.image("image_bytes", part["bytes"])
        return dict(part)

    # --- one reference -------------------------------------------------------------------------------------
    def _read(self, ref: Any, root: Path | None) -> tuple[dict[str, Any], str]:
        if isinstance(ref, dict):
            data = ref.get("bytes")
            if data:
                return self._bytes(bytes(data)), "dataset_bytes"
            if ref.get("path") or ref.get("url"):
                return self._read(ref.get("path") or ref.get("url"), root)
            raise _Refused(RejectCode.IMAGE_MISSING, "holds neither bytes nor a path")
        if isinstance(ref, (bytes, bytearray, memoryview)):
            return self._bytes(bytes(ref)), "dataset_bytes"
        if not isinstance(ref, str):
            raise _Refused(RejectCode.NOT_AN_IMAGE, f"is a {type(ref).__name__}, not an image reference")
        if not ref.strip():
            raise _Refused(RejectCode.IMAGE_MISSING, "is an empty path")
        if ref.startswith("data:"):
            return self._bytes(self._data_url(ref)), "data_url"
        scheme = _SCHEME.match(ref)
        if scheme is None:
            return self._file(ref, root), "files"
        name = scheme.group(1).lower()
        if name in ("http", "https"):
            return self._remote(ref), "http"
        if name == "file":
            url = urlsplit(ref)
            if url.netloc not in ("", "localhost"):
                raise _Refused(RejectCode.REMOTE_IMAGE, f"names the host {url.netloc!r}: a file:// URL is read "
                                                        "from this machine")
            return self._file(unquote(url.path), root), "files"
        raise _Refused(RejectCode.REMOTE_IMAGE, f"is a {name}:// URL, which regen does not read (it reads paths, "
                                                "file://, data: and http(s) URLs)")

    def _file(self, path: str, root: Path | None) -> dict[str, Any]:
        full = Path(path)
        if not full.is_absolute():
            if root is None:
                raise _Refused(RejectCode.IMAGE_MISSING, "is a relative path, and the source has no folder to read "
                                                         "it from (a hub dataset): set the spec's `image_root`")
            full = root / full
        real = os.path.realpath(full)
        real_root = self._real_root(root)
        if real_root is None or not (real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)):
            inside = f"outside image_root {real_root}" if real_root else "and the source has no image_root"
            raise _Refused(RejectCode.IMAGE_OUTSIDE_ROOT, f"resolves to {real}, {inside} (through `..` or a "
                                                          "symbolic link, or an absolute path): set the spec's "
                                                          "`image_root` to a folder that holds it")
        cached = self._files.get(real)
        if cached is not None:
            return cached
        data = self._read_file(real)
        media_type, width, height = self._inspect(data)
        sha = hashlib.sha256(data).hexdigest()
        if self.settings.store == "reference":
            part = image_part(sha, media_type, width, height, len(data), path=real)
        else:
            part = image_part(sha, media_type, width, height, len(data))
            self._hand(sha, real)
        self._files.put(real, part)
        return part

    def _read_file(self, real: str) -> bytes:
        limit = self.settings.max_bytes
        try:
            with open(real, "rb") as fh:
                info = os.fstat(fh.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise _Refused(RejectCode.IMAGE_UNREADABLE, f"is not a file ({real})")
                if info.st_size > limit:
                    raise _Refused(RejectCode.IMAGE_TOO_LARGE, f"is {info.st_size:,} bytes, over images.max_bytes "
                                                               f"{limit:,}")
                data = fh.read(limit + 1)
        except (FileNotFoundError, NotADirectoryError):
            raise _Refused(RejectCode.IMAGE_MISSING, f"is not there (looked for {real})") from None
        except IsADirectoryError:
            raise _Refused(RejectCode.IMAGE_UNREADABLE, f"is a folder ({real})") from None
        except OSError as exc:  # permission denied, an I/O error
            raise _Refused(RejectCode.IMAGE_UNREADABLE,
                           f"cannot be read ({real}: {exc.strerror or type(exc).__name__})") from None
        if len(data) > limit:  # it grew since its size was read
            raise _Refused(RejectCode.IMAGE_TOO_LARGE, f"is over images.max_bytes {limit:,}")
        return data

    def _real_root(self, root: Path | None) -> str | None:
        if root is None:
            return None
        if root not in self._roots:
            self._roots[root] = os.path.realpath(root)
        return self._roots[root]

    def _data_url(self, ref: str) -> bytes:
        header, comma, payload = ref[5:].partition(",")
        if not comma:
            raise _Refused(RejectCode.IMAGE_UNREADABLE, "is a data: URL without its comma")
        if "base64" not in header.lower().split(";")[1:]:
            return unquote_to_bytes(payload)
        if len(payload) * 3 // 4 > self.settings.max_bytes + 2:
            raise _Refused(RejectCode.IMAGE_TOO_LARGE, f"holds about {len(payload) * 3 // 4:,} bytes, over "
                                                       f"images.max_bytes {self.settings.max_bytes:,}")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            try:  # base64 written in lines
                return base64.b64decode("".join(payload.split()), validate=True)
            except binascii.Error:
                raise _Refused(RejectCode.IMAGE_UNREADABLE, "is a data: URL whose base64 does not decode") from None

    def _remote(self, url: str) -> dict[str, Any]:
        if self.settings.remote == "refuse":
            raise _Refused(RejectCode.REMOTE_IMAGE, "is an http(s) URL, refused by images.remote: refuse")
        cached = self._urls.get(url)
        if isinstance(cached, _Refused):
            raise cached
        if cached is not None:
            return cached
        if self.fetch is None:
            if self.stand_in:
                return image_part(hashlib.sha256(url.encode()).hexdigest(), "", 0, 0, 0)
            raise _Refused(RejectCode.REMOTE_IMAGE, "is an http(s) URL, and nothing fetches images here (regen "
                                                    "generate fetches them once, when it materialises the prompt set)")
        try:
            try:
                data = self.fetch(url)
            except ImageFetchFailed as exc:
                status = f" (HTTP {exc.status})" if exc.status is not None else ""
                raise _Refused(RejectCode.REMOTE_IMAGE, f"could not be fetched: {exc.cause}{status}") from None
            part = self._bytes(data)
        except _Refused as refused:
            self._urls.put(url, refused)
            raise
        self._urls.put(url, part)
        return part

    def _bytes(self, data: bytes) -> dict[str, Any]:
        """Bytes that are copied into the run: data: URLs, http(s) bodies, `datasets` bytes."""
        if len(data) > self.settings.max_bytes:
            raise _Refused(RejectCode.IMAGE_TOO_LARGE, f"is {len(data):,} bytes, over images.max_bytes "
                                                       f"{self.settings.max_bytes:,}")
        media_type, width, height = self._inspect(data)
        sha = hashlib.sha256(data).hexdigest()
        self._hand(sha, data)
        return image_part(sha, media_type, width, height, len(data))

    def _hand(self, sha: str, source: str | bytes) -> None:
        if self.add_image is None:
            return
        digest = bytes.fromhex(sha)
        if digest not in self._handed:
            self._handed.add(digest)
            self.add_image(sha, source)

    # --- Pillow ----------------------------------------------------------------------------------------------
    def _inspect(self, data: bytes) -> tuple[str, int, int]:
        """(media type, width, height) of an image's bytes, or _Refused."""
        limit = self.settings.max_pixels
        bomb = (f"has more than twice images.max_pixels {limit:,} pixels (refused by Pillow's decompression-bomb "
                "guard, before decoding)")
        with warnings.catch_warnings():  # over max_pixels: the check below says by how much; over twice: Pillow's error
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(data))
            except UnidentifiedImageError:
                raise _Refused(RejectCode.NOT_AN_IMAGE, "is not an image (Pillow cannot identify it)") from None
            except Image.DecompressionBombError:
                raise _Refused(RejectCode.IMAGE_TOO_LARGE, bomb) from None
            except Exception as exc:  # noqa: BLE001 - Pillow's plugins raise many types on a broken header
                raise _Refused(RejectCode.IMAGE_UNREADABLE, f"cannot be read ({type(exc).__name__}: {exc})") from None
            with image:
                fmt = FORMAT_ALIASES.get(image.format, image.format)
                if fmt not in MEDIA_TYPES:
                    raise _Refused(RejectCode.IMAGE_FORMAT, f"is a {image.format} image; the formats sent are "
                                                            f"{', '.join(MEDIA_TYPES)}")
                width, height = image.size
                if width * height > limit:
                    raise _Refused(RejectCode.IMAGE_TOO_LARGE, f"is {width}x{height} pixels, over images.max_pixels "
                                                               f"{limit:,}")
                try:
                    if fmt == image.format and getattr(image, "is_animated", False):
                        raise _Refused(RejectCode.IMAGE_FORMAT, f"is an animated {fmt} ({image.n_frames} frames): "
                                                                "video is out of scope")
                    if fmt == "PNG":
                        image.verify()
                    elif fmt != "JPEG" or not data.rstrip(b"\x00").endswith(JPEG_END):
                        if fmt == "JPEG":  # no end marker last: cut short, or data after it; decoding says which
                            image.draft(None, (max(1, width // 8), max(1, height // 8)))
                        image.load()
                except _Refused:
                    raise
                except Image.DecompressionBombError:
                    raise _Refused(RejectCode.IMAGE_TOO_LARGE, bomb) from None
                except Exception as exc:  # noqa: BLE001 - the decoders raise OSError, SyntaxError, ValueError...
                    raise _Refused(RejectCode.IMAGE_UNREADABLE,
                                   f"is cut short or corrupt ({type(exc).__name__}: {exc})") from None
        return MEDIA_TYPES[fmt], width, height
