"""The narrow windows of dispatch, reached on purpose with the real Dispatcher and real EndpointWorkers in this
process (LocalTransport: no Ray) against real SGLang emulators. Each test failed on the code before its fix:
a hedged copy's failure finished a prompt still running elsewhere; an endpoints-file read in the middle of a
rewrite drained the fleet; a server crash charged every
prompt in flight on it."""
from __future__ import annotations

import time

from pipeline.core.work import DONE
from pipeline.dispatch.routing import home_of
from tests.helpers import emulators
from tests.local_dispatch import make_cfg, run_local, work_item


def test_a_hedged_copy_that_fails_never_finishes_a_prompt_still_running():
    """A slow endpoint holds prompt 0; at the tail an idle fast endpoint re-runs it and gets a 400. Before the fix
    that 400 finished the prompt as failed while the original was still running (and then succeeded)."""
    with emulators(1, preset="kimi", tok_per_s=6) as (slow,), \
            emulators(1, preset="kimi", poison_text="[hedge-me]", poison_fault="400") as (fast,):
        cfg = make_cfg([{"url": slow.url, "name": "slow", "concurrency": 4},
                        {"url": fast.url, "name": "fast", "concurrency": 4}],
                       sampling={"temperature": 0.0, "max_tokens": 12})
        labels = ["slow", "fast"]
        text = next(t for t in (f"Prompt [hedge-me] {n}" for n in range(200))
                    if home_of(work_item("x", t, cfg).affinity, labels) == "slow")
        items = [work_item("target", text, cfg)] + [work_item(f"f{i}", f"Filler {i}", cfg) for i in range(12)]
        result = run_local(cfg, items)
    assert "target" in result.dispatcher.hedged, "the fast endpoint re-ran the straggler"
    assert {pid: kinds for pid, kinds in result.kinds().items()} == {i.prompt_id: [DONE] for i in items}
    outcome, attempts = result.finished["target"][0]
    assert outcome.endpoint == "slow"


def test_an_endpoints_file_read_in_the_middle_of_a_rewrite_changes_nothing(tmp_path):
    """The run's own watcher reads the file once while it is being rewritten (truncated, not yet written). Before
    the fix that read drained the whole fleet for an interval, and with no endpoint left the run stopped."""
    from pipeline.dispatch.cluster import EndpointsFileWatch

    with emulators(2, preset="kimi", tok_per_s=40) as servers:
        fleet = tmp_path / "fleet.txt"
        content = "".join(f"{s.url} 4\n" for s in servers)
        fleet.write_text(content)
        cfg = make_cfg([], endpoints_file=str(fleet), endpoints_file_interval_s=0.5)
        watch, reads = EndpointsFileWatch(cfg), []

        def torn_watch():
            if time.monotonic() < watch.next_read:
                return watch()  # between reads: None
            reads.append(1)
            if len(reads) != 3:
                return watch()
            fleet.write_text("")  # the operator's editor has truncated the file and not yet written it
            try:
                return watch()
            finally:
                fleet.write_text(content)

        items = [work_item(f"p{i}", f"Question {i}", cfg) for i in range(60)]
        result = run_local(cfg, items, fleet_watch=torn_watch)
    assert len(reads) >= 4, "the torn read was followed by good ones"
    assert result.dispatcher.fleet_changes == []
    assert set(result.finished) == {i.prompt_id for i in items}


def test_an_endpoint_half_open_at_the_tail_of_the_run_gets_its_one_request():
    """Near the end of the run an endpoint's demand is cut by one concurrency (no prefetch). Before the fix that cut
    also took a half-open (probing) endpoint's single request to nothing: it never closed again, and the run hung
    with work queued. Found by the supervision property test (test_supervision.py)."""
    with emulators(1, preset="kimi", poison_text="[busy]", poison_fault="503", poison_times=2) as (server,):
        cfg = make_cfg([{"url": server.url, "name": "only", "concurrency": 4}], circuit_failures=2,
                       attempts_per_endpoint=1, max_attempts=4)
        items = [work_item(f"p{i}", f"[busy] Question {i}", cfg) for i in range(2)]  # both 503: the circuit opens
        result = run_local(cfg, items, time_limit_s=30)
    assert result.seconds < 15, f"the run hung with its only endpoint half-open ({result.seconds:.0f}s)"
    assert result.kinds() == {"p0": [DONE], "p1": [DONE]}
    assert result.dispatcher.slots["only"].stats["errors"].get("circuit_opened") == 1


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
        result = run_local(cfg, items, time_limit_s=20)
    assert result.seconds < 15, f"the run hung with only a suspect left ({result.seconds:.0f}s)"
    assert result.kinds() == {"poison": ["terminal"], "p0": [DONE]}
    assert result.finished["poison"][0][0].message.startswith("the server dropped the connection on this prompt 2")


