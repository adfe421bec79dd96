"""Image parts as a request carries them: OpenAI `image_url` parts, each with a `data:` URL (the default: any fleet)
or a `file://` URL (`images.send_as: file_url`: the servers read the same storage), plus what the endpoint's engine
declares beside `url` (SGLang's `content_hash`, engines/sglang.py). Text parts go as `{"type": "text", "text"}`,
string contents as they are. Pure: the bytes are read and checked by the endpoint worker (dispatch/images.py).

SGLang reads both URL kinds in every checked version (utils/common.py load_image: `data:` decoded, `file://` read
from the server's own disk, no flag); vLLM reads `file://` only under --allowed-local-media-path.
"""
from __future__ import annotations

import base64
import functools
import io
import pathlib
from typing import Any, Callable, Mapping

from ..core.images import IMAGE, TEXT, is_parts
from .engines import OpenAIAdapter

DATA_URL, FILE_URL = "data_url", "file_url"
PROBE_SIDE = 8  # the preflight's probe image: an 8x8 PNG


def data_url(media_type: str, data: bytes) -> str:
    """`data:<media type>;base64,<bytes>`: what SGLang's and vLLM's loaders decode."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def file_url(path: str) -> str:
    """`file://` + the absolute path, percent-encoded (SGLang unquotes the URL's path; vLLM url2pathname's it)."""
    return pathlib.Path(path).absolute().as_uri()


def image_url_part(url: str, sha256: str, engine: OpenAIAdapter | None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **(engine or OpenAIAdapter()).image_url_extras(sha256)}}


def request_content(content: Any, url_of: Callable[[Mapping[str, Any]], str],
                    engine: OpenAIAdapter | None) -> Any:
    """A message's content as the request carries it: a string (or None) as it is; parts in order, each image by
    `url_of(part)` (the worker's: it reads and checks the bytes)."""
    if not is_parts(content):
        return content
    out: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == TEXT:
            out.append({"type": "text", "text": part["text"]})
        elif part["type"] == IMAGE:
            out.append(image_url_part(url_of(part), part["sha256"], engine))
        else:
            raise ValueError(f"a content part of type {part['type']!r}: regen sends text and image parts only")
    return out


def request_messages(messages: list[dict[str, Any]], url_of: Callable[[Mapping[str, Any]], str],
                     engine: OpenAIAdapter | None) -> list[dict[str, Any]]:
    """The conversation as sent: every message whose content is parts gets its request form (a new dict: the
    worker's messages, which the record builder replays, are left as they are); the others go as they are."""
    if not any(is_parts(m.get("content")) for m in messages):
        return messages  # a text conversation: as it is
    return [m if not is_parts(m.get("content")) else {**m, "content": request_content(m["content"], url_of, engine)}
            for m in messages]


@functools.cache
def probe_png() -> bytes:
    """The preflight's tiny image: an 8x8 PNG, made once."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (PROBE_SIDE, PROBE_SIDE), (200, 40, 40)).save(out, format="PNG")
    return out.getvalue()
