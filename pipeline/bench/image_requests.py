"""`make bench` case `images`: what a 1 MB image adds to a request, on the endpoint worker's own path (issue 28).

A real-sized photo stand-in (random pixels, a 1 MB PNG) sits in a run directory; the worker's code reads it, checks
its sha256 and makes its data: URL (dispatch/images.py ConversationImages), then the run's client (EndpointClient:
the OpenAI SDK's JSON encoding and HTTP) sends the request to a local aiohttp server that reads the whole body and
answers a tiny chat answer. Figures are medians over repeated requests, against the same request without the image
(the baseline: the server's round trip and the client's own cost):
  - last_turn: read + hash + base64 + JSON + send, per request;
  - all_turns: a 4-step conversation re-sends the image at every step; the URL is kept for the conversation, so
    steps after the first pay JSON + send only;
  - the pieces: read + sha256, base64, JSON (json.dumps, as the SDK's HTTP client encodes).
Run alone: `python -m pipeline.bench --only images`, or `python -m pipeline.bench.images` (prints JSON).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

IMAGE_BYTES = 1 << 20
STEPS = 4  # all_turns: user turns of the conversation


def make_image(folder: Path) -> dict:
    """A 1 MB PNG of random pixels (PNG cannot compress noise: its size is its pixels'), copied into the run."""
    from PIL import Image

    from ..core.images import image_part, stored_image_path

    side = 592  # 592 x 592 x 3 bytes ~ 1.0 MB
    noise = Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    path = folder / "photo.png"
    noise.save(path, format="PNG", compress_level=1)
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    where = folder / stored_image_path(sha)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)
    return image_part(sha, "image/png", side, side, len(data))


async def _serve():
    from aiohttp import web

    answer = {"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    async def chat(request):
        await request.read()
        return web.json_response(answer)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


class Clock:
    """Wall and CPU time (this process: the client, and the local server reading the body) of timed sections,
    by name; medians in ms. CPU time is what a busy actor pays; wall time also waits on a loaded machine."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.wall.setdefault(name, []).append(time.perf_counter() - wall)
        self.cpu.setdefault(name, []).append(time.process_time() - cpu)

    def ms(self, name: str, cpu: bool = False) -> float:
        return statistics.median((self.cpu if cpu else self.wall)[name]) * 1000


async def measure(repeat: int = 20) -> dict:
    from ..dispatch.images import ConversationImages
    from ..endpoints.client import ClientSettings, EndpointClient
    from ..endpoints.engines import SGLangAdapter
    from ..endpoints.images import data_url

    folder = Path(tempfile.mkdtemp(prefix="regen-bench-images-"))
    part = make_image(folder)
    runner, url = await _serve()
    engine = SGLangAdapter(version="0.5.23")
    client = EndpointClient(url, "e", ClientSettings(model="m", temperature=0.0, top_p=1.0, max_tokens=8,
                                                     engines={"e": engine}))
    text = [{"role": "user", "content": "Describe the picture."}]
    with_image = [{"role": "user", "content": [part, {"type": "text", "text": "Describe the picture."}]}]
    clock = Clock()
    try:
        await client.chat(text, None)  # the connection and the SDK's first-use costs, paid before timing
        for _ in range(repeat):
            with clock("text"):
                await client.chat(text, None)
            with clock("image"):
                await client.chat(ConversationImages(str(folder), engine=engine).messages(with_image), None)
            images = ConversationImages(str(folder), engine=engine)  # all_turns: one per conversation
            history = list(with_image)
            for step in range(STEPS):
                with clock("first step" if step == 0 else "later step"):
                    await client.chat(images.messages(history), None)
                history += [{"role": "assistant", "content": "A noisy square."}, {"role": "user", "content": "More."}]
            with clock("read_hash"):
                data = (folder / "photo.png").read_bytes()
                hashlib.sha256(data).hexdigest()
            with clock("base64"):
                encoded = data_url("image/png", data)
            with clock("json"):
                json.dumps({"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": encoded}}]}]})
    finally:
        await client.close()
        await runner.cleanup()
        shutil.rmtree(folder, ignore_errors=True)
    out: dict = {"image_bytes": part["bytes"], "repeat": repeat, "steps": STEPS}
    for cpu in (False, True):
        kind = "cpu" if cpu else "wall"
        base = clock.ms("text", cpu)
        out[kind] = {"text_request_ms": base, "image_request_ms": clock.ms("image", cpu),
                     "added_per_request_ms": clock.ms("image", cpu) - base,
                     "all_turns_first_step_added_ms": clock.ms("first step", cpu) - base,
                     "all_turns_later_step_added_ms": clock.ms("later step", cpu) - base,
                     **{f"{k}_ms": clock.ms(k, cpu) for k in ("read_hash", "base64", "json")}}
    return out


def image_request_cost(ctx):
    from .cases import Result

    measured = asyncio.run(measure(5 if ctx.quick else 20))
    wall, cpu = measured["wall"], measured["cpu"]
    res = Result("images")
    mb = measured["image_bytes"] / 1e6
    res.rows += [
        (f"a {mb:.1f} MB image added to one request (read, sha256, base64, JSON, send), wall / CPU",
         f"{wall['added_per_request_ms']:.1f} / {cpu['added_per_request_ms']:.1f} ms (text alone "
         f"{wall['text_request_ms']:.1f} ms)", "", None),
        ("all_turns: added at the first step / at each later step (URL kept per conversation), CPU",
         f"{cpu['all_turns_first_step_added_ms']:.1f} / {cpu['all_turns_later_step_added_ms']:.1f} ms", "", None),
        ("pieces: read + sha256 / base64 / json.dumps of the request, CPU",
         f"{cpu['read_hash_ms']:.1f} / {cpu['base64_ms']:.1f} / {cpu['json_ms']:.1f} ms", "", None)]
    res.notes.append(f"medians of {measured['repeat']} requests ({measured['steps']}-step conversations) to a local "
                     "aiohttp server in the same process, through EndpointClient: the server's reading of the body "
                     "is in the CPU figures, its image decoding and the model's work are not.")
    return res


if __name__ == "__main__":
    sys.stdout.write(json.dumps(asyncio.run(measure()), indent=1) + "\n")
