"""The fleet changing under a run, with the real Dispatcher and real EndpointWorkers in this process
(LocalTransport: no Ray) against real SGLang emulators: an endpoints file read in the middle of a rewrite changes
nothing, and an endpoint that left for a contract error stays out until its entry changes."""
from __future__ import annotations

import time

from pipeline.core.work import DONE
from tests.helpers import emulators
from tests.local_dispatch import make_cfg, run_local, work_item


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
        # an endpoint that left and rejoined without end would run to the time limit, and nothing would raise
        with pytest.raises(RunFatal, match="every endpoint left the fleet"):
            run_local(cfg, items, time_limit_s=60, fleet_watch=lambda: listed)


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


def test_an_endpoint_listed_after_the_preflight_joins_through_its_own_preflight():
    """The endpoints file gains an endpoint between the run's preflight and the start of its dispatch, and that
    server serves another model. Before the fix the dispatch re-read the file and started it as healthy, without a
    preflight: it took work. It joins as a new entry does, and its readmission preflight keeps it out."""
    from pipeline.core.config import Endpoint

    with emulators(1, preset="kimi") as (good,), emulators(1, preset="kimi", served_model_name="other") as (late,):
        entries = [{"url": good.url, "name": "good", "concurrency": 4}, {"url": late.url, "name": "late"}]
        cfg = make_cfg(entries, hedge_tail=False)
        listed = [Endpoint.model_validate(e) for e in entries]
        items = [work_item(f"p{i}", f"Question {i}", cfg) for i in range(24)]
        result = run_local(cfg, items, time_limit_s=60, fleet_watch=lambda: listed, probed={"good"})
    assert result.kinds() == {item.prompt_id: [DONE] for item in items}
    served = {outcome.endpoint for outs in result.finished.values() for outcome, _ in outs}
    assert served == {"good"}, "the endpoint no preflight passed took work"
    assert result.dispatcher.fleet_changes == ["+late"], "it joined as a new entry of the endpoints file"
    assert result.dispatcher.slots["late"].state == "open"
