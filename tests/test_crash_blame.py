"""Who pays for a server crash, with the real Dispatcher and real EndpointWorkers in this process (LocalTransport:
no Ray) against real SGLang emulators: only the prompt that caused it, found by running the suspects alone."""
from __future__ import annotations

from pipeline.core.work import DONE
from tests.helpers import emulators
from tests.local_dispatch import make_cfg, run_local, work_item


def test_a_server_crash_charges_only_the_prompt_that_caused_it(monkeypatch):
    """A poison prompt crashes whichever server runs it, and every request in flight there is dropped with it.
    Before the fix each drop counted against every prompt it hit: innocent prompts that shared a server with the
    poison three times became failure rows too."""
    import asyncio

    from pipeline.core.errors import ConnectionDropped
    from pipeline.endpoints.client import EndpointClient

    real_chat = EndpointClient.chat
    crashes: dict[int, asyncio.Event] = {}

    async def chat(self, messages, seed, tools=None):
        crash = crashes.setdefault(id(self), asyncio.Event())
        if "[crash-server]" in messages[-1]["content"]:
            await asyncio.sleep(0.05)  # the server dies a moment into the poison's request, and takes all with it
            crashes[id(self)] = asyncio.Event()  # the restarted server
            crash.set()
            raise ConnectionDropped("connection failed: server disconnected", endpoint=self.label)
        answer = asyncio.ensure_future(real_chat(self, messages, seed))
        crashed = asyncio.ensure_future(crash.wait())
        await asyncio.wait([answer, crashed], return_when=asyncio.FIRST_COMPLETED)
        crashed.cancel()
        if not answer.done():
            answer.cancel()
            raise ConnectionDropped("connection failed: server disconnected", endpoint=self.label)
        return answer.result()

    monkeypatch.setattr(EndpointClient, "chat", chat)
    with emulators(2, preset="kimi", tok_per_s=30) as servers:
        cfg = make_cfg([{"url": s.url, "name": f"emu-{i}", "concurrency": 4} for i, s in enumerate(servers)],
                       hedge_tail=False, max_connection_drops=3, sampling={"temperature": 0.0, "max_tokens": 8})
        items = [work_item("poison", "[crash-server] Name a fact.", cfg)] + \
            [work_item(f"p{i}", f"Question {i}: name a fact.", cfg) for i in range(24)]
        result = run_local(cfg, items, time_limit_s=90)
    kinds = result.kinds()
    assert kinds == {"poison": ["terminal"], **{f"p{i}": [DONE] for i in range(24)}}, kinds
    assert result.finished["poison"][0][0].message.startswith("the server dropped the connection on this prompt 3")


def test_suspects_run_alone_on_a_half_open_endpoint_after_a_crash(monkeypatch):
    """A crash drops the connections and the circuit opens; the probe leaves the endpoint half-open (probing), and
    only a request that succeeds makes it healthy again. Before the fix suspects ran alone only on a healthy
    endpoint: with just suspects left nothing was ever sent, and probing is not down, so the run hung forever."""
    from pipeline.core.errors import ConnectionDropped
    from pipeline.endpoints.client import EndpointClient

    real_chat = EndpointClient.chat

    async def chat(self, messages, seed, tools=None):
        if "[crash-server]" in messages[-1]["content"]:
            raise ConnectionDropped("connection failed: server disconnected", endpoint=self.label)
        return await real_chat(self, messages, seed)

    monkeypatch.setattr(EndpointClient, "chat", chat)
    with emulators(1, preset="kimi") as (server,):
        cfg = make_cfg([{"url": server.url, "name": "only", "concurrency": 4}], hedge_tail=False,
                       circuit_failures=1, max_connection_drops=2, dead_fleet_deadline_s=60)
        items = [work_item("poison", "[crash-server] Name a fact.", cfg), work_item("p0", "Name a fact.", cfg)]
        result = run_local(cfg, items, time_limit_s=60)
    assert not result.stopped_at_limit, f"the run hung with only a suspect left ({result.seconds:.0f}s)"
    assert result.kinds() == {"poison": ["terminal"], "p0": [DONE]}
    assert result.finished["poison"][0][0].message.startswith("the server dropped the connection on this prompt 2")
