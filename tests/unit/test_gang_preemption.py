"""Gang preemption's decision (placement/gang_preemption.py): victims for a gang's minimum, all or none."""

from __future__ import annotations

import numpy as np
import pytest

from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.gang import place_gang
from gpupool_sched.placement.gang_preemption import plan_gang_preemption
from tests.support.clusters import (
    BEST_FIT,
    HIGH,
    Cluster,
    assert_same,
    budgeted,
    free_capacity,
    gpu_node,
    gpus,
    policies,
)


def full_cluster(nodes: int = 3, priority: int = 1) -> Cluster:
    """`nodes` 8-GPU nodes, every GPU held by a 1-GPU pod of `priority` (node i's pods start at i)."""
    c = Cluster([gpu_node(f"n{i}", 8) for i in range(nodes)])
    for i in range(nodes):
        for g in range(8):
            c.whole(f"p{i}-{g}", f"n{i}", [g], priority, start=float(i))
    return c


def plan(c: Cluster, members: list[PodRequest], need: int, priority: int = HIGH, policy=BEST_FIT):
    return plan_gang_preemption(c.snap, members, need, priority, c.pods, policy, np.random.default_rng(0))


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_two_8_gpu_members_evict_two_whole_nodes_and_leave_the_snapshot_as_it_was(policy) -> None:
    c = full_cluster()
    before = free_capacity(c.snap)
    out = plan(c, [gpus(8), gpus(8)], 2, policy=policy)
    assert out is not None and out.pdb_violations == 0
    nodes = [m.placement.node for m in out.members]
    assert len(set(nodes)) == 2  # one node each: the first member's victims are not the second's room
    for m in out.members:
        assert {v.node for v in m.victims} == {m.placement.node} and len(m.victims) == 8
    assert len({v.uid for v in out.victims}) == 16
    assert_same(free_capacity(c.snap), before)
    # the plan is right: with those victims gone the gang fits together where it says
    for v in out.victims:
        c.snap.release(v.request, v.placement)
    placed = place_gang(c.snap, [gpus(8), gpus(8)], 2, BEST_FIT)
    assert sorted(p.node for _, p in placed.placements) == sorted(nodes)


def test_nothing_is_evicted_for_half_a_gang() -> None:
    c = full_cluster(nodes=2)
    before = free_capacity(c.snap)
    assert plan(c, [gpus(8), gpus(8), gpus(8)], 3) is None  # a third 8-GPU member fits nowhere
    assert_same(free_capacity(c.snap), before)  # two members were planned before it: undone


def test_minimum_only_and_members_that_fit_take_no_victims() -> None:
    c = full_cluster(nodes=2)
    free = Cluster([gpu_node("n0", 8), gpu_node("n1", 8), gpu_node("spare", 8)])
    for pod in c.pods:
        free.hold(pod.uid, pod.request, pod.placement, pod.priority, pod.start_time, pod.pdb_blocked)
    out = plan(free, [gpus(8), gpus(8), gpus(8)], 2)
    assert out is not None and len(out.members) == 2
    fits, evicts = sorted(out.members, key=lambda m: len(m.victims))
    assert fits.placement.node == "spare" and fits.victims == ()
    assert len(evicts.victims) == 8


def test_only_lower_priority_pods_are_victims() -> None:
    c = full_cluster(nodes=2, priority=HIGH)  # equal priority: never a victim
    assert plan(c, [gpus(4)], 1) is None
    c = full_cluster(nodes=2)
    c.pods[:8] = [p.__class__(p.uid, p.node, HIGH + 1, p.request, p.placement, p.start_time) for p in c.pods[:8]]
    out = plan(c, [gpus(8), gpus(8)], 2)
    assert out is None  # n0 is held by higher priority: only n1 can be emptied for one member


def test_a_protected_victim_is_counted() -> None:
    c = Cluster([gpu_node("n0", 8)])
    for g in range(8):
        c.whole(f"p{g}", "n0", [g], 1, pdb=g == 0)
    out = plan(c, [gpus(4), gpus(4)], 2)
    assert out is not None and out.pdb_violations == 1


def test_a_budget_is_counted_down_across_the_members_nodes() -> None:
    """Two members, each evicting one pod of the same budget (allows 1) on its own node: the second
    eviction would be refused, so the plan counts one violation and the cycle evicts nobody."""
    c = Cluster([gpu_node("n0", 1), gpu_node("n1", 1)])
    budgeted(c, "p0", "n0", 0, 1, {"ns/one": 1})
    budgeted(c, "p1", "n1", 0, 1, {"ns/one": 1})
    out = plan(c, [gpus(1), gpus(1)], 2)
    assert out is not None and len(out.victims) == 2 and out.pdb_violations == 1
    roomy = Cluster([gpu_node("n0", 1), gpu_node("n1", 1)])
    budgeted(roomy, "p0", "n0", 0, 1, {"ns/two": 2})
    budgeted(roomy, "p1", "n1", 0, 1, {"ns/two": 2})
    out = plan(roomy, [gpus(1), gpus(1)], 2)
    assert out is not None and len(out.victims) == 2 and out.pdb_violations == 0


def test_a_gang_that_fits_gets_no_victims() -> None:
    c = Cluster([gpu_node("n0", 8)])
    out = plan(c, [gpus(4), gpus(4)], 2)
    assert out is not None and out.victims == ()
    assert all(isinstance(decide(c.snap, gpus(4), BEST_FIT), Placement) for _ in range(2))


def test_need_out_of_range() -> None:
    with pytest.raises(ValueError):
        plan(full_cluster(nodes=1), [gpus(1)], 2)
