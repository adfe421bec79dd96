"""Name lookups that never hold the driver's exit.

aiohttp's default resolver runs getaddrinfo in the event loop's default executor, whose threads the interpreter
joins at exit: after an operator's stop during the fleet's probes, a lookup that hangs (a resolver that does not
answer) kept the stopped driver alive until it returned. Here each lookup runs in a daemon thread; the loop waits
for its answer all the same, and a stopped driver exits without it.
"""
from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any, Callable

from aiohttp.resolver import ThreadedResolver


class _DaemonLookups:
    """The two calls aiohttp's ThreadedResolver makes of its loop, each run in a daemon thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
        return await self._run(socket.getaddrinfo, *args, **kwargs)

    async def getnameinfo(self, *args: Any) -> Any:
        return await self._run(socket.getnameinfo, *args)

    async def _run(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop, answer = self._loop, self._loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if answer.done():  # cancelled meanwhile
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def lookup() -> None:
            try:
                result, error = call(*args, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - handed to the waiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop has closed: nobody waits for this answer
                pass

        threading.Thread(target=lookup, name="regen-lookup", daemon=True).start()
        return await answer


def resolver() -> ThreadedResolver:
    """aiohttp's ThreadedResolver, its lookups in daemon threads (call within the running loop)."""
    return ThreadedResolver(_DaemonLookups(asyncio.get_running_loop()))  # type: ignore[arg-type]
