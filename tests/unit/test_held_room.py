"""`held_room`: what a preemption's placement takes beyond what its victims free, exactly as the snapshot
accounts it, so that the nominator can hold the free room a plan counts on (docs/preemption.md)."""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.held_room import held_room
from gpupool_sched.placement.preemption import Preemption
from tests.support.clusters import Cluster, gpu_node, gpus, mig_node


def account(c: Cluster, plan: Preemption, request: PodRequest) -> None:
    """Victims still accounted and the room held must take, GPU by GPU, exactly what the preemptor takes
    once its victims are gone (the victims here take nothing it does not need)."""
    room = held_room(c.snap, plan.node, [(request, plan.placement)], plan.victims, "hold", 10)
    held = c.snap.copy()
    for r, p in room:
        assert held.fits(r, p)  # free now
        held.assume(r, p)
    placed = c.snap.copy()
    for victim in plan.victims:
        placed.release(victim.request, victim.placement)
    placed.assume(request, plan.placement)
    assert np.array_equal(held.free_milli, placed.free_milli)
    assert np.array_equal(held.gpu_mem_free, placed.gpu_mem_free)
    assert held.mig_taken == placed.mig_taken
    assert (held.cpu_free >= 0).all() and (held.cpu_free <= placed.cpu_free).all()


def test_whole_gpus_already_free_are_held_as_one_whole_gpu_part() -> None:
    c = Cluster([gpu_node("a", 4)])
    c.whole("v", "a", [0, 1], priority=0)
    plan = c.plan(gpus(4))
    assert plan is not None and plan.placement.gpu_indices == (0, 1, 2, 3)
    room = held_room(c.snap, "a", [(gpus(4), plan.placement)], plan.victims, "hold", 10)
    assert [(p.gpu_indices, p.gpu_milli) for _, p in room] == [((2, 3), 1000)]
    account(c, plan, gpus(4))


def test_a_memory_share_victim_leaves_the_rest_of_its_gpu_to_the_room() -> None:
    c = Cluster([gpu_node("a", 4)])
    c.whole("v", "a", [0, 1], priority=0)
    c.share("s", "a", 2, 10_240, priority=0)
    plan = c.plan(gpus(4))
    assert plan is not None and {v.uid for v in plan.victims} == {"v", "s"}
    account(c, plan, gpus(4))


def test_victims_free_all_of_it_no_room() -> None:
    c = Cluster([gpu_node("a", 2)])
    c.whole("v", "a", [0, 1], priority=0)
    request = gpus(2, cpu=500)  # less CPU than the victim frees
    plan = c.plan(request)
    assert plan is not None
    assert held_room(c.snap, "a", [(request, plan.placement)], plan.victims, "hold", 10) == []


def test_free_cpu_the_plan_counts_on_is_held_too() -> None:
    c = Cluster([gpu_node("a", 2)])
    c.whole("v", "a", [0, 1], priority=0)  # 1000 milli-CPU
    request = gpus(2, cpu=3000)
    plan = c.plan(request)
    assert plan is not None
    room = held_room(c.snap, "a", [(request, plan.placement)], plan.victims, "hold", 10)
    assert [(r.cpu_milli, p.gpu_indices) for r, p in room] == [(2000, ())]


def test_free_mig_devices_are_held() -> None:
    c = Cluster([mig_node("m")])
    victim = PodRequest(name="v", cpu_milli=100, mig_profile="1g.10gb", mig_count=1, priority=0)
    c.hold("v", victim, Placement("m", mig_devices=("MIG-m-0-b",)), priority=0, start=0, pdb=False)
    request = PodRequest(name="pre", mig_profile="1g.10gb", mig_count=2, priority=10)
    plan = c.plan(request)
    assert plan is not None and sorted(plan.placement.mig_devices) == ["MIG-m-0-b", "MIG-m-0-c"]
    room = held_room(c.snap, "m", [(request, plan.placement)], plan.victims, "hold", 10)
    assert [p.mig_devices for _, p in room] == [("MIG-m-0-c",)]
    account(c, plan, request)


def test_a_whole_gpu_less_a_memory_only_share_is_held_as_a_999_and_a_1_milli_part() -> None:
    c = Cluster([gpu_node("a", 2)])
    share = PodRequest(name="s", cpu_milli=100, gpu_count=1, gpu_memory_mib=10_240, priority=0)
    victim = c.hold("s", share, Placement("a", (1,), 0, 10_240), priority=0, start=0, pdb=False)  # no compute
    plan = Preemption("a", (victim,), Placement("a", (1,), 1000, 40_960), 0)  # a plan that evicts it anyway
    room = held_room(c.snap, "a", [(gpus(1), plan.placement)], plan.victims, "hold", 10)
    assert sorted((p.gpu_indices, p.gpu_milli, p.gpu_memory_mib) for _, p in room) == [
        ((1,), 1, 0), ((1,), 999, 40_960 - 10_240)]
    account(c, plan, gpus(1))
