"""The router, pure (no Ray, no HTTP): prefix affinity by rendezvous hashing, bounded by SGLang router's two
load-balance thresholds and by work stealing; retries avoid the endpoint that failed them."""
from __future__ import annotations

import collections

from pipeline.core.work import WorkItem, affinity_key
from pipeline.dispatch.routing import Router, home_of

LABELS = ["e0", "e1", "e2", "e3"]


def item(i: int, family: int | None = None) -> WorkItem:
    messages = [{"role": "system", "content": f"You serve family {family if family is not None else i}."},
                {"role": "user", "content": f"question {i}"}]
    return WorkItem(f"p{i}", b"", None, affinity_key(messages, 30))  # the system prompt decides


def always_open(_prompt_id: str) -> bool:
    return True


def homes(router: Router) -> dict[str, str]:
    return {it.prompt_id: label for label, queue in router.homed.items() for it in queue}


def test_prompts_sharing_a_prefix_share_a_home_and_a_departure_moves_only_its_own():
    router = Router()
    router.set_endpoints(LABELS)
    router.add([item(i, family=i % 40) for i in range(400)])
    before = homes(router)
    by_family = collections.defaultdict(set)
    for i in range(400):
        by_family[i % 40].add(before[f"p{i}"])
    assert all(len(h) == 1 for h in by_family.values()), "a prefix family lives on one endpoint"
    assert len(set(before.values())) == 4, "families spread over the fleet"
    router.set_endpoints(["e0", "e1", "e2"])
    after = homes(router)
    moved = {pid for pid in before if before[pid] != after[pid]}
    assert moved == {pid for pid, label in before.items() if label == "e3"}, "rendezvous hashing: minimal moves"
    assert len(router) == 400


def test_without_affinity_everything_is_shared_and_first_come():
    router = Router(affinity=False)
    router.set_endpoints(LABELS)
    router.add([item(i) for i in range(10)])
    assert [it.prompt_id for it in router.take("e2", 3, always_open, True)] == ["p0", "p1", "p2"]


def hot_and_cold(hot: int, cold: int) -> tuple[Router, str, str]:
    """`hot` prompts of one family homed on one endpoint, `cold` of its own on another."""
    router = Router(balance_abs=32, balance_rel=1.5)
    router.set_endpoints(["a", "b"])
    hot_home = home_of(item(0, family=7).affinity, ["a", "b"])
    other = "b" if hot_home == "a" else "a"
    router.add([item(i, family=7) for i in range(hot)])
    cold_items = [it for it in (item(1000 + i) for i in range(400)) if home_of(it.affinity, ["a", "b"]) == other]
    router.add(cold_items[:cold])
    assert len(router.homed[hot_home]) == hot and len(router.homed[other]) == cold
    return router, hot_home, other


def test_an_endpoint_far_behind_gives_new_work_to_the_least_loaded():
    router, hot_home, other = hot_and_cold(hot=100, cold=5)
    batch = router.take(other, 8, always_open, True)
    assert all(int(it.prompt_id[1:]) < 1000 for it in batch), "100 vs 5 queued: past both thresholds"
    assert len(router.homed[hot_home]) == 92 and len(router.homed[other]) == 5


def test_within_the_thresholds_affinity_holds():
    router, hot_home, other = hot_and_cold(hot=30, cold=5)
    batch = router.take(other, 5, always_open, True)
    assert all(int(it.prompt_id[1:]) >= 1000 for it in batch), "30 vs 5 is within balance_abs=32"
    assert len(router.homed[hot_home]) == 30


def test_an_endpoint_with_nothing_of_its_own_steals_so_nobody_idles():
    router, hot_home, other = hot_and_cold(hot=10, cold=0)
    batch = router.take(other, 4, always_open, True)
    assert len(batch) == 4 and len(router.homed[hot_home]) == 6
    assert [it.prompt_id for it in router.take(hot_home, 2, always_open, True)] == ["p0", "p1"], \
        "the home keeps the head of its queue: stealing takes from the tail"


def test_retries_come_first_and_avoid_the_endpoint_that_failed_them():
    router = Router(affinity=False)
    router.set_endpoints(LABELS)
    router.add([item(i) for i in range(3)])
    retry = item(99)
    router.requeue(retry, failed_at="e1")
    assert "p99" not in [it.prompt_id for it in router.take("e1", 2, always_open, True)]
    assert router.take("e2", 1, always_open, True)[0].prompt_id == "p99"
    router.requeue(retry, failed_at="e1")
    assert router.take("e1", 1, always_open, False)[0].prompt_id == "p99", "unless no other endpoint is healthy"


def test_finished_prompts_are_dropped_not_sent():
    router = Router()
    router.set_endpoints(["a"])
    router.add([item(i) for i in range(6)])
    done = {"p0", "p2", "p4"}
    batch = router.take("a", 6, lambda pid: pid not in done, True)
    assert [it.prompt_id for it in batch] == ["p1", "p3", "p5"] and len(router) == 0
