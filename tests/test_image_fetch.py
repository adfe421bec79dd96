"""The http(s) image fetcher run.py hands to the prompt set's build (endpoints/image_fetch.py), against a real HTTP
server on 127.0.0.1: bytes once, a typed error with the status, a timeout, a retried transient failure, redirects to
http(s) only, and `images.remote: refuse` hands no fetcher."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.core.config_sections import Images
from pipeline.core.errors import ImageFetchFailed
from pipeline.endpoints import image_fetch
from pipeline.endpoints.image_fetch import fetch_image, image_fetcher
from tests.helpers import wait_for

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(image_fetch, "RETRY_S", 0.01)
    release = threading.Event()
    hits: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            hits[self.path] = hits.get(self.path, 0) + 1
            if self.path == "/ok.png" or (self.path == "/flaky.png" and hits[self.path] > 1):
                self.send_response(200)
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)
            elif self.path == "/flaky.png":
                self.send_error(503)
            elif self.path == "/to-ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/x.png")
                self.end_headers()
            elif self.path == "/to-ok":
                self.send_response(301)
                self.send_header("Location", "/ok.png")
                self.end_headers()
            elif self.path == "/stuck.png":
                release.wait(30)  # answers nothing until the test ends
            else:
                self.send_error(404)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}", hits
    release.set()
    httpd.shutdown()
    httpd.server_close()


def test_an_image_is_fetched_once_and_a_missing_one_is_a_typed_error_with_its_status(server):
    base, hits = server
    fetch = image_fetcher(Images())
    assert fetch(f"{base}/ok.png") == PNG and hits["/ok.png"] == 1
    with pytest.raises(ImageFetchFailed) as err:
        fetch(f"{base}/gone.png")
    assert err.value.status == 404 and err.value.url == f"{base}/gone.png" and hits["/gone.png"] == 1, \
        "a 404 is not tried again"
    assert fetch(f"{base}/to-ok") == PNG, "a redirect to http(s) is followed"


def test_a_transient_failure_is_tried_once_more_and_a_stuck_server_times_out(server):
    base, hits = server
    assert fetch_image(f"{base}/flaky.png", timeout_s=5, max_bytes=1 << 20) == PNG and hits["/flaky.png"] == 2
    with pytest.raises(ImageFetchFailed) as err:
        fetch_image(f"{base}/stuck.png", timeout_s=0.3, max_bytes=1 << 20)
    assert err.value.status is None
    # the server counts a request when its thread reads it: on a loaded machine, maybe after the client gave up
    wait_for(lambda: hits.get("/stuck.png") == 2, 30, what="the stuck server to have been asked twice")


def test_only_http_is_fetched_and_never_more_than_max_bytes_plus_one(server):
    base, _ = server
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x.png", "data:image/png;base64,AAAA"):
        with pytest.raises(ImageFetchFailed, match="not an http"):
            fetch_image(url, timeout_s=1, max_bytes=10)
    with pytest.raises(ImageFetchFailed, match="only http") as err:
        fetch_image(f"{base}/to-ftp", timeout_s=30, max_bytes=10)
    assert err.value.status == 302
    assert fetch_image(f"{base}/ok.png", timeout_s=5, max_bytes=100) == PNG[:101], "the reader rejects it as too large"
    assert image_fetcher(Images(remote="refuse")) is None, "images.remote: refuse hands no fetcher to the build"
