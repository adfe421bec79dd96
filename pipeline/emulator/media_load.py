"""Reading an image URL as SGLang's Kimi-K2.5 server does, per version, and the status and message it answers when
it cannot (utils/common.py:load_image, get_image_bytes, download_remote_media; multimodal/processors/
base_processor.py:_load_single_item, fast_load_mm_data; kimi_common.py:_load_single_item on 0.5.23;
serving_chat.py:_handle_non_streaming_request and serving_base.py:handle_request for the answer).

Where a URL is read (every version): http(s) is fetched with `requests` (3 s, REQUEST_TIMEOUT's default; from
0.5.18 by download_remote_media: redirects by hand, at most 64 MiB); `file://` and a path starting with "/" are
read from disk; `data:` and any other string are base64 (pybase64, validate=True), a relative path too, except
that 0.5.23's Kimi loader (multimodal/cache/identity.py:_read_media_bytes) reads a relative path ending in an
image extension when it is a file. Then Pillow opens the bytes. The emulator fetches only from 127.0.0.1: another
host is refused as a server that cannot reach it would (a requests ConnectionError).

The answer: a ValueError reaching the chat route is a 400 (its text), anything else a 500 ("Internal server error:
" + text). fast_load_mm_data says "An exception occurred while loading IMAGE data at index N: " + the loader's
error, which _load_single_item wraps as "Error while loading data <data, 100 chars>...: <error>". From 0.5.17 a
client error (ValueError, Pillow's UnidentifiedImageError, requests' RequestException) stays a ValueError (400);
0.5.14 makes every one a RuntimeError (500). 0.5.23's Kimi loader reads the bytes before that wrapping: a read
error is the bare text (400 only for a ValueError such as bad base64), and the wrapped data is the bytes.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlparse

from .media import (PartInvalid, SeenImage, check_parts, image_urls, media_refusal, normal_detail,
                    parse_content_hash)
from .errors import RequestInvalid
from .versions import Behaviour

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif")  # utils/common.py:image_extension_names
REQUEST_TIMEOUT = 3.0
MAX_MEDIA_BYTES = 64 * 1024 * 1024       # _DEFAULT_MEDIA_URL_MAX_FILE_SIZE_MB
MAX_REDIRECTS = 5
REDIRECTS = {301, 302, 303, 307, 308}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def prepare_media(messages: list[dict], behaviour: Behaviour, vision: bool) -> list[SeenImage] | None:
    """A chat request's parts checked as the version's models check them (400 "Bad Request"); on a text-only
    model (`vision` False) a media part refused (0.5.17+) or dropped (None); on a vision model every image read
    and decoded, in order (blocking: the server runs this in a thread). Raises RequestInvalid."""
    try:
        check_parts(messages, behaviour)
    except PartInvalid as error:
        raise RequestInvalid(str(error), 400, err_type="Bad Request") from None
    if not vision:
        refused = media_refusal(messages) if behaviour.media_refusal else None
        if refused:
            raise RequestInvalid(refused)
        return None
    return [load_image(obj, index, behaviour) for index, obj in enumerate(image_urls(messages))]


def load_image(image_url: dict, index: int, behaviour: Behaviour) -> SeenImage:
    try:
        data = read_bytes(image_url["url"], behaviour)
    except Exception as error:  # noqa: BLE001 - every loader error is an answer
        raise refusal(error, index, image_url, None, behaviour) from None
    try:
        width, height = decode(data, behaviour)
    except Exception as error:  # noqa: BLE001
        raise refusal(error, index, image_url, data, behaviour) from None
    return SeenImage(hashlib.sha256(data).hexdigest(), width, height)


def read_bytes(url: str, behaviour: Behaviour) -> bytes:
    """The bytes the version's loader reads for an image_url's url."""
    if url.startswith("file://"):
        url = unquote(urlparse(url).path)
    elif behaviour.media_snapshot_first and url.startswith(("http://", "https://", "data:")):
        return get_image_bytes(url, behaviour)
    if behaviour.media_snapshot_first and url.lower().endswith(IMAGE_EXTENSIONS) and Path(url).is_file():
        return Path(url).read_bytes()
    return get_image_bytes(url, behaviour)


def get_image_bytes(url: str, behaviour: Behaviour) -> bytes:
    """utils/common.py:get_image_bytes."""
    if url.startswith(("http://", "https://")):
        return download(url, behaviour)
    if url.startswith(("file://", "/")):
        with open(url, "rb") as f:
            return f.read()
    if url.startswith("data:"):
        _, encoded = url.split(",", 1)
        return b64decode(encoded)
    return b64decode(url)


def b64decode(text: str) -> bytes:
    """pybase64.b64decode(text, validate=True): the standard decoder, with pybase64's one error text."""
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise binascii.Error("Non-base64 digit found") from None


