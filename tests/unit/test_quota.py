"""Team quotas with borrowing, the decision (placement/quota.py): admission, borrowing, reclaim."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import GpuShape, PodRequest
from gpupool_sched.placement.preemption import RunningPod, plan_preemption
from gpupool_sched.placement.quota import (
    Amount,
    Quota,
    admit,
    borrowed,
    demand_of,
    held_by,
    overlaps,
    owner,
    owners,
    reclaim_candidates,
    usage,
)
from gpupool_sched.placement.registry import build_policy
from tests.support.clusters import gpu_node

GB = 1024


def quota(name: str, *namespaces: str, gpus: int = 0, units: int = 0, borrow_gpus: int = 0,
          borrow_units: int = 0) -> Quota:
    return Quota(name, frozenset(namespaces), Amount(gpus, units), Amount(borrow_gpus, borrow_units))


def whole_pod(uid: str, namespace: str, gpus: tuple[int, ...], *, node: str = "n0", priority: int = 0,
              start: float = 0.0) -> RunningPod:
    request = PodRequest(name=uid, cpu_milli=1000, gpu_count=len(gpus), gpu_milli=1000, priority=priority,
                         namespace=namespace)
    return RunningPod(uid, node, priority, request, Placement(node, gpus, 1000, 40 * GB), start)


def share_pod(uid: str, namespace: str, gpu: int, units: int, *, node: str = "n0", priority: int = 0,
              start: float = 0.0) -> RunningPod:
    request = PodRequest(name=uid, cpu_milli=100, gpu_count=1, gpu_memory_mib=units * GB, priority=priority,
                         namespace=namespace)
    return RunningPod(uid, node, priority, request, Placement(node, (gpu,), units * 1000 // 40, units * GB), start)


# ---- amounts ------------------------------------------------------------------------------------

def test_held_by_counts_whole_gpus_and_memory_units_only() -> None:
    assert held_by(Placement("n", (0, 1, 2), 1000, 40 * GB)) == Amount(3, 0)
    assert held_by(Placement("n", (3,), 250, 10 * GB)) == Amount(0, 10)
    assert held_by(Placement("n", (3,), 500, 0)) == Amount()  # compute share: not counted
    assert held_by(Placement("n", mig_devices=("MIG-1",))) == Amount()  # MIG: not counted
    assert held_by(Placement("n")) == Amount()  # CPU only
    both = Placement("n", (0, 1), 1000, 40 * GB, extras=(Placement("n", (2,), 100, 4 * GB),))
    assert held_by(both) == Amount(2, 4)
    assert held_by(Placement("n", (3,), 250, 10 * GB), memory_unit_mib=2 * GB) == Amount(0, 5)


def test_demand_of_matches_held_by() -> None:
    assert demand_of(PodRequest(name="a", gpu_count=4, gpu_milli=1000)) == Amount(4, 0)
    assert demand_of(PodRequest(name="b", gpu_count=1, gpu_memory_mib=6 * GB)) == Amount(0, 6)
    assert demand_of(PodRequest(name="c", cpu_milli=100)) == Amount()
    assert demand_of(PodRequest(name="d", gpu_count=1, gpu_milli=300)) == Amount()
    assert demand_of(PodRequest(name="e", mig_profile="1g.10gb", mig_count=2)) == Amount()
    shapes = [GpuShape(gpu_count=2, gpu_milli=1000), GpuShape(gpu_count=1, gpu_memory_mib=3 * GB)]
    mixed = PodRequest.of_shapes("f", shapes)
    assert demand_of(mixed) == Amount(2, 3)
    assert demand_of(PodRequest(name="g", gpu_count=1, gpu_memory_mib=6 * GB), 2 * GB) == Amount(0, 3)


def test_amount_arithmetic_and_words() -> None:
    assert Amount(1, 2) + Amount(3, 4) == Amount(4, 6)
    assert (Amount(1, 5) - Amount(3, 4)).positive() == Amount(0, 1)
    assert Amount(1, 1).within(Amount(1, 2)) and not Amount(2, 1).within(Amount(1, 2))
    assert Amount(1, 0).overlaps(Amount(2, 0)) and not Amount(1, 0).overlaps(Amount(0, 2))
    assert Amount(1, 0).describe() == "1 GPU"
    assert Amount(2, 3).describe() == "2 GPUs and 3 memory units"
    assert Amount().describe() == "nothing"


def test_negative_quota_is_refused() -> None:
    with pytest.raises(ValueError, match="negative guaranteed"):
        quota("q", gpus=-1)
    with pytest.raises(ValueError, match="negative borrowing limit"):
        quota("q", borrow_units=-2)


# ---- which quota governs -------------------------------------------------------------------------

def test_owner_is_the_first_quota_by_name_and_overlaps_name_the_loser() -> None:
    qs = [quota("team-b", "shared", "b"), quota("team-a", "shared", "a"), quota("team-c", "c")]
    assert owner(qs, "shared").name == "team-a"  # type: ignore[union-attr]
    assert owner(qs, "b").name == "team-b"  # type: ignore[union-attr]
    assert owner(qs, "elsewhere") is None
    assert owners(qs) == {"shared": "team-a", "a": "team-a", "b": "team-b", "c": "team-c"}
    assert overlaps(qs) == {"team-b": {"shared": "team-a"}}
    assert overlaps(reversed(qs)) == {"team-b": {"shared": "team-a"}}  # the input order does not matter


def test_usage_sums_per_governing_quota_and_skips_unlimited_namespaces() -> None:
    qs = [quota("a", "a1", "a2", "both"), quota("b", "b1", "both")]
    got = usage(qs, [("a1", Amount(2, 0)), ("a2", Amount(1, 4)), ("both", Amount(1, 1)),
                     ("b1", Amount(0, 8)), ("free", Amount(16, 0))])
    assert got == {"a": Amount(4, 5), "b": Amount(0, 8)}
    assert usage([quota("z")], []) == {"z": Amount()}


# ---- admission ---------------------------------------------------------------------------------

def test_unlimited_namespace_is_always_admitted() -> None:
    verdict = admit([quota("a", "team-a", gpus=1)], {}, Amount(100, 100), "other")
    assert verdict.ok and verdict.quota is None


def test_within_guaranteed_is_admitted_without_borrowing() -> None:
    qs = [quota("a", "ns-a", gpus=8), quota("b", "ns-b", gpus=8)]
    verdict = admit(qs, {"a": Amount(6, 0), "b": Amount(8, 0)}, Amount(2, 0), "ns-a")
    assert verdict.ok and verdict.quota == "a" and verdict.borrowed == Amount() and verdict.message == ""


def test_beyond_guaranteed_without_borrowing_limit_is_over_quota_with_a_message() -> None:
    qs = [quota("team-a", "ns-a", gpus=8), quota("team-b", "ns-b", gpus=8)]
    verdict = admit(qs, {"team-a": Amount(6, 0)}, Amount(4, 0), "ns-a")
    assert not verdict.ok and verdict.quota == "team-a" and verdict.over == Amount(2, 0)
    assert verdict.message == ("GpuQuota team-a: needs 4 GPUs, uses 6 of 8 guaranteed and may borrow 0 more "
                               "(borrowing limit 0, 8 idle in the other quotas): 2 over")


def test_borrowing_idle_guaranteed_of_others() -> None:
    qs = [quota("a", "ns-a", gpus=4, borrow_gpus=4), quota("b", "ns-b", gpus=4)]
    verdict = admit(qs, {"a": Amount(4, 0), "b": Amount(1, 0)}, Amount(3, 0), "ns-a")
    assert verdict.ok and verdict.borrowed == Amount(3, 0)
    # b uses 2 now: only 2 idle to lend
    refused = admit(qs, {"a": Amount(4, 0), "b": Amount(2, 0)}, Amount(3, 0), "ns-a")
    assert not refused.ok and refused.over == Amount(1, 0)
    assert "may borrow 2 more (borrowing limit 4, 2 idle in the other quotas): 1 over" in refused.message


def test_borrowing_stops_at_the_borrowing_limit() -> None:
    qs = [quota("a", "ns-a", gpus=2, borrow_gpus=3), quota("b", "ns-b", gpus=10)]
    assert admit(qs, {"a": Amount(2, 0)}, Amount(3, 0), "ns-a").ok
    verdict = admit(qs, {"a": Amount(4, 0)}, Amount(2, 0), "ns-a")  # would borrow 4 > 3
    assert not verdict.ok and verdict.over == Amount(1, 0) and verdict.borrowed == Amount(4, 0)
    assert "uses 4 of 2 guaranteed and may borrow 1 more (borrowing limit 3, 8 idle" in verdict.message


def test_others_borrowing_leaves_less_to_lend() -> None:
    # b's 6 idle: c already borrows 4 of them, so a may borrow 2
    qs = [quota("a", "ns-a", gpus=2, borrow_gpus=8), quota("b", "ns-b", gpus=6), quota("c", "ns-c", gpus=2,
                                                                                       borrow_gpus=8)]
    used = {"a": Amount(2, 0), "b": Amount(0, 0), "c": Amount(6, 0)}
    assert admit(qs, used, Amount(2, 0), "ns-a").ok
    assert not admit(qs, used, Amount(3, 0), "ns-a").ok


def test_dimensions_are_checked_on_their_own() -> None:
    qs = [quota("a", "ns-a", gpus=4, units=10, borrow_units=20), quota("b", "ns-b", gpus=0, units=40)]
    # GPUs within guaranteed, memory borrowed from b
    assert admit(qs, {"a": Amount(2, 10)}, Amount(2, 16), "ns-a").ok
    # GPUs over (no GPU borrowing limit), memory fine
    verdict = admit(qs, {"a": Amount(4, 0)}, Amount(1, 2), "ns-a")
    assert not verdict.ok and verdict.over == Amount(1, 0)
    assert "needs 1 GPU," in verdict.message and "memory unit" not in verdict.message
    # memory over the borrowing limit
    verdict = admit(qs, {"a": Amount(0, 10)}, Amount(0, 21), "ns-a")
    assert not verdict.ok and verdict.over == Amount(0, 1)
    assert verdict.message == ("GpuQuota a: needs 21 memory units, uses 10 of 10 guaranteed and may borrow 20 more "
                               "(borrowing limit 20, 40 idle in the other quotas): 1 over")


def test_zero_quota_admits_only_pods_without_counted_gpus() -> None:
    qs = [quota("frozen", "ns-f"), quota("b", "ns-b", gpus=8)]
    assert admit(qs, {}, Amount(), "ns-f").ok  # CPU-only, MIG or milli shares: not counted
    verdict = admit(qs, {}, Amount(1, 0), "ns-f")
    assert not verdict.ok and verdict.message.startswith("GpuQuota frozen: needs 1 GPU, uses 0 of 0 guaranteed")


def test_zero_guaranteed_team_may_borrow_up_to_its_limit() -> None:
    qs = [quota("burst", "ns-x", borrow_gpus=2), quota("b", "ns-b", gpus=8)]
    assert admit(qs, {}, Amount(2, 0), "ns-x").ok
    assert not admit(qs, {"burst": Amount(2, 0)}, Amount(1, 0), "ns-x").ok


def test_multi_quota_namespace_is_governed_by_the_first_quota_by_name() -> None:
    qs = [quota("z-big", "shared", gpus=100), quota("a-small", "shared", gpus=1)]
    verdict = admit(qs, {}, Amount(2, 0), "shared")
    assert not verdict.ok and verdict.quota == "a-small"


def test_over_quota_team_already_beyond_its_guarantee_is_refused_when_cohort_is_full() -> None:
    # b came back: a borrows 4 of b's GPUs, b now uses 4 of its 8, nothing left to lend
    qs = [quota("a", "ns-a", gpus=8, borrow_gpus=8), quota("b", "ns-b", gpus=8)]
    verdict = admit(qs, {"a": Amount(12, 0), "b": Amount(4, 0)}, Amount(1, 0), "ns-a")
    assert not verdict.ok and verdict.message == (
        "GpuQuota a: needs 1 GPU, uses 12 of 8 guaranteed and may borrow 0 more (borrowing limit 8, "
        "0 idle in the other quotas): 1 over")
    assert borrowed(qs[0], Amount(12, 0)) == Amount(4, 0)


@settings(max_examples=200, deadline=None)
@given(
    guaranteed=st.lists(st.integers(0, 8), min_size=2, max_size=4),
    limits=st.lists(st.integers(0, 8), min_size=4, max_size=4),
    used=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    demand=st.integers(0, 10),
)
def test_admitted_demand_keeps_the_cohort_within_its_guarantees(
    guaranteed: list[int], limits: list[int], used: list[int], demand: int
) -> None:
    qs = [quota(f"q{i}", f"ns{i}", gpus=g, borrow_gpus=limits[i]) for i, g in enumerate(guaranteed)]
    usage_now = {q.name: Amount(used[i], 0) for i, q in enumerate(qs)}
    verdict = admit(qs, usage_now, Amount(demand, 0), "ns0")
    mine = used[0] + demand
    if verdict.ok:
        assert demand == 0 or mine <= guaranteed[0] or (
            mine - guaranteed[0] <= limits[0] and sum(used[:len(qs)]) + demand <= sum(guaranteed))
    else:
        assert mine > guaranteed[0]
        assert not (mine - guaranteed[0] <= limits[0] and sum(used[:len(qs)]) + demand <= sum(guaranteed))
        assert verdict.over.gpus > 0 and verdict.over.gpus <= demand
        # exactly `over` less would have been admitted
        smaller = admit(qs, usage_now, Amount(demand - verdict.over.gpus, 0), "ns0")
        assert smaller.ok


# ---- reclaim -------------------------------------------------------------------------------------

def test_reclaim_takes_only_borrowed_pods_lowest_priority_then_newest() -> None:
    qs = [quota("a", "ns-a", gpus=2, borrow_gpus=8), quota("b", "ns-b", gpus=6)]
    pods = [
        whole_pod("a-old", "ns-a", (0,), priority=0, start=1.0),
        whole_pod("a-new", "ns-a", (1,), priority=0, start=5.0),
        whole_pod("a-mid", "ns-a", (2,), priority=0, start=3.0),
        whole_pod("a-high", "ns-a", (3,), priority=100, start=9.0),
        whole_pod("a-low", "ns-a", (4,), priority=-5, start=0.5),
        whole_pod("b-1", "ns-b", (5,)),
    ]
    used = usage(qs, [(p.request.namespace, held_by(p.placement)) for p in pods])
    assert used == {"a": Amount(5, 0), "b": Amount(1, 0)}
    got = reclaim_candidates(qs, used, pods, Amount(2, 0), "ns-b")
    # a borrows 3: its three least important pods, in victim order; never its guaranteed two
    assert [p.uid for p in got] == ["a-low", "a-new", "a-mid"]


def test_reclaim_refused_to_a_team_that_would_itself_borrow() -> None:
    qs = [quota("a", "ns-a", gpus=2, borrow_gpus=8), quota("b", "ns-b", gpus=2)]
    pods = [whole_pod(f"a{i}", "ns-a", (i,), start=float(i)) for i in range(4)]
    used = {"a": Amount(4, 0), "b": Amount(1, 0)}
    assert reclaim_candidates(qs, used, pods, Amount(2, 0), "ns-b") == []  # b would use 3 > 2
    assert [p.uid for p in reclaim_candidates(qs, used, pods, Amount(1, 0), "ns-b")] == ["a3", "a2"]


def test_reclaim_never_from_unlimited_namespaces_or_the_team_itself() -> None:
    qs = [quota("a", "ns-a", gpus=1), quota("b", "ns-b", gpus=4)]
    pods = [whole_pod("free", "nobody", (0,)), whole_pod("b-own", "ns-b", (1,)), whole_pod("a1", "ns-a", (2,))]
    used = {"a": Amount(1, 0), "b": Amount(1, 0)}
    assert reclaim_candidates(qs, used, pods, Amount(1, 0), "ns-b") == []  # a is within its guarantee
    assert reclaim_candidates(qs, used, pods, Amount(1, 0), "nobody") == []  # no quota: nothing to reclaim
    assert reclaim_candidates(qs, used, pods, Amount(), "ns-b") == []


def test_reclaim_follows_the_demanded_dimension() -> None:
    qs = [quota("a", "ns-a", gpus=1, units=4, borrow_gpus=4, borrow_units=40), quota("b", "ns-b", gpus=4, units=40)]
    pods = [
        whole_pod("a-gpu0", "ns-a", (0,), start=1.0),
        whole_pod("a-gpu1", "ns-a", (1,), start=2.0),
        share_pod("a-mem0", "ns-a", 2, 4, start=1.0),
        share_pod("a-mem1", "ns-a", 3, 8, start=2.0),
        share_pod("a-mem2", "ns-a", 3, 8, start=3.0),
    ]
    used = usage(qs, [(p.request.namespace, held_by(p.placement)) for p in pods])
    assert used["a"] == Amount(2, 20)  # borrows 1 GPU and 16 units
    assert [p.uid for p in reclaim_candidates(qs, used, pods, Amount(1, 0), "ns-b")] == ["a-gpu1"]
    assert [p.uid for p in reclaim_candidates(qs, used, pods, Amount(0, 8), "ns-b")] == ["a-mem2", "a-mem1"]
    both = reclaim_candidates(qs, used, pods, Amount(1, 8), "ns-b")
    assert {p.uid for p in both} == {"a-gpu1", "a-mem2", "a-mem1"}


def test_reclaim_last_pod_may_cross_below_the_guarantee() -> None:
    # a borrows 1 GPU but as one 4-GPU job: that job is the borrowed one (Kueue's rule)
    qs = [quota("a", "ns-a", gpus=3, borrow_gpus=4), quota("b", "ns-b", gpus=4)]
    pods = [whole_pod("a-big", "ns-a", (0, 1, 2, 3))]
    used = {"a": Amount(4, 0)}
    assert [p.uid for p in reclaim_candidates(qs, used, pods, Amount(1, 0), "ns-b")] == ["a-big"]


def test_reclaim_across_several_borrowing_teams_in_victim_order() -> None:
    qs = [quota("a", "ns-a", gpus=1, borrow_gpus=4), quota("b", "ns-b", gpus=1, borrow_gpus=4),
          quota("c", "ns-c", gpus=6)]
    pods = [
        whole_pod("a1", "ns-a", (0,), priority=5, start=1.0),
        whole_pod("a2", "ns-a", (1,), priority=5, start=2.0),
        whole_pod("b1", "ns-b", (2,), priority=1, start=1.0),
        whole_pod("b2", "ns-b", (3,), priority=7, start=4.0),
    ]
    used = {"a": Amount(2, 0), "b": Amount(2, 0)}
    got = reclaim_candidates(qs, used, pods, Amount(3, 0), "ns-c")
    assert [p.uid for p in got] == ["b1", "a2"]  # one borrowed pod each; b's borrowed one is its lowest


def test_reclaim_candidates_feed_plan_preemption() -> None:
    """Scenario 4c in the core: a borrows b's idle GPUs; b asks for 2; preemption picks a's borrowed pods."""
    policy = build_policy("best-fit")
    snap = ClusterSnapshot([gpu_node("n0", 4), gpu_node("n1", 4)])
    qs = [quota("a", "ns-a", gpus=4, borrow_gpus=4), quota("b", "ns-b", gpus=4)]
    pods = [whole_pod(f"a{i}", "ns-a", (i % 4,), node=f"n{i // 4}", start=float(i)) for i in range(8)]
    for pod in pods:
        snap.assume(pod.request, pod.placement)
    used = usage(qs, [(p.request.namespace, held_by(p.placement)) for p in pods])
    demand = PodRequest(name="b-job", cpu_milli=1000, gpu_count=2, gpu_milli=1000, namespace="ns-b")
    assert admit(qs, used, demand_of(demand), "ns-b").ok
    candidates = reclaim_candidates(qs, used, pods, demand_of(demand), "ns-b")
    assert [p.uid for p in candidates] == ["a7", "a6", "a5", "a4"]  # the newest four are borrowed
    plan = plan_preemption(snap, demand, 1 << 30, candidates, policy, np.random.default_rng(0))
    assert plan is not None and plan.node == "n1"
    assert sorted(v.uid for v in plan.victims) in (["a6", "a7"], ["a4", "a5"], ["a5", "a6"], ["a4", "a7"],
                                                   ["a4", "a6"], ["a5", "a7"])
    assert len(plan.victims) == 2
