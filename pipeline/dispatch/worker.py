"""The endpoint worker: one per endpoint, run inside a Ray actor (see dispatcher.py) or directly in tests.

It keeps `concurrency` long-lived worker coroutines busy (long-lived workers reuse their connection;
`gather` + a semaphore makes the connection pool scan its idle sockets on every request). The driver
talks to it through `exchange`: one call hands over a batch of work and brings back a batch of outcomes,
so there is no Ray call per prompt.

A small circuit breaker lives here too: consecutive failures open it, queued work goes back to the
driver at once, and a health probe with backoff lets work in again.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from ..core.config import RunConfig
from ..core.errors import (
    ConnectionDropped, EndpointDown, EndpointFatal, RequestError, Retryable, TerminalForPrompt, Unexpected,
)
from ..core.work import (
    DONE, DROPPED, ENDPOINT_FATAL, RETRY, RETURNED, TERMINAL, Completion, Exchange, Outcome, WorkItem,
)
from ..endpoints.classify import unexpected
from ..endpoints.client import ClientSettings, EndpointClient
from ..prompts.conversation import DEFAULT_REASONING_HISTORY, DEFAULT_RESULT_MATCH, AllTurns, normalised
from .autolimit import AutoLimit
from .images import ConversationImages

# Error class -> outcome kind, most specific first.
OUTCOME_OF: tuple[tuple[type[RequestError], str], ...] = (
    (ConnectionDropped, DROPPED), (EndpointDown, RETURNED), (TerminalForPrompt, TERMINAL),
    (EndpointFatal, ENDPOINT_FATAL), (Retryable, RETRY),
)


class _Failed(Exception):
    """A turn failed for good on this endpoint; `attempts` counts the attempts that cost the prompt one."""

    def __init__(self, error: RequestError, attempts: int):
        self.error, self.attempts = error, attempts


def _must_propagate(exc: BaseException) -> bool:
    """What may end a worker: the cancellation (or closing) of this worker itself (close(), the loop ending).
    Anything else is an error of the prompt: a CancelledError while the worker's task is not being cancelled (a
    library's stray cancel), a library's own BaseException subclass, and SystemExit or KeyboardInterrupt too. The
    driver's signals reach only its main thread, never a worker, so these come from a library (a sys.exit()), and
    asyncio would stop the actor's whole event loop on them, leaving its prompts and the run hanging."""
    if isinstance(exc, GeneratorExit):
        return True
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