def decode(data: bytes, behaviour: Behaviour) -> tuple[int, int]:
    """Pillow opens and decodes the bytes (0.5.23: a failure is ValueError('Could not decode image: ...'))."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, SyntaxError) as error:
        if behaviour.decode_error_text:
            raise ValueError(f"Could not decode image: {error}") from error
        raise
    return image.size


# --- http(s) -----------------------------------------------------------------------------------------------------
def _session() -> Any:
    import requests

    session = requests.Session()
    session.trust_env = False  # a loopback fetch never goes through a proxy of the environment
    return session


def _refuse_remote(url: str) -> None:
    """The emulator reaches 127.0.0.1 only: elsewhere it fails as a server without that network does."""
    import requests

    parsed = urlparse(url)
    if parsed.hostname in LOCAL_HOSTS:
        return
    pool = "HTTPSConnectionPool" if parsed.scheme == "https" else "HTTPConnectionPool"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    raise requests.exceptions.ConnectionError(
        f"{pool}(host={parsed.hostname!r}, port={port}): Max retries exceeded with url: {parsed.path or '/'} "
        f"(Caused by NewConnectionError('the emulator fetches images only from 127.0.0.1'))")


def download(url: str, behaviour: Behaviour) -> bytes:
    if not behaviour.media_download_policy:  # 0.5.14, 0.5.17: one GET, redirects followed
        _refuse_remote(url)
        with _session() as session:
            response = session.get(url, timeout=REQUEST_TIMEOUT)
            try:
                response.raise_for_status()
                return response.content
            finally:
                response.close()
    return download_remote_media(url)


def download_remote_media(url: str) -> bytes:
    """utils/common.py:download_remote_media (0.5.18+), with no allowed-domain list (the default)."""
    import requests

    deadline = time.monotonic() + REQUEST_TIMEOUT
    current = url
    with _session() as session:
        for hop in range(MAX_REDIRECTS + 1):
            prepared = requests.Request("GET", current).prepare().url
            if prepared is None:
                raise ValueError(f"Invalid media URL: {current!r}")
            parsed = urlparse(prepared)
            if parsed.scheme not in ("http", "https") or parsed.hostname is None:
                raise ValueError(f"Invalid media URL: {prepared!r}")
            _refuse_remote(prepared)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise requests.exceptions.Timeout(f"Timed out while downloading media URL: {url}")
            with session.get(prepared, allow_redirects=False, stream=True, timeout=remaining) as response:
                location = response.headers.get("Location")
                if response.status_code in REDIRECTS and location:
                    if hop == MAX_REDIRECTS:
                        raise requests.exceptions.TooManyRedirects(
                            f"Media URL exceeded {MAX_REDIRECTS} redirects: {url}")
                    current = urljoin(response.url, location)
                    continue
                response.raise_for_status()
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > MAX_MEDIA_BYTES:
                    raise ValueError(f"Remote media exceeds the {MAX_MEDIA_BYTES} byte download limit")
                content = bytearray()
                for chunk in response.iter_content(chunk_size=64 * 1024):
                    if time.monotonic() > deadline:
                        raise requests.exceptions.Timeout(f"Timed out while downloading media URL: {url}")
                    if len(content) + len(chunk) > MAX_MEDIA_BYTES:
                        raise ValueError(f"Remote media exceeds the {MAX_MEDIA_BYTES} byte download limit")
                    content.extend(chunk)
                return bytes(content)
    raise AssertionError("unreachable")


# --- the answer ----------------------------------------------------------------------------------------------
def image_data_repr(image_url: dict, behaviour: Behaviour) -> str:
    """str() of the ImageData the chat route made of an image_url (parser/jinja_template_utils.py)."""
    content_hash = image_url.get("content_hash")
    if content_hash is not None and behaviour.content_hash:
        content_hash = parse_content_hash(content_hash, "content_hash")  # checked already: lower-cased here
    values = {"url": image_url["url"], "detail": normal_detail(image_url.get("detail"), behaviour) or "auto",
              "max_dynamic_patch": image_url.get("max_dynamic_patch"), "preprocess_kwargs": None,
              "content_hash": content_hash, "max_long_side_pixel": image_url.get("max_long_side_pixel")}
    return "ImageData(" + ", ".join(f"{k}={values[k]!r}" for k in behaviour.image_data_fields) + ")"


def _client_error(error: Exception) -> bool:
    """utils/common.py:CLIENT_MEDIA_EXCEPTIONS."""
    import requests
    from PIL import UnidentifiedImageError

    return isinstance(error, (ValueError, UnidentifiedImageError, requests.exceptions.RequestException))


def refusal(error: Exception, index: int, image_url: dict, data: bytes | None, behaviour: Behaviour) -> RequestInvalid:
    """What the chat route answers for `error`, raised reading (data None) or decoding image `index`."""
    prefix = f"An exception occurred while loading IMAGE data at index {index}: "
    if behaviour.media_snapshot_first and data is None:  # read by kimi_common's snapshot_media, unwrapped
        message, client = prefix + str(error), isinstance(error, ValueError)
    else:
        shown = str(data) if behaviour.media_snapshot_first else image_data_repr(image_url, behaviour)
        if len(shown) > 100:
            shown = shown[:100] + "..."
        message = f"{prefix}Error while loading data {shown}: {error}"
        client = behaviour.media_client_errors and _client_error(error)
    if client:
        return RequestInvalid(message, 400)
    return RequestInvalid(f"Internal server error: {message}", 500)