def test_an_endpoint_that_left_for_a_contract_error_stays_out_while_its_entry_is_unchanged(monkeypatch):
    """Every request to the only endpoint is refused with a ContractError (a field the readmission preflight does not
    send), and an endpoints file still lists it. Before the fix the watch re-added it on its next read though the
    file had not changed: it left and rejoined forever, each rejoin reset the dead-fleet clock, and the run never
    ended. It stays out until its entry changes: with none left the run ends with the clear error."""
    import pytest

    from pipeline.core.config import Endpoint
    from pipeline.core.errors import ContractError, RunFatal
    from pipeline.endpoints.client import EndpointClient

    async def chat(self, messages, seed, tools=None):
        raise ContractError("unknown field `sampling_seed`", endpoint=self.label)

    monkeypatch.setattr(EndpointClient, "chat", chat)
    with emulators(1, preset="kimi") as (server,):
        entries = [{"url": server.url, "name": "only", "concurrency": 4}]
        cfg = make_cfg(entries, hedge_tail=False, dead_fleet_deadline_s=60)
        listed = [Endpoint.model_validate(e) for e in entries]
        items = [work_item(f"p{i}", f"Question {i}", cfg) for i in range(4)]
        started = time.monotonic()
        with pytest.raises(RunFatal, match="every endpoint left the fleet"):
            run_local(cfg, items, time_limit_s=10, fleet_watch=lambda: listed)
    assert time.monotonic() - started < 8, "the endpoint left and rejoined until the time limit"


def test_an_endpoint_that_left_for_a_contract_error_rejoins_once_its_entry_changes(monkeypatch):
    """The operator fixes the server that was refused and edits its line in the endpoints file: it joins again
    (once, after its preflight) and takes work, while the other endpoint keeps running."""
    from pipeline.core.config import Endpoint
    from pipeline.core.errors import ContractError
    from pipeline.endpoints.client import EndpointClient

    real_chat = EndpointClient.chat
    refused: list[float] = []

    async def chat(self, messages, seed, tools=None):
        if self.label == "fixed" and len(listed) == 1:
            refused.append(time.monotonic())
            raise ContractError("unknown field `sampling_seed`", endpoint=self.label)
        return await real_chat(self, messages, seed)

    monkeypatch.setattr(EndpointClient, "chat", chat)
    with emulators(1, preset="kimi", tok_per_s=8) as (slow,), emulators(1, preset="kimi") as (fixed,):
        entries = [{"url": slow.url, "name": "slow", "concurrency": 1},
                   {"url": fixed.url, "name": "fixed", "concurrency": 4}]
        cfg = make_cfg(entries, hedge_tail=False)
        listed = [[Endpoint.model_validate(e) for e in entries]]

        def watch():
            if refused and time.monotonic() - refused[0] > 1.0 and len(listed) == 1:
                listed.append([listed[0][0], Endpoint.model_validate({**entries[1], "concurrency": 2})])
            return listed[-1]

        items = [work_item(f"p{i}", f"Question {i}", cfg) for i in range(12)]
        result = run_local(cfg, items, time_limit_s=60, fleet_watch=watch)
    assert result.kinds() == {item.prompt_id: [DONE] for item in items}
    assert result.dispatcher.fleet_changes == ["-fixed", "+fixed"]
    assert any(outcome.endpoint == "fixed" for [(outcome, _)] in result.finished.values())