class EndpointWorker:
    def __init__(
        self,
        url: str,
        label: str,
        concurrency: int,
        settings: ClientSettings,
        api_key: str | None = None,
        mode: str = "last_turn",
        attempts_per_endpoint: int = 2,
        circuit_failures: int = 5,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        readmission: RunConfig | None = None,
        start_open: bool = False,
        tool_reasoning_history: str = DEFAULT_REASONING_HISTORY,
        tool_result_match: str = DEFAULT_RESULT_MATCH,
        run_uri: str | None = None,
        images_send_as: str = "data_url",
        concurrency_cap: int = 512,
        auto_by_default: bool = False,
    ):
        self.mode = mode
        # concurrency not set (auto_by_default): auto's workers, pinned to `concurrency` (8; at most
        # `concurrency_cap`, the workers there are) once the server proves to report no batch (autolimit.py)
        auto = concurrency == "auto" or auto_by_default
        self.label, self.concurrency = label, concurrency_cap if auto else int(concurrency)
        self.tool_reasoning_history, self.tool_result_match = tool_reasoning_history, tool_result_match
        # images: read from the run directory (or their own path) when sent, as images.send_as says (images.py)
        self.run_uri, self.images_send_as = run_uri, images_send_as
        self.client = EndpointClient(url, label, settings, api_key, max_in_flight=self.concurrency)
        # concurrency: auto (autolimit.py): `concurrency_cap` workers, at most the controller's limit at work
        self.auto = (AutoLimit(self.client, label, self.concurrency,
                               fallback=None if concurrency == "auto" else int(concurrency)) if auto else None)
        self.attempts_per_endpoint = attempts_per_endpoint
        self.circuit_failures = circuit_failures
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.readmission = readmission  # the run's config: a recovered endpoint passes the full preflight again
        self.inbox: asyncio.Queue[WorkItem] = asyncio.Queue()
        self.outbox: list[Outcome] = []
        self.ready = asyncio.Event()
        self.in_flight = 0
        # An endpoint that joins mid-run starts with its circuit open: it must pass the preflight first.
        self.state = "open" if start_open else "healthy"
        self.consecutive_failures = 0
        self.errors: Counter[str] = Counter()
        self.last_error = ""
        self.requests = 0
        self.completion_tokens = 0
        self.started = time.monotonic()
        self.node = _node_address()
        self._tasks: list[asyncio.Task] = []
        self._probe: asyncio.Task | None = None

    def _ensure_started(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
            if self.auto is not None:
                self.auto.start(lambda: self.state == "healthy", lambda: self.in_flight)
            if self.state == "open":
                self._probe = asyncio.create_task(self._probe_until_healthy(first_delay=0.0))

    # --- the driver's one call ---------------------------------------------------------------------
    async def exchange(self, work: list[WorkItem], wait_s: float = 0.5) -> Exchange:
        self._ensure_started()
        for item in work:
            if self.state in ("open", "fatal"):
                self._emit(Outcome(item.prompt_id, RETURNED, self.label, 0, message=f"{self.label} is {self.state}"))
            else:
                self.inbox.put_nowait(item)
        if not self.outbox:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), wait_s)
            except TimeoutError:
                pass
            else:
                await asyncio.sleep(0.005)  # let a few more finish: fewer, larger exchanges
        outcomes, self.outbox = self.outbox, []
        return Exchange(outcomes, self.demand(), self.state, self.in_flight, self.stats())

    def demand(self) -> int:
        if self.state in ("open", "fatal"):
            return 0
        if self.state == "probing":
            return max(0, 1 - self.in_flight - self.inbox.qsize())
        limit = self.auto.limit if self.auto is not None else self.concurrency
        return max(0, 2 * limit - self.in_flight - self.inbox.qsize())

    def stats(self) -> dict:
        elapsed = max(1e-9, time.monotonic() - self.started)
        return {
            "state": self.state,
            "node": self.node,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "completion_tokens": self.completion_tokens,
            "tok_s": round(self.completion_tokens / elapsed, 1),
            "errors": dict(self.errors),
            "last_error": self.last_error,
            # a set number: "fixed" (status and the card say `concurrency 16 (set)`); else auto's figures
            **(self.auto.stats() if self.auto is not None else
               {"concurrency": self.concurrency, "concurrency_mode": "fixed"}),
        }

    # --- the workers ------------------------------------------------------------------------------
    def _emit(self, outcome: Outcome) -> None:
        self.outbox.append(outcome)
        self.ready.set()

    async def _work(self) -> None:
        """One long-lived worker. Every exception becomes an outcome for its prompt; only a cancellation of
        the worker itself ends it (and then the driver has taken the work back already)."""
        while True:
            if self.auto is not None:
                await self.auto.acquire()
            try:
                await self._one()
            finally:
                if self.auto is not None:
                    self.auto.release()

    async def _one(self) -> None:
        item = await self.inbox.get()
        if self.state in ("open", "fatal"):
            self._emit(Outcome(item.prompt_id, RETURNED, self.label, 0, message=f"{self.label} is {self.state}"))
            return
        self.in_flight += 1
        try:
            outcome = await self._run(item)
        except BaseException as exc:  # _run turns errors into outcomes; this catches a bug in that bookkeeping
            if _must_propagate(exc):
                raise
            outcome = self._failed(item, unexpected(exc, self.label), 1)
        finally:
            self.in_flight -= 1
        self._emit(outcome)

    async def _run(self, item: WorkItem) -> Outcome:
        """All turns of a prompt on this endpoint, in order. A failure redoes the whole prompt elsewhere.
        Only failed attempts count against the prompt: a DONE costs one attempt plus the failures before it."""
        failed = 0
        completions: list[Completion] = []
        conversation_end = None
        try:
            messages = [normalised(m) for m in orjson.loads(item.messages_json)]  # as sent: tool fields only if set
            tools = orjson.loads(item.tools_json) if item.tools_json is not None else None
            images = ConversationImages(self.run_uri, self.images_send_as, self.client.engine, self.label,
                                        node=self.node)
            if self.mode == "all_turns":
                # Each generation is one step (a tool-calling step included); the whole conversation is one outcome,
                # so a kill mid-conversation redoes all of it.
                conversation = AllTurns(messages, self.tool_reasoning_history, self.tool_result_match)
                while (history := conversation.next_history()) is not None:
                    k = conversation.generations
                    seed = None if item.seed is None else item.seed + k
                    completion, used = await self._request(item.prompt_id, k, self._sendable(images, history), seed,
                                                           tools)
                    failed += used - 1
                    completions.append(completion)
                    conversation.add(completion)
                conversation_end = conversation.end
            else:
                turn = sum(m["role"] == "assistant" for m in messages)
                completion, used = await self._request(item.prompt_id, turn, self._sendable(images, messages),
                                                       item.seed, tools)
                failed += used - 1
                completions.append(completion)
        except _Failed as failure:
            return self._discarding(self._failed(item, failure.error, failed + failure.attempts), completions)
        except BaseException as exc:  # e.g. a conversation this code cannot read
            if _must_propagate(exc):
                raise
            return self._discarding(self._failed(item, unexpected(exc, self.label), failed + 1), completions)
        self.consecutive_failures = 0
        if self.state == "probing":
            self.state = "healthy"
        return Outcome(item.prompt_id, DONE, self.label, failed + 1, completions=completions,
                       conversation_end=conversation_end)

    @staticmethod
    def _sendable(images: ConversationImages, messages: list[dict]) -> list[dict]:
        """The messages as the request carries them, images read and checked (images.py): an image that changed or
        is gone fails the prompt unsent (one attempt), one that cannot be read now is retried, and a run directory
        this node does not see takes the endpoint's actor out (no attempt of the prompt's)."""
        try:
            return images.messages(messages)
        except RequestError as error:
            raise _Failed(error, 0 if isinstance(error, EndpointFatal) else 1) from None

    @staticmethod
    def _discarding(outcome: Outcome, completions: list[Completion]) -> Outcome:
        """The tokens of the turns done before a failure go with it: the driver counts them as thrown away."""
        outcome.discarded_tokens = sum(c.completion_tokens for c in completions)
        return outcome

    async def _request(self, prompt_id: str, turn_index: int, messages: list[dict[str, str]],
                       seed: int | None, tools: list[dict] | None = None) -> tuple[Completion, int]:
        """One turn, with backoff and jitter on retryable errors, up to attempts_per_endpoint.
        Returns the completion and the attempts it took; raises _Failed with the attempts that count."""
        attempts = 0
        retrying = AsyncRetrying(
            # An unreachable endpoint is not retried here: the circuit breaker handles it.
            retry=retry_if_exception(lambda e: isinstance(e, Retryable) and not isinstance(e, EndpointDown)),
            stop=stop_after_attempt(self.attempts_per_endpoint),
            wait=wait_exponential_jitter(multiplier=self.backoff_initial_s, max=self.backoff_max_s),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    self.requests += 1
                    attempts += 1
                    completion = await self._attempt(prompt_id, turn_index, messages, seed, tools)
        except RequestError as error:
            # an unreachable endpoint, or a dropped connection, is not the prompt's attempt
            raise _Failed(error, attempts - isinstance(error, EndpointDown)) from None
        self.completion_tokens += completion.completion_tokens
        if self.auto is not None:
            self.auto.completed(completion.latency_s, completion.completion_tokens, self.in_flight)
        return completion, attempts

    async def _attempt(self, prompt_id: str, turn_index: int, messages: list[dict[str, str]],
                       seed: int | None, tools: list[dict] | None = None) -> Completion:
        """The client boundary: what comes out is a completion or an error of the taxonomy."""
        try:
            return await self.client.chat(messages, seed, tools)
        except RequestError:
            raise
        except BaseException as exc:
            if _must_propagate(exc):
                raise
            raise unexpected(exc, self.label) from exc

    def _failed(self, item: WorkItem, error: RequestError, attempts: int) -> Outcome:
        """The one place that turns an error class into an outcome and circuit bookkeeping."""
        kind = next(kind for cls, kind in OUTCOME_OF if isinstance(error, cls))
        self.errors[kind] += 1
        if isinstance(error, Unexpected):
            self.errors["unexpected"] += 1
        self.last_error = f"{kind}: {error.message}"
        if kind == TERMINAL:
            self.consecutive_failures = 0
        elif kind == ENDPOINT_FATAL:
            self.state = "fatal"
        else:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.circuit_failures or self.state == "probing":
                self._open_circuit()
        return Outcome(item.prompt_id, kind, self.label, attempts, message=error.message, status=error.status)

    # --- circuit breaker ----------------------------------------------------------------------------
    def _open_circuit(self) -> None:
        if self.state in ("open", "fatal"):
            return
        self.state = "open"
        self.errors["circuit_opened"] += 1
        while not self.inbox.empty():  # queued work goes back to the driver at once
            item = self.inbox.get_nowait()
            self._emit(Outcome(item.prompt_id, RETURNED, self.label, 0, message=f"{self.label} circuit open"))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_healthy())

    async def _probe_until_healthy(self, first_delay: float | None = None) -> None:
        delay = self.backoff_initial_s
        await asyncio.sleep(self.backoff_initial_s if first_delay is None else first_delay)
        while self.state == "open":
            try:
                if await self.client.healthy() and await self._passes_preflight():
                    self.state = "probing"  # half-open: one request decides
                    self.consecutive_failures = 0
                    if self.auto is not None:
                        self.auto.recovered()  # a restarted server: its limits are read again
                    return
            except BaseException as exc:  # a probe that fails oddly is a failed probe, never a silent end
                if _must_propagate(exc):
                    raise
                self.errors["probe_error"] += 1
                self.last_error = f"probe failed: {unexpected(exc).message}"
            await asyncio.sleep(delay)
            delay = min(self.backoff_max_s, delay * 2)

    async def _passes_preflight(self) -> bool:
        """A restarted server may come back with other flags, another model, other weights or another engine."""
        if self.readmission is None:
            return True
        from ..endpoints.preflight import check_endpoint, engine_refusal, fleet_problems

        report = await check_endpoint(self.client, self.readmission, tools=self.client.settings.needs_tool_calls,
                                      images=self.client.settings.needs_images)
        expected = self.client.settings.expected_weight_version
        problems = report.problems + fleet_problems([report], self.readmission)
        if expected is not None and report.weight_version not in (None, expected):
            problems.append(f"weight version {report.weight_version!r} differs from the run's {expected!r}")
        run_engines = self.client.settings.run_engines
        refusal = engine_refusal(report.engine, run_engines) if report.reachable else None
        if refusal:
            problems.append(refusal)
            if report.engine.engine not in {name for name, _ in run_engines}:
                # Another engine: the endpoint leaves the fleet (the driver logs why), the run stays one engine's
                # and run.json's `engines` stays true. Another version (or none read, e.g. /version timing out)
                # is refused this time only, like other weights.
                self.state = "fatal"
        if problems:
            self.last_error = "refused on recovery: " + "; ".join(problems)
            self.errors["readmission_refused"] += 1
        return report.ok and not problems

    async def close(self) -> None:
        for task in [*self._tasks, self._probe]:
            if task is not None:
                task.cancel()
        if self.auto is not None:
            self.auto.close()
        await self.client.close()


def _node_address() -> str:
    """The address of the Ray node this actor runs on (shown per endpoint in status.json)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "local"
