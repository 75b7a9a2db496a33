"""Background consolidation's decision (placement/background.py): empty a partly used GPU into the other
partly used ones, only when that gains, and never in a loop."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.background import Gathering, free_gpu_mask, free_gpus, gpus_vacated, plan_background
from gpupool_sched.placement.consolidation import Movable, Move, moved, overcommitted
from gpupool_sched.placement.fragmentation import TaskClass, WorkloadProfile, cluster_fragmentation_milli
from gpupool_sched.placement.framework import Policy
from tests.support.clusters import BEST_FIT, Cluster, gpu_node, policies

GB = 1024
OWNER = "ReplicaSet/ns/tenants"


def movable(c: Cluster, skip: frozenset[str] = frozenset()) -> list[Movable]:
    return [Movable(p, OWNER) for p in c.pods if p.uid not in skip]


def plan(c: Cluster, policy: Policy = BEST_FIT, **kw: object) -> Gathering | None:
    return plan_background(c.snap, movable(c), policy, **kw)  # type: ignore[arg-type]


def carry_out(c: Cluster, found: Gathering) -> Cluster:
    """The cluster once the plan is done: every mover replaced by a new pod at its destination."""
    after = Cluster([])
    after.snap = moved(c.snap, found.moves)
    assert not overcommitted(after.snap)
    going = {m.pod.uid: m for m in found.moves}
    for p in c.pods:
        move = going.get(p.uid)
        after.pods.append(p if move is None else replace(p, uid=p.uid + "'", node=move.destination.node,
                                                         placement=move.destination, start_time=p.start_time + 100))
    return after


def spread() -> Cluster:
    """Two nodes of two 40 GB GPUs: a/0 10 GB, a/1 20 GB, b/0 10 GB, b/1 free."""
    c = Cluster([gpu_node("a", 2), gpu_node("b", 2)])
    c.share("t1", "a", 0, 10 * GB, priority=0, start=1)
    c.share("t2", "a", 1, 20 * GB, priority=0, start=2)
    c.share("t3", "b", 0, 10 * GB, priority=0, start=3)
    return c


def test_the_least_used_gpu_goes_into_the_fullest_partly_used_one_and_its_node_comes_free() -> None:
    c = spread()
    free_before = free_gpu_mask(c.snap).copy()
    found = plan(c)
    assert found is not None and len(found.moves) == 1, found
    move = found.moves[0]
    assert move.pod.uid == "t3", "b/0 first: as little memory as a/0, on the node with fewer GPUs in use"
    assert (move.destination.node, move.destination.gpu_indices) == ("a", (1,)), "best fit: the fullest GPU"
    assert (found.node, found.gpu, found.free_gpus_before, found.free_gpus_after) == ("b", 0, 1, 2)
    assert found.node_freed
    after = carry_out(c, found).snap
    assert free_gpus(after) == 2 and free_gpu_mask(after)[free_before].all(), "no free GPU was taken"


def test_every_policy_plans_the_same_gain() -> None:
    for policy in policies():
        found = plan(spread(), policy)
        assert found is not None and found.free_gpus_after == found.free_gpus_before + 1, policy


def test_planning_again_after_each_plan_ends_and_never_moves_back() -> None:
    """No loop: each plan frees one more GPU; the GPU it frees is no source or destination of the next;
    after the last plan nothing moves."""
    c = spread()
    freed: list[tuple[str, int]] = []
    counts = [free_gpus(c.snap)]
    for _ in range(10):
        found = plan(c)
        if found is None:
            break
        for node, gpu in freed:
            assert (found.node, found.gpu) != (node, gpu)
            assert all((m.destination.node, m.destination.gpu_indices) != (node, (gpu,)) for m in found.moves)
        freed.append((found.node, found.gpu))
        c = carry_out(c, found)
        counts.append(free_gpus(c.snap))
    else:
        pytest.fail("planning never ended")
    assert counts == [1, 2, 3], "one more whole free GPU per plan, then nothing"
    assert plan(c) is None, "planning again on the final state moves nothing"
    used = [(p.node, p.placement.gpu_indices) for p in c.pods]
    assert used == [("a", (1,))] * 3, "everything gathered on one GPU (10 + 20 + 10 GB of 40)"


def test_nothing_to_gain_moves_nothing() -> None:
    # no other partly used GPU has room: a 30 GB tenant fits on no other partly used GPU
    c = Cluster([gpu_node("a", 2), gpu_node("b", 1)])
    c.share("t1", "a", 0, 30 * GB, priority=0)
    c.share("t2", "a", 1, 30 * GB, priority=0)
    assert plan(c) is None
    # one partly used GPU: moving it would only take a free GPU
    one = Cluster([gpu_node("a", 2)])
    one.share("t1", "a", 0, 10 * GB, priority=0)
    assert plan(one) is None
    # nothing used at all; no movable pod at all
    assert plan(Cluster([gpu_node("a", 2)])) is None
    assert plan_background(spread().snap, [], BEST_FIT) is None


def test_a_move_that_would_raise_the_fgd_fragmentation_is_not_made() -> None:
    """Half-GPU tasks: two GPUs 60 % free each take one each; gathering leaves 20 % + a free GPU, which
    takes only two as well but strands 20 % (the FGD measure goes up): no move for that profile."""
    c = Cluster([gpu_node("a", 2)])
    c.share("t1", "a", 0, 16 * GB, priority=0)  # 400 milli of a 40 GB GPU
    c.share("t2", "a", 1, 16 * GB, priority=0)
    halves = WorkloadProfile((TaskClass(0, 500, 1, frozenset(), 1),))
    assert plan(c) is not None, "without a profile the GPU would be emptied"
    found_without = plan(c)
    assert found_without is not None
    worse = cluster_fragmentation_milli(moved(c.snap, found_without.moves), halves)
    assert worse > cluster_fragmentation_milli(c.snap, halves), "the premise: gathering fragments for halves"
    assert plan(c, profile=halves) is None
    # for a profile of small tasks, the same move lowers nothing and raises nothing: made, reported
    small = WorkloadProfile((TaskClass(0, 100, 1, frozenset(), 1),))
    found = plan(c, profile=small)
    assert found is not None and found.fragmentation_after is not None and found.fragmentation_before is not None
    assert found.fragmentation_after <= found.fragmentation_before


def test_a_gpu_with_a_tenant_that_may_not_move_is_no_source() -> None:
    c = spread()
    c.share("pinned", "b", 0, 5 * GB, priority=0)  # b/0: t3 (movable) and pinned (not)
    found = plan_background(c.snap, movable(c, frozenset({"pinned"})), BEST_FIT)
    assert found is not None and (found.node, found.gpu) == ("a", 0), found
    assert all(m.pod.uid != "t3" for m in found.moves)


def test_every_tenant_of_the_source_needs_a_destination_or_none_moves() -> None:
    """a/0 holds 5 + 5 GB, a/1 35 GB (5 free): a/0's first tenant fits on a/1, the second nowhere, so a/0
    is not emptied (and a/1's tenant fits on no partly used GPU): nothing moves."""
    c = Cluster([gpu_node("a", 3)])
    c.share("t1", "a", 0, 5 * GB, priority=0)
    c.share("t2", "a", 0, 5 * GB, priority=0)
    c.share("t3", "a", 1, 35 * GB, priority=0)
    assert plan(c) is None
    c.share("t4", "a", 2, 10 * GB, priority=0)  # now a/2 can take a/0's two (and its own goes nowhere else)
    found = plan(c)
    assert found is not None and sorted(m.pod.uid for m in found.moves) == ["t1", "t2"], found
    assert {(m.destination.node, m.destination.gpu_indices) for m in found.moves} <= {("a", (1,)), ("a", (2,))}


def test_busy_nodes_are_neither_source_nor_destination_and_whole_gpu_pods_never_move() -> None:
    c = spread()
    found = plan(c, busy=frozenset({"a"}))
    assert found is None, "b/0's only partly used peers are on the busy node a"
    whole = Cluster([gpu_node("a", 2)])
    whole.whole("w", "a", [0], priority=0)
    whole.share("t1", "a", 1, 10 * GB, priority=0)
    assert plan(whole) is None, "a whole-GPU pod is no tenant to move, nor its GPU a destination"


def test_at_most_max_movers_and_a_uid_twice_is_an_error() -> None:
    c = Cluster([gpu_node("a", 2)])
    c.share("t1", "a", 0, 5 * GB, priority=0)
    c.share("t2", "a", 0, 5 * GB, priority=0)
    c.share("t3", "a", 1, 20 * GB, priority=0)
    before = c.snap.free_milli.copy(), c.snap.gpu_mem_free.copy()
    found = plan(c)
    assert found is not None and sorted(m.pod.uid for m in found.moves) == ["t1", "t2"], "a/0: least memory"
    found = plan(c, max_movers=1)
    assert found is not None and [m.pod.uid for m in found.moves] == ["t3"], "a/0 needs two moves: a/1 instead"
    assert np.array_equal(c.snap.free_milli, before[0]) and np.array_equal(c.snap.gpu_mem_free, before[1]), \
        "the snapshot is not modified"
    with pytest.raises(ValueError):
        plan_background(c.snap, [*movable(c), movable(c)[0]], BEST_FIT)
    with pytest.raises(ValueError):
        plan(c, max_movers=0)


def test_gpus_vacated_counts_the_gpus_the_movers_leave_whole() -> None:
    """What the GPUs-freed metric counts: a GPU whose every tenant moves comes free; one a mover shares
    with a tenant that stays does not."""
    c = Cluster([gpu_node("a", 2, gpu_mem=40 * GB), gpu_node("b", 2, gpu_mem=40 * GB)])
    c.share("alone", "a", 0, 10 * GB, priority=0, start=1)
    c.share("shared", "a", 1, 10 * GB, priority=0, start=2)
    c.share("stays", "a", 1, 10 * GB, priority=0, start=3)
    pods = {p.uid: p for p in c.pods}

    def move(uid: str) -> Move:
        return Move(pods[uid], OWNER, Placement("b", (0,), pods[uid].placement.gpu_milli, 10 * GB), 10 * GB)

    assert gpus_vacated(c.snap, [move("alone")]) == 1
    assert gpus_vacated(c.snap, [move("shared")]) == 0
    assert gpus_vacated(c.snap, [move("alone"), move("shared")]) == 1
    assert gpus_vacated(c.snap, [move("shared"), move("stays")]) == 1
    assert gpus_vacated(c.snap, []) == 0
