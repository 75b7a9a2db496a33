"""Consolidation's decision (placement/consolidation.py): the fewest movers, each with a destination."""

from __future__ import annotations

import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.consolidation import (
    Consolidation,
    Movable,
    away_from,
    memory_held_mib,
    plan_consolidation,
)
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.framework import Policy
from tests.support.clusters import BEST_FIT, HIGH, Cluster, gpu_node, gpus, policies

GB = 1024


def share(gb: int, priority: int = HIGH) -> PodRequest:
    return PodRequest(name="blocked", cpu_milli=500, gpu_count=1, gpu_memory_mib=gb * GB, priority=priority)


def movable(c: Cluster, owner: str = "ReplicaSet/ns/tenants") -> list[Movable]:
    return [Movable(p, owner) for p in c.pods]


def plan(c: Cluster, request: PodRequest, policy: Policy = BEST_FIT, *, movable: list[Movable] | None = None,
         **kw: object) -> Consolidation | None:
    pods = movable if movable is not None else [Movable(p, "ReplicaSet/ns/tenants") for p in c.pods]
    return plan_consolidation(c.snap, request, request.priority, pods, policy, np.random.default_rng(0),
                              **kw)  # type: ignore[arg-type]


def carried_out(c: Cluster, request: PodRequest, found: Consolidation) -> ClusterSnapshot:
    """The snapshot once the movers left, their replacements and the blocked pod placed: nothing is
    overcommitted (else assume() or the checks below fail)."""
    after = c.snap.copy()
    for move in found.moves:
        after.release(move.pod.request, move.pod.placement)
    after.assume(request, found.placement)
    for move in found.moves:
        after.assume(move.pod.request, move.destination)
    usable = after.gpu_usable
    assert (after.free_milli[usable] >= 0).all() and (after.gpu_mem_free[usable] >= 0).all()
    assert (after.cpu_free >= 0).all() and (after.mem_free >= 0).all() and (after.pods_free >= 0).all()
    return after


def seed_case() -> Cluster:
    """Three 10 GB tenants spread over three 40 GB GPUs: 90 GB free, 30 GB per GPU."""
    c = Cluster([gpu_node("a", 2), gpu_node("b", 1)])
    c.share("t1", "a", 0, 10 * GB, priority=0, start=1)
    c.share("t2", "a", 1, 10 * GB, priority=0, start=2)
    c.share("t3", "b", 0, 10 * GB, priority=0, start=3)
    return c


def test_the_seed_case_moves_one_tenant_and_the_35gb_pod_fits() -> None:
    c = seed_case()
    request = share(35)
    assert not decide(c.snap.copy(), request, BEST_FIT).schedulable
    for policy in policies():
        found = plan(c, request, policy)
        assert found is not None and len(found.moves) == 1, found
        move = found.moves[0]
        assert move.pod.node == found.node  # a mover leaves the blocked pod's node
        assert (move.destination.node, move.destination.gpu_indices) != (move.pod.node, move.pod.placement.gpu_indices)
        assert found.memory_moved_mib == 10 * GB and found.owners == 1
        after = carried_out(c, request, found)
        assert decide(after, share(1), BEST_FIT).schedulable  # the rest of the pool still works


def test_no_pod_of_higher_priority_than_the_blocked_one_moves() -> None:
    c = Cluster([gpu_node("a", 2), gpu_node("b", 1)])
    for uid, node, gpu in (("t1", "a", 0), ("t2", "a", 1), ("t3", "b", 0)):
        c.share(uid, node, gpu, 10 * GB, priority=HIGH + 1)
    assert plan(c, share(35)) is None
    c2 = Cluster([gpu_node("a", 2), gpu_node("b", 1)])
    for uid, node, gpu in (("t1", "a", 0), ("t2", "a", 1), ("t3", "b", 0)):
        c2.share(uid, node, gpu, 10 * GB, priority=HIGH)  # equal priority: moving is not killing
    assert plan(c2, share(35)) is not None


def test_every_mover_needs_a_destination_or_nothing_moves() -> None:
    """Two 40 GB GPUs, each with a 30 GB tenant: freeing one for a 35 GB pod leaves its tenant nowhere."""
    c = Cluster([gpu_node("a", 1), gpu_node("b", 1)])
    c.share("t1", "a", 0, 30 * GB, priority=0)
    c.share("t2", "b", 0, 30 * GB, priority=0)
    assert plan(c, share(35)) is None


