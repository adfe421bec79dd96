"""The endpoint worker's images: each image part's bytes read when the prompt is sent (never held by the driver),
checked against the sha256 the prompt set recorded, and made into the URL the request carries.

Where the bytes are: a part with `path` (`images.store: reference`) at that path (local, or an object-store URI);
a part without, in the run directory at `core/images.py stored_image_path` (RUN/images/<sha[:2]>/<sha>, local or
object store). An image whose bytes differ, or are gone, fails its prompt with `ImageUnsendable` naming the image:
never sent, never silently. A storage error that may pass (an object store's glitch) is retryable. A copied image
missing because this actor's node does not see the run directory at all (a local run directory, actors on other
nodes) is no fault of the prompt: EndpointFatal, and its prompts go to the actors that see it.

One `ConversationImages` per prompt: an image read once is kept (as its URL) for the rest of that conversation, so
all_turns re-sends it at every step without reading, hashing or encoding it again; nothing is kept across prompts.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..core.errors import ConfigError, EndpointFatal, ImageUnsendable, RequestError, Retryable, StorageError
from ..endpoints.engines import OpenAIAdapter
from ..endpoints.images import DATA_URL, FILE_URL, data_url, file_url, request_messages

if TYPE_CHECKING:  # the store's modules import pyarrow (0.2 s, seconds on a loaded machine): an actor imports them
    from ..store.storage import Location  # only for a run with images

# (run directory URI, image part) -> the image's bytes. FileNotFoundError: the bytes are gone.
ImageReader = Callable[[str | None, Mapping[str, Any]], bytes]


def image_location(run_uri: str | None, part: Mapping[str, Any]) -> Location:
    """Where a part's bytes are (store/run_images.py); a copied image needs the run directory."""
    if not part.get("path") and not run_uri:
        raise ValueError(f"image {part['sha256']} has no path and the worker was given no run directory")
    from ..store.run_images import image_location as stored_image_location

    return stored_image_location(run_uri or "", part)


def read_image(run_uri: str | None, part: Mapping[str, Any]) -> bytes:
    return image_location(run_uri, part).read_bytes()


def check_send_as(send_as: str, store: str, run_uri: str) -> None:
    """A run whose copied images are on an object store cannot send them as files: refused before any prompt (else
    every image prompt would fail alike)."""
    from ..store.storage import Location

    if send_as == FILE_URL and store == "copy" and not Location.at(run_uri).local:
        raise ConfigError(f"images.send_as: file_url: the run's images are copied into {Location.at(run_uri)}, an "
                          "object store no server reads as a file; set images.send_as: data_url (the default), or "
                          "put the run on a filesystem the servers mount")


class ConversationImages:
    """The images of one conversation, as its requests carry them."""

    def __init__(self, run_uri: str | None, send_as: str = DATA_URL, engine: OpenAIAdapter | None = None,
                 endpoint: str = "", reader: ImageReader = read_image, node: str = "local"):
        if send_as not in (DATA_URL, FILE_URL):
            raise ValueError(f"images.send_as {send_as!r} is not one of {DATA_URL}, {FILE_URL}")
        self.run_uri, self.send_as, self.engine, self.endpoint = run_uri, send_as, engine, endpoint
        self.node = node  # where this actor runs (named in the messages)
        self.reader = reader
        self.urls: dict[str, str] = {}  # sha256 -> URL, for this conversation only
        self.read = 0  # images read (and hashed) for this conversation

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the request sends it (endpoints/images.py): raises ImageUnsendable or Retryable."""
        return request_messages(messages, self.url_of, self.engine)

    def url_of(self, part: Mapping[str, Any]) -> str:
        sha = part["sha256"]
        if sha not in self.urls:
            self.urls[sha] = self._url(part, self._checked_bytes(part))
        return self.urls[sha]

    def _where(self, part: Mapping[str, Any]) -> str:
        try:
            return str(image_location(self.run_uri, part))
        except ValueError:
            return "nowhere (no path, no run directory)"

    def _checked_bytes(self, part: Mapping[str, Any]) -> bytes:
        sha, where = part["sha256"], self._where(part)
        try:
            data = self.reader(self.run_uri, part)
        except (FileNotFoundError, ValueError):
            raise self._missing(part, where) from None
        except (StorageError, OSError) as exc:
            raise Retryable(f"image {sha} could not be read from {where}: {exc}", endpoint=self.endpoint) from None
        self.read += 1
        found = hashlib.sha256(data).hexdigest()
        if found != sha:
            raise ImageUnsendable(f"image {sha} changed since the prompt set was built: {where} now holds "
                                  f"{len(data)} bytes of sha256 {found}; the prompt is not sent (restore the image, "
                                  "or read the sources again with --refresh-prompts)", endpoint=self.endpoint)
        return data

    def _missing(self, part: Mapping[str, Any], where: str) -> RequestError:
        """Gone from where the prompt set put it, or a run directory this node does not see."""
        if not part.get("path") and self.run_uri:
            from ..store.storage import Location

            try:
                visible = (Location.at(self.run_uri) / "run.json").exists()
            except StorageError as exc:
                return Retryable(f"image {part['sha256']}: the run directory {self.run_uri} could not be read "
                                 f"from {self.node}: {exc}", endpoint=self.endpoint)
            if not visible:
                return EndpointFatal(
                    f"the run directory {self.run_uri} is not visible from this actor's node ({self.node}), so "
                    "the images copied into it cannot be sent from here: put the run on storage every Ray node "
                    "reaches (a shared filesystem or an object store), or place the actors on the driver's node "
                    "(the endpoint's ray_resources)", endpoint=self.endpoint)
        return ImageUnsendable(f"image {part['sha256']} is gone: nothing at {where} (read on {self.node}); the "
                               "prompt is not sent (restore the image, or read the sources again with "
                               "--refresh-prompts)", endpoint=self.endpoint)

    def _url(self, part: Mapping[str, Any], data: bytes) -> str:
        if self.send_as == DATA_URL:
            return data_url(part["media_type"], data)
        where = image_location(self.run_uri, part)
        if not where.local:
            raise ImageUnsendable(f"image {part['sha256']} is at {where}, which no server reads as a file: "
                                  "images.send_as: file_url needs images on a filesystem the servers mount "
                                  "(set images.send_as: data_url)", endpoint=self.endpoint)
        return file_url(where.path)
