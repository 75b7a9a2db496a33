"""The room a preemptor's plan counts on that is already free is reserved for it while it waits, as
kube-scheduler counts a nominated pod on its nominated node when it filters pods of lower or equal
priority there (RunFilterPluginsWithNominatedPods): a less important pod is not placed on it, a more
important one may take it, and it is released when the nomination ends (placed, deleted, bound
elsewhere, expired)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle, CycleResult
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, running_pods
from gpupool_sched.metrics import gpu_states
from gpupool_sched.placement.registry import build_policy
from tests.support.objects import bump, node_obj, pod_obj
from tests.support.scheduler_state import free_gpus


def prio_pod(name: str, priority: int, *, gpus: int = 0, units: int = 0, node: str | None = None,
             scheduler: str = "gpupool") -> dict[str, Any]:
    obj = pod_obj(name, gpus=gpus, units=units, node=node, scheduler=scheduler,
                  phase="Running" if node else "Pending")
    obj["spec"]["priority"] = priority
    return obj


class World:
    """Two 4-GPU nodes. n1: a 2-GPU pod of priority 100 (and, with `share`, a memory share of priority 100
    on a third GPU); the rest free. n2: full of 1-GPU pods of priority 5000 (nobody's victims here)."""

    def __init__(self, share: bool = False) -> None:
        self.now = [0.0]
        self.state = ClusterState("gpupool", clock=lambda: self.now[0])
        self.state.apply_node(node_obj("n1"))
        self.state.apply_node(node_obj("n2"))
        self.budgets = DisruptionBudgets()
        self.pods: dict[str, dict[str, Any]] = {}
        low = [prio_pod("n1-pair", 100, gpus=2, node="n1", scheduler="other")]
        if share:
            low.append(prio_pod("n1-share", 100, units=4, node="n1", scheduler="other"))
        for obj in (*low, *(prio_pod(f"n2-top-{i}", 5000, gpus=1, node="n2", scheduler="other") for i in range(4))):
            self.pods[obj["metadata"]["uid"]] = obj
            self.state.apply_pod(obj)
        self.cycle = Cycle(self.state, lambda: build_policy("best-fit"), nomination_slack_s=60.0)

    def schedule(self, obj: dict[str, Any], preempt: bool = True) -> CycleResult:
        plan = self.state.plan(obj)
        return self.cycle.schedule(plan, (lambda: running_pods(self.state, self.budgets)) if preempt else None)

    def delete(self, uid: str) -> None:
        self.state.apply_pod(bump(self.pods[uid]), deleted=True)

    def holds(self) -> list[str]:
        return sorted(e.uid for e in self.state.pods.values() if e.phase is Phase.NOMINATED)


def crit_waiting(world: World) -> tuple[dict[str, Any], CycleResult]:
    """`crit` (4 GPUs, priority 1000) preempts on n1: its victims' GPUs plus the ones already free."""
    crit = prio_pod("crit", 1000, gpus=4)
    result = world.schedule(crit)
    assert result.preemption is not None and result.preemption.node == "n1"
    assert {world.pods[v.uid]["metadata"]["name"] for v in result.preemption.victims} <= {"n1-pair", "n1-share"}
    assert sorted(result.preemption.placement.gpu_indices) == [0, 1, 2, 3]  # counts on the free GPUs too
    return crit, result


@pytest.mark.parametrize("priority", [100, 500, 1000])
def test_a_pod_of_lower_or_equal_priority_does_not_take_the_free_room_the_plan_counts_on(priority: int) -> None:
    world = World()
    crit_waiting(world)
    other = prio_pod(f"other-{priority}", priority, gpus=2)
    result = world.schedule(other, preempt=False)
    assert result.statement is None, result.statement.placements  # waits: n1's free GPUs are crit's, n2 is full
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # the victim's GPUs, and the free ones held for crit


def test_the_free_room_stays_held_once_the_victims_are_gone_until_crit_is_placed() -> None:
    world = World()
    crit, result = crit_waiting(world)
    for victim in result.preemption.victims if result.preemption else ():
        world.delete(victim.uid)
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert world.schedule(prio_pod("other", 500, gpus=1), preempt=False).statement is None
    placed = world.schedule(crit)
    assert placed.statement is not None and placed.statement.placements[0][1].node == "n1"
    assert world.holds() == [] and crit["metadata"]["uid"] not in world.state.nominations
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # crit's own, counted once
    world.state.apply_pod(bump(crit, node="n1"), deleted=True)
    assert free_gpus(world.state, "n1") == [1000] * 4  # nothing leaked


def test_a_more_important_pod_may_take_the_free_room() -> None:
    world = World()
    crit, _ = crit_waiting(world)
    top = world.schedule(prio_pod("top", 2000, gpus=2), preempt=False)  # no eviction: the free room only
    assert top.statement is not None
    assert top.statement.placements[0][1].node == "n1"
    assert sorted(top.statement.placements[0][1].gpu_indices) == [2, 3]
    nomination = world.state.nominations[crit["metadata"]["uid"]]
    assert nomination.holds == set() and world.holds() == []  # crit re-plans once its victims are gone
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # the victim's and top's, counted once


def end_by_deletion(world: World, crit: dict[str, Any]) -> None:
    world.state.apply_pod(bump(crit), deleted=True)


def end_by_expiry(world: World, crit: dict[str, Any]) -> None:
    world.now[0] = 10_000.0
    assert [n.key for n in world.state.expire_nominations()] == ["ns/crit"]


def end_by_binding_elsewhere(world: World, crit: dict[str, Any]) -> None:
    world.delete(next(u for u, o in world.pods.items() if o["metadata"]["name"] == "n2-top-0"))
    world.state.apply_pod(bump(crit, node="n2"))


@pytest.mark.parametrize("end", [end_by_deletion, end_by_expiry, end_by_binding_elsewhere])
def test_the_free_room_is_released_when_the_nomination_ends(end: Any) -> None:
    world = World()
    crit, _ = crit_waiting(world)
    end(world, crit)
    assert crit["metadata"]["uid"] not in world.state.nominations and world.holds() == []
    assert free_gpus(world.state, "n1")[2:] == [1000, 1000]  # the free GPUs are free again
    placed = world.schedule(prio_pod("other", 500, gpus=2), preempt=False)
    assert placed.statement is not None and placed.statement.placements[0][1].node == "n1"


def test_a_memory_share_victim_leaves_exactly_its_part_of_the_gpu_to_the_free_room_hold() -> None:
    world = World(share=True)
    crit, result = crit_waiting(world)
    assert result.preemption is not None and len(result.preemption.victims) == 2
    share = next(v for v in result.preemption.victims if world.pods[v.uid]["metadata"]["name"] == "n1-share")
    (share_gpu,) = share.placement.gpu_indices
    assert share_gpu not in (0, 1)  # a memory share beside the pair
    row = world.state.snapshot.index["n1"]
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert int(world.state.snapshot.gpu_mem_free[row, share_gpu]) == 0  # the share's memory + the rest, exactly
    assert world.schedule(prio_pod("share-500", 500, units=1), preempt=False).statement is None
    for victim in result.preemption.victims:
        world.delete(victim.uid)
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert int(world.state.snapshot.gpu_mem_free[row, share_gpu]) == 0
    placed = world.schedule(crit)
    assert placed.statement is not None and world.holds() == []
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert [int(m) for m in world.state.snapshot.gpu_mem_free[row, :4]] == [0, 0, 0, 0]


def test_the_free_room_counts_as_held_gpus() -> None:
    world = World()
    crit_waiting(world)
    assert gpu_states(world.state)["free"] == 0  # n1's free GPUs are held for crit


def test_a_gang_holds_the_free_room_its_members_count_on() -> None:
    world = World()
    members = [world.state.plan(prio_pod(f"gang-{i}", 1000, gpus=2)) for i in range(2)]
    result = world.cycle.schedule_gang(members, 2, running=lambda: running_pods(world.state, world.budgets))
    assert result.statement is not None and result.statement.evictions  # one member waits for n1-pair
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert world.schedule(prio_pod("other", 500, gpus=2), preempt=False).statement is None
    for _, preemption in result.statement.evictions:
        for victim in preemption.victims:
            world.delete(victim.uid)
    placed = world.cycle.schedule_gang(members, 2)
    assert placed.statement is not None and {p.node for _, p in placed.statement.placements} == {"n1"}
    assert world.holds() == [] and not world.state.nominations


def test_a_more_important_preemptor_counting_on_a_lower_ones_free_room_takes_it_without_double_counting() -> None:
    """kube-scheduler clears the nominations of lower-priority pods on the node it nominates a pod to;
    here their holds on that node go (the nominations stay while their victims terminate)."""
    state = ClusterState("gpupool", clock=lambda: 0.0)
    state.apply_node(node_obj("n1", "dgx-h100"))
    for name, priority in (("p", 100), ("q", 300)):
        state.apply_pod(prio_pod(name, priority, gpus=2, node="n1", scheduler="other"))  # GPUs 0-1, 2-3
    cycle = Cycle(state, lambda: build_policy("best-fit"), nomination_slack_s=60.0)
    budgets = DisruptionBudgets()

    def schedule(obj: dict[str, Any]) -> CycleResult:
        return cycle.schedule(state.plan(obj), lambda: running_pods(state, budgets))

    mid = prio_pod("mid", 500, gpus=6)
    first = schedule(mid)
    assert first.preemption is not None and [state.pods[v.uid].key for v in first.preemption.victims] == ["ns/p"]
    assert free_gpus(state, "n1") == [0] * 8  # p's, and GPUs 4-7 held for mid
    crit = prio_pod("crit", 1000, gpus=6)
    second = schedule(crit)  # mid's room is not held against crit: q and GPUs 4-7 make room
    assert second.preemption is not None and [state.pods[v.uid].key for v in second.preemption.victims] == ["ns/q"]
    assert state.nominations[mid["metadata"]["uid"]].holds == set()  # crit's now, counted once
    assert free_gpus(state, "n1") == [0] * 8
    snap = state.snapshot
    assert (snap.free_milli >= 0).all() and (snap.gpu_mem_free[snap.gpu_usable] >= 0).all()
