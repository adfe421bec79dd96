"""Small real images for the image-prompt tests: made with Pillow in memory, sent as data: URLs, files or over a
local HTTP server (ImageServer, 127.0.0.1 only: the emulator fetches nothing else)."""
from __future__ import annotations

import base64
import http.server
import io
import threading
from typing import Any

from PIL import Image

MODEL = "moonshotai/Kimi-K2.5"


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def jpeg(width: int, height: int, color: tuple[int, int, int] = (30, 120, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "JPEG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str, **extra: Any) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def image_chat(*parts: dict | str, max_tokens: int = 64, **extra: Any) -> dict:
    """A chat body with one user message of `parts` (a str is a text part); thinking off, prompt ids returned."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "chat_template_kwargs": {"thinking": False}, "return_prompt_token_ids": True, **extra}


class ImageServer:
    """Serves `files` ({path: bytes}) on 127.0.0.1; any other path is a 404. Bound when made, so a request can
    reach it at once."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N805 - the handler, not the server
                data = self.files.get(handler.path)
                if data is None:
                    handler.send_error(404)
                    return
                handler.send_response(200)
                handler.send_header("Content-Type", "image/png")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def log_message(handler, *args: Any) -> None:  # noqa: N805
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "ImageServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
