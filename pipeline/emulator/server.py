"""The aiohttp application and the server entry point (`main`)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from . import routes_gen as g
from . import routes_info as i
from .config import EmulatorConfig, build_parser, config_from_args
from .state import ServerState

log = logging.getLogger("pipeline.emulator")


def build_app(cfg: EmulatorConfig) -> web.Application:
    """The emulator as an aiohttp Application (its state lives in app[STATE_KEY])."""
    app = web.Application(client_max_size=1 << 30)
    state = ServerState(cfg)
    app[g.STATE_KEY] = state
    r = app.router
    r.add_post("/v1/chat/completions", g.chat_completions)
    r.add_post("/generate", g.generate_native)
    for path, handler in (("/health", i.health), ("/health_generate", i.health_generate),
                          ("/get_model_info", i.get_model_info), ("/model_info", i.get_model_info),
                          ("/get_server_info", i.get_server_info), ("/server_info", i.get_server_info),
                          ("/v1/models", i.list_models), ("/metrics", i.metrics)):
        r.add_get(path, handler)
    r.add_post("/flush_cache", i.flush_cache)
    r.add_post("/v1/tokenize", i.tokenize)
    r.add_post("/tokenize", i.tokenize)
    r.add_route("GET", "/admin/faults", i.admin_faults)
    r.add_post("/admin/faults", i.admin_faults)
    r.add_get("/admin/stats", i.admin_stats)
    r.add_post("/admin/reset", i.admin_reset)
    r.add_route("*", "/{tail:.*}", i.not_found)

    async def _close(app_: web.Application) -> None:
        state.close()

    app.on_cleanup.append(_close)
    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def serve(cfg: EmulatorConfig, ready_message: bool = True, lifeline_fd: int | None = None) -> None:
    """Run until SIGTERM/SIGINT, or until the other end of `lifeline_fd` closes (a local fleet's driver exited,
    SIGKILL included: the kernel closes its end)."""
    if cfg.port == 0:
        cfg.port = free_port(cfg.host)
    app = build_app(cfg)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=cfg.keepalive_timeout,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=4096, reuse_address=True)
    await site.start()
    if ready_message:
        print(f"emulator ready on http://{cfg.host}:{cfg.port} model={cfg.served_model_name}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if lifeline_fd is not None:
        loop.add_reader(lifeline_fd, _on_lifeline, lifeline_fd, stop)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _on_lifeline(fd: int, stop: asyncio.Event) -> None:
    """The driver never writes: readable means end of file (b""), or a closed pipe."""
    try:
        data = os.read(fd, 64)
    except OSError:
        data = b""
    if not data:
        print("emulator: the driver is gone; stopping", file=sys.stderr, flush=True)
        asyncio.get_running_loop().remove_reader(fd)
        stop.set()


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.emulator` / `regen emulate`: parse options, serve until signalled. Returns 0."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Connection resets are part of the fault model; keep aiohttp quiet about them.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    try:
        asyncio.run(serve(cfg, lifeline_fd=args.lifeline_fd))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"emulator: {e}", file=sys.stderr)
        return 1
    return 0