def test_only_the_movable_pods_move() -> None:
    c = seed_case()
    only_t1 = [m for m in movable(c) if m.pod.uid == "t1"]
    found = plan(c, share(35), movable=only_t1)
    assert found is not None and [m.pod.uid for m in found.moves] == ["t1"]
    assert plan(c, share(35), movable=[m for m in movable(c) if m.pod.uid == "nobody"]) is None


def test_fewest_movers_then_least_memory_then_fewest_owners() -> None:
    c = Cluster([gpu_node("a", 1), gpu_node("b", 1), gpu_node("c", 1), gpu_node("spare", 1)])
    c.share("a1", "a", 0, 8 * GB, priority=0)   # a: two small tenants (2 movers)
    c.share("a2", "a", 0, 8 * GB, priority=0)
    c.share("b1", "b", 0, 12 * GB, priority=0)  # b: one 12 GB tenant
    c.share("c1", "c", 0, 10 * GB, priority=0)  # c: one 10 GB tenant: 1 mover, least memory
    c.share("s1", "spare", 0, 20 * GB, priority=0)  # not movable: the others' destination (20 GB free)
    owners = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}
    found = plan(c, share(35), movable=[Movable(p, owners[p.uid]) for p in c.pods if p.uid in owners])
    assert found is not None and found.node == "c" and [m.pod.uid for m in found.moves] == ["c1"]
    carried_out(c, share(35), found)


def test_busy_nodes_neither_give_nor_take() -> None:
    c = seed_case()
    found = plan(c, share(35), busy=frozenset({"b"}))
    assert found is not None and found.node == "a"
    assert all(m.pod.node != "b" and m.destination.node != "b" for m in found.moves)
    assert plan(c, share(35), busy=frozenset({"a", "b"})) is None


def test_max_movers_bounds_the_plan() -> None:
    c = Cluster([gpu_node("a", 1), gpu_node("b", 1)])
    for k in range(4):
        c.share(f"a{k}", "a", 0, 8 * GB, priority=0)  # 32 GB used, 8 free: 4 movers for 35 GB
    found = plan(c, share(35))
    assert found is not None and len(found.moves) == 4
    carried_out(c, share(35), found)
    assert plan(c, share(35), max_movers=3) is None
    with pytest.raises(ValueError):
        plan(c, share(35), max_movers=0)


def test_a_whole_gpu_pod_gets_a_gpu_freed_of_scattered_shares() -> None:
    """One node, two GPUs, a 10 GB tenant on each: the tenants gather on one GPU, the other is whole."""
    c = Cluster([gpu_node("a", 2)])
    c.share("t1", "a", 0, 10 * GB, priority=0)
    c.share("t2", "a", 1, 10 * GB, priority=0)
    request = gpus(1)
    assert not decide(c.snap.copy(), request, BEST_FIT).schedulable
    found = plan(c, request)
    assert found is not None and len(found.moves) == 1
    move = found.moves[0]
    assert move.destination.node == "a" and move.destination.gpu_indices != move.pod.placement.gpu_indices
    assert set(found.placement.gpu_indices) == set(move.pod.placement.gpu_indices)
    carried_out(c, request, found)


def test_once_the_movers_are_at_their_destinations_the_pod_fits_as_is() -> None:
    """KAI's lesson: after the moves the pod needs no further plan; allocate places it on the plan's node."""
    for policy in policies():
        c = seed_case()
        request = share(35)
        found = plan(c, request, policy)
        assert found is not None
        moved = c.snap.copy()
        for move in found.moves:
            moved.release(move.pod.request, move.pod.placement)
            moved.assume(move.pod.request, move.destination)
        placed = decide(moved, request, policy, np.random.default_rng(0))
        assert isinstance(placed, Placement) and placed.node == found.node


def test_memory_held_and_away_from() -> None:
    spec = gpu_node("a", 2)
    assert memory_held_mib(Placement("a", (0, 1), 1000, 40_960), spec) == 2 * 40_960
    assert memory_held_mib(Placement("a", (1,), 250, 10 * GB), spec) == 10 * GB
    kept = away_from(share(1), ["x", "y"])
    snap = ClusterSnapshot([gpu_node("x", 1), gpu_node("y", 1), gpu_node("z", 1)])
    assert decide(snap, kept, BEST_FIT).node == "z"  # type: ignore[union-attr]
    assert away_from(share(1), []) == share(1)


def test_a_uid_given_twice_is_an_error() -> None:
    c = seed_case()
    with pytest.raises(ValueError):
        plan(c, share(35), movable=movable(c) + movable(c)[:1])
