"""http(s) images, fetched once while the prompt set is read (`images.remote: fetch`): their bytes are then copied
into the run like any image, so a 55-hour run never depends on a URL that may change. The prompts layer may not
do HTTP: run.py makes the fetcher here and hands it to the build (store/promptset.py stage_prompt_set), which
passes it to the sources' image reader; `images.remote: refuse` hands none.

A failure is ImageFetchFailed (core/errors.py) with the HTTP status where the server answered, which the reader
turns into a `remote_image` reject of the record. A transient failure (no answer, a timeout, 408/429/5xx) is tried
once more. At most `max_bytes` + 1 bytes are read: the reader rejects a larger image as `image_too_large`.
"""
from __future__ import annotations

import functools
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from .. import __version__
from ..core.config import Images
from ..core.errors import RETRYABLE_STATUS, ImageFetchFailed

SCHEMES = ("http", "https")
ATTEMPTS = 2
RETRY_S = 1.0
CHUNK = 1 << 16


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are followed to http(s) only (urllib would also follow one to ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in SCHEMES:
            raise ImageFetchFailed(req.full_url, f"redirected to {newurl!r}: only http(s) images are fetched", code)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects())


def fetch_image(url: str, timeout_s: float, max_bytes: int) -> bytes:
    """The bytes at an http(s) URL (at most max_bytes + 1 of them), within `timeout_s` for the whole fetch."""
    if urllib.parse.urlsplit(url).scheme.lower() not in SCHEMES:
        raise ImageFetchFailed(url, "not an http(s) URL")
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _fetch_once(url, timeout_s, max_bytes)
        except ImageFetchFailed as exc:
            transient = exc.status is None or exc.status in RETRYABLE_STATUS
            if attempt == ATTEMPTS or not transient:
                raise
            time.sleep(RETRY_S)
    raise AssertionError("unreachable")


def _fetch_once(url: str, timeout_s: float, max_bytes: int) -> bytes:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": f"regen/{__version__}", "Accept": "image/*"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            data = bytearray()
            while len(data) <= max_bytes:
                chunk = response.read1(min(CHUNK, max_bytes + 1 - len(data)))  # what has come: a drip meets the deadline
                if not chunk:
                    break
                data += chunk
                if time.monotonic() > deadline:
                    raise ImageFetchFailed(url, f"not fetched within images.fetch_timeout_s ({timeout_s:g} s)")
            return bytes(data)
    except urllib.error.HTTPError as exc:
        raise ImageFetchFailed(url, str(exc.reason), exc.code) from None
    except urllib.error.URLError as exc:
        raise ImageFetchFailed(url, str(exc.reason)) from None
    except (TimeoutError, http.client.HTTPException, ConnectionError) as exc:
        raise ImageFetchFailed(url, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    except ValueError as exc:  # a URL urllib cannot parse
        raise ImageFetchFailed(url, str(exc)) from None


def image_fetcher(images: Images) -> Callable[[str], bytes] | None:
    """The fetcher the prompt set's build gets: None under `images.remote: refuse` (http(s) images rejected)."""
    if images.remote != "fetch":
        return None
    return functools.partial(fetch_image, timeout_s=images.fetch_timeout_s, max_bytes=images.max_bytes)
