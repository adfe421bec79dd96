"""How the driver reaches its endpoint workers: one outstanding `exchange` call per worker.

`RayTransport` is the run's: each worker is an async Ray actor. `LocalTransport` runs the same EndpointWorkers
in this process, on one event loop in a thread: the same Dispatcher and the same workers without Ray, for tests
that must reach narrow windows (a hedged copy failing, a torn endpoints file, injected exceptions) and for dry runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Protocol

from ..core.work import Exchange, WorkItem

log = logging.getLogger("regen.dispatch")


class ActorLost(Exception):
    """An exchange did not come back: the actor died, or its call failed. Its work goes back to the queue."""


class Transport(Protocol):
    def call(self, handle: Any, work: list[WorkItem], wait_s: float) -> Any: ...

    def wait(self, calls: list[Any], timeout_s: float) -> list[Any]: ...

    def result(self, call: Any) -> Exchange: ...

    def kill(self, handle: Any) -> None: ...

    def placed(self, handle: Any) -> bool | None: ...


class RayTransport:
    def call(self, handle: Any, work: list[WorkItem], wait_s: float) -> Any:
        return handle.exchange.remote(work, wait_s)

    def wait(self, calls: list[Any], timeout_s: float) -> list[Any]:
        """The first call to finish within timeout_s, plus every other one already finished."""
        import ray

        if not calls:
            time.sleep(timeout_s)
            return []
        ready, rest = ray.wait(calls, num_returns=1, timeout=timeout_s)
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        return ready

    def result(self, call: Any) -> Exchange:
        import ray
        from ray.exceptions import RayError

        try:
            return ray.get(call)
        except RayError as exc:  # the actor died (RayActorError), or the call raised in it (RayTaskError)
            raise ActorLost(f"{type(exc).__name__}: {exc}") from exc

    def kill(self, handle: Any) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            ray.kill(handle)
        except (RayError, ValueError) as exc:  # already gone
            log.debug("ray.kill: %s", exc)

    def placed(self, handle: Any) -> bool | None:
        """Whether Ray placed the actor (its GCS entry ALIVE: it runs, maybe slowly); False while it waits for a node
        (PENDING_CREATION, DEPENDENCIES_UNREADY); None: unknown. A GCS read, asked only for a slow actor."""
        try:
            from ray._private import state

            entry = state.actors(actor_id=handle._actor_id.hex())  # the GCS; no dashboard needed
        except Exception as exc:  # noqa: BLE001 - a private API: not knowing is an answer
            log.debug("actor state: %s", exc)
            return None
        where = (entry or {}).get("State")
        return True if where == "ALIVE" else False if where in ("PENDING_CREATION", "DEPENDENCIES_UNREADY") else None


class LocalTransport:
    """EndpointWorkers (the handles) on one event loop in a daemon thread of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="regen-local-workers", daemon=True)
        self.thread.start()
        self.closing: list[concurrent.futures.Future] = []

    def call(self, handle: Any, work: list[WorkItem], wait_s: float) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(handle.exchange(work, wait_s), self.loop)

    def wait(self, calls: list[Any], timeout_s: float) -> list[Any]:
        if not calls:
            time.sleep(timeout_s)
            return []
        done, _ = concurrent.futures.wait(calls, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        return list(done)

    def result(self, call: concurrent.futures.Future) -> Exchange:
        try:
            return call.result()
        except Exception as exc:
            raise ActorLost(f"{type(exc).__name__}: {exc}") from exc

    def kill(self, handle: Any) -> None:
        self.closing.append(asyncio.run_coroutine_threadsafe(handle.close(), self.loop))

    def placed(self, handle: Any) -> bool | None:
        return True  # in this process: it runs

    def close(self) -> None:
        """Wait for the killed workers to close, cancel what still runs (outstanding exchanges), stop the loop."""
        concurrent.futures.wait(self.closing, timeout=10)
        try:
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(timeout=10)
        except concurrent.futures.TimeoutError:
            log.warning("local workers did not stop within 10 s")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
