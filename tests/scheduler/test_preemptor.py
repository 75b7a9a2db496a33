"""Preemption in the service, without a cluster: the cycle's plan, victims marked, holds kept for the
preemptor when its victims go, holds released or expired, and the preemptor's API calls and Events."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle, CycleResult
from gpupool_sched.framework.plugins.victims import (
    DEFAULT_MAX_CHECKPOINT_GRACE_S,
    DisruptionBudgets,
    may_preempt,
    nomination_timeout_s,
    running_pods,
)
from gpupool_sched.framework.queue import QueuedPod, SchedulingQueue
from gpupool_sched.framework.statement import Statement
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.writer.preemptor import Preemptor
from tests.support.objects import bump, node_obj, nominated, pod_obj, terminating
from tests.support.scheduler_state import free_gpus


def prio_pod(name: str, priority: int, *, gpus: int = 1, node: str | None = None, scheduler: str = "other",
             labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
             policy: str | None = None) -> dict[str, Any]:
    obj = pod_obj(name, gpus=gpus, node=node, scheduler=scheduler, phase="Running" if node else "Pending",
                  annotations=annotations)
    obj["spec"]["priority"] = priority
    if policy is not None:
        obj["spec"]["preemptionPolicy"] = policy
    obj["metadata"]["labels"] = dict(labels or {})
    return obj


class World:
    """Two 4-GPU nodes full of 1-GPU pods of another scheduler: priority 100 on n1, 200 on n2."""

    def __init__(self) -> None:
        self.now = [0.0]
        self.state = ClusterState("gpupool", clock=lambda: self.now[0])
        self.state.apply_node(node_obj("n1"))
        self.state.apply_node(node_obj("n2"))
        self.budgets = DisruptionBudgets()
        self.pods: dict[str, dict[str, Any]] = {}
        for node, priority in (("n1", 100), ("n2", 200)):
            for i in range(4):
                obj = prio_pod(f"{node}-low-{i}", priority, node=node, labels={"app": node},
                               annotations={"gpupool.io/checkpoint-grace-seconds": "90"} if i == 0 else None)
                self.pods[obj["metadata"]["uid"]] = obj
                self.state.apply_pod(obj)
        self.cycle = Cycle(self.state, lambda: build_policy("best-fit"), nomination_slack_s=60.0)

    def schedule(self, obj: dict[str, Any], preempt: bool = True) -> CycleResult:
        plan = self.state.plan(obj)
        return self.cycle.schedule(plan, (lambda: running_pods(self.state, self.budgets)) if preempt else None)

    def delete(self, uid: str) -> None:
        self.state.apply_pod(bump(self.pods[uid]), deleted=True)


@pytest.fixture
def world() -> World:
    return World()


def test_plan_marks_exactly_the_victims_and_nominates(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    result = world.schedule(big)
    assert result.unschedulable is not None and result.preemption is not None
    assert result.preemption.node == "n1"  # the lowest-priority victims
    victims = {v.uid for v in result.preemption.victims}
    assert {world.pods[u]["metadata"]["name"] for u in victims} == {f"n1-low-{i}" for i in range(4)}
    assert all(world.state.pods[u].evicting_for == big["metadata"]["uid"] for u in victims)
    assert not victims & {e.uid for e in world.state.running()}  # never chosen again
    nomination = world.state.nominations[big["metadata"]["uid"]]
    assert nomination.node == "n1" and nomination.victims == victims
    assert nomination.deadline == pytest.approx(90 + 60)  # the longest checkpoint grace + slack
    assert world.state.nomination_live(big["metadata"]["uid"])


def test_holds_keep_the_freed_gpus_for_the_preemptor(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    result = world.schedule(big)
    assert result.preemption is not None
    for victim in result.preemption.victims:
        world.delete(victim.uid)
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # held, not free
    holds = [e for e in world.state.pods.values() if e.phase is Phase.NOMINATED]
    assert len(holds) == 4 and {e.node for e in holds} == {"n1"}
    # a pod of lower (or equal) priority finds the room taken
    for priority in (500, 1000):
        other = prio_pod(f"other-{priority}", priority, gpus=1, scheduler="gpupool")
        assert world.schedule(other, preempt=False).statement is None
    # the preemptor itself fits there now, and its holds go with its placement
    placed = world.schedule(big)
    assert placed.statement is not None and placed.unschedulable is None
    placement = placed.statement.placements[0][1]
    assert placement.node == "n1" and sorted(placement.gpu_indices) == [0, 1, 2, 3]
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    assert not [e for e in world.state.pods.values() if e.phase is Phase.NOMINATED]
    assert big["metadata"]["uid"] not in world.state.nominations


def test_preemptor_still_blocked_keeps_its_holds(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    result = world.schedule(big)
    assert result.preemption is not None
    first, *rest = result.preemption.victims
    world.delete(first.uid)
    again = world.schedule(big)
    assert again.statement is None and again.preemption is None  # victims still terminating: no new plan
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # the one hold is accounted again
    assert world.state.nominations[big["metadata"]["uid"]].victims == {v.uid for v in rest}


def test_holds_expire(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    result = world.schedule(big)
    assert result.preemption is not None
    for victim in result.preemption.victims:
        world.delete(victim.uid)
    world.now[0] = 149.0
    assert world.state.expire_nominations() == []
    world.now[0] = 151.0
    assert [n.key for n in world.state.expire_nominations()] == ["ns/critical"]
    assert free_gpus(world.state, "n1") == [1000] * 4
    assert not world.state.nominations and not any(e.phase is Phase.NOMINATED for e in world.state.pods.values())


def test_deleted_preemptor_releases_its_holds(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    result = world.schedule(big)
    assert result.preemption is not None
    victims = list(result.preemption.victims)
    world.delete(victims[0].uid)
    update = world.state.apply_pod(bump(big), deleted=True)
    assert update.freed
    assert sorted(free_gpus(world.state, "n1")).count(1000) == 1
    assert not world.state.nominations
    world.delete(victims[1].uid)  # a victim going after its preemptor: simply freed
    assert sorted(free_gpus(world.state, "n1")).count(1000) == 2


def test_live_nomination_does_not_preempt_again(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    assert world.schedule(big).preemption is not None
    again = world.schedule(big)
    assert again.preemption is None and again.statement is None
    assert all(e.evicting_for is None for e in world.state.entries("n2"))


def test_never_pods_and_higher_priority_only(world: World) -> None:
    never = prio_pod("polite", 1000, gpus=4, scheduler="gpupool", policy="Never")
    assert not may_preempt(never, ())
    assert may_preempt(prio_pod("x", 1000, scheduler="gpupool", policy="PreemptLowerPriority"), ())
    by_class = prio_pod("y", 1000, scheduler="gpupool")
    by_class["spec"]["priorityClassName"] = "polite-class"
    assert not may_preempt(by_class, {"polite-class"})
    assert world.schedule(never, preempt=may_preempt(never, ())).preemption is None
    assert not world.state.nominations
    equal = prio_pod("equal", 100, gpus=1, scheduler="gpupool")  # only strictly lower priorities are victims
    assert world.schedule(equal).preemption is None


def test_pdb_blocked_pods_are_spared_when_possible(world: World) -> None:
    world.budgets.apply("ADDED", {
        "metadata": {"namespace": "ns", "name": "keep-n1"},
        "spec": {"selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["n1"]}]}},
        "status": {"disruptionsAllowed": 0},
    })
    blocked = {p.uid for p in running_pods(world.state, world.budgets) if p.pdb_blocked}
    assert blocked == {u for u, o in world.pods.items() if o["spec"]["nodeName"] == "n1"}
    result = world.schedule(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    assert result.preemption is not None and result.preemption.node == "n2"  # fewer PDB violations wins
    world.budgets.apply("DELETED", {"metadata": {"namespace": "ns", "name": "keep-n1"}})
    assert not any(p.pdb_blocked for p in running_pods(world.state, world.budgets))


def test_only_protected_victims_left_means_waiting_not_evicting(world: World) -> None:
    def budget(name: str, app: str, allowed: int) -> dict[str, Any]:
        return {"metadata": {"namespace": "ns", "name": name},
                "spec": {"selector": {"matchLabels": {"app": app}}}, "status": {"disruptionsAllowed": allowed}}

    assert world.budgets.apply("ADDED", budget("keep-n1", "n1", 0)) is False  # new: stricter, not relaxed
    assert world.budgets.apply("ADDED", budget("keep-n2", "n2", 0)) is False
    result = world.schedule(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    # the best plan would evict 4 protected pods: nobody is marked, nothing nominated, the pod waits
    assert result.preemption is None and result.statement is None and result.unschedulable is not None
    assert result.blocked_by_budget is not None and result.blocked_by_budget.pdb_violations == 4
    assert not world.state.nominations and not world.state.preemptions
    assert all(e.evicting_for is None for n in ("n1", "n2") for e in world.state.entries(n))
    # a budget that allows more disruptions, or one that is gone, relaxes; the same status does not
    assert world.budgets.apply("MODIFIED", budget("keep-n1", "n1", 0)) is False
    assert world.budgets.apply("MODIFIED", budget("keep-n1", "n1", 4)) is True
    assert world.budgets.apply("DELETED", budget("keep-n2", "n2", 0)) is True
    again = world.schedule(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    assert again.preemption is not None and again.preemption.node == "n1" and again.blocked_by_budget is None


def test_a_budget_allowing_one_disruption_protects_all_but_one_of_its_pods(world: World) -> None:
    """The budget over n1's pods allows 1 disruption: evicting all four of them would be refused at the
    second, so the plan takes n2 (higher priority, but no violation) instead; the pods each carry the
    budget, counted down per victim (kube-scheduler's filterPodsWithPDBViolation)."""
    world.budgets.apply("ADDED", {
        "metadata": {"namespace": "ns", "name": "one-of-n1"},
        "spec": {"selector": {"matchLabels": {"app": "n1"}}}, "status": {"disruptionsAllowed": 1},
    })
    candidates = {p.uid: p for p in running_pods(world.state, world.budgets)}
    n1 = [u for u, o in world.pods.items() if o["spec"]["nodeName"] == "n1"]
    assert all(candidates[u].budgets == (("ns/one-of-n1", 1),) and not candidates[u].pdb_blocked for u in n1)
    result = world.schedule(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    assert result.preemption is not None and result.preemption.node == "n2"
    assert result.preemption.pdb_violations == 0 and result.blocked_by_budget is None
    one = world.schedule(prio_pod("small", 1000, gpus=1, scheduler="gpupool"))  # one victim: within budget
    assert one.preemption is not None and one.preemption.node == "n1" and len(one.preemption.victims) == 1


def test_nomination_timeout_defaults_to_30s_grace(world: World) -> None:
    plain = [u for u, o in world.pods.items() if not o["metadata"]["annotations"]]
    assert nomination_timeout_s(world.state, plain[:2], 10.0) == 40.0


def with_grace(world: World, node: str, seconds: int) -> None:
    """The pods on `node` declare `terminationGracePeriodSeconds: seconds` (n1-low-0 keeps its 90 s
    checkpoint annotation, which the eviction uses instead)."""
    for uid, obj in list(world.pods.items()):
        if obj["spec"]["nodeName"] == node:
            obj = bump(obj)
            obj["spec"]["terminationGracePeriodSeconds"] = seconds
            world.pods[uid] = obj
            world.state.apply_pod(obj)


def test_the_nomination_lasts_the_victims_real_grace_and_nobody_else_is_evicted(world: World) -> None:
    """Victims with a 600 s grace period: the room is held 600 s + the slack, not 90 s + the slack
    (the checkpoint annotation of one victim), so the preemptor does not give up while they shut down
    and preempt n2 as well (issue 16, A7: 8 pods evicted for one 4-GPU pod)."""
    with_grace(world, "n1", 600)
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    uid = big["metadata"]["uid"]
    result = world.schedule(big)
    assert result.preemption is not None and result.preemption.node == "n1"
    assert world.state.nominations[uid].deadline == pytest.approx(600 + 60)
    for victim in result.preemption.victims:  # evicted: terminating for up to their grace
        grace = 90 if victim.request.name == "n1-low-0" else 600
        world.state.apply_pod(terminating(world.pods[victim.uid], grace_s=grace))
    world.now[0] = 650.0
    assert world.state.expire_nominations() == []
    again = world.schedule(big)
    assert again.preemption is None and again.statement is None
    assert all(e.evicting_for is None for e in world.state.entries("n2"))  # nobody else evicted
    world.now[0] = 661.0
    assert [n.key for n in world.state.expire_nominations()] == ["ns/critical"]


def test_a_checkpoint_grace_above_the_cap_is_clamped_and_said(world: World) -> None:
    """`gpupool.io/checkpoint-grace-seconds` has a cap (`--max-checkpoint-grace`, 3600 s by default):
    a larger value is clamped for the eviction and for the hold, and the victim's Event says so."""
    first = next(u for u, o in world.pods.items() if o["metadata"]["name"] == "n1-low-0")
    world.pods[first] = bump(world.pods[first], annotations={"gpupool.io/checkpoint-grace-seconds": "86400"})
    world.state.apply_pod(world.pods[first])
    assert nomination_timeout_s(world.state, [first], 60.0) == DEFAULT_MAX_CHECKPOINT_GRACE_S + 60.0 == 3660.0
    assert nomination_timeout_s(world.state, [first], 60.0, max_checkpoint_grace_s=120) == 180.0
    world.cycle.max_checkpoint_grace_s = 120
    api = FakeApi()
    recorder, _, big = carry_out(world, api, max_checkpoint_grace_s=120)
    assert world.state.nominations[big["metadata"]["uid"]].deadline == pytest.approx(120 + 60)
    assert ("evict", "n1-low-0", "120") in api.calls
    (event,) = [e for e in recorder.events if e[0] == "n1-low-0" and e[2] == "Preempted"]
    assert "checkpoint grace 120s (gpupool.io/checkpoint-grace-seconds asks 86400s; capped at 120s)" in event[3]


# ---- the preemptor: API calls, Events, failures ------------------------------------------------

class FakeApi:
    def __init__(self, fail: dict[str, ApiError] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[tuple[str, ...]] = []

    async def set_nominated_node(self, namespace: str, name: str, node: str | None) -> None:
        self.calls.append(("nominate", name, str(node)))

    async def evict(self, namespace: str, name: str, uid: str, grace_s: int | None) -> None:
        self.calls.append(("evict", name, str(grace_s)))
        if name in self.fail:
            raise self.fail[name]


class FakeRecorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []

    def record(self, namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
        self.events.append((name, kind, reason, message))


def carry_out(world: World, api: FakeApi,
              max_checkpoint_grace_s: int = 3600) -> tuple[FakeRecorder, SchedulingQueue, dict[str, Any]]:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    recorder = FakeRecorder()

    async def run() -> SchedulingQueue:
        queue = SchedulingQueue()
        queue.add(QueuedPod(uid=big["metadata"]["uid"], key="ns/critical", priority=1000, created=0.0))
        item = queue.pop()
        assert item is not None
        result = world.schedule(big)
        assert result.preemption is not None
        queue.park(item, ())
        preemptor = Preemptor(world.state, api, queue, SchedulerMetrics(), recorder,  # type: ignore[arg-type]
                              max_checkpoint_grace_s=max_checkpoint_grace_s)
        preemptor.carry_out(world.state.plan(big), result.preemption)
        await preemptor.drain()
        return queue

    return recorder, asyncio.run(run()), big


def test_preemptor_evicts_with_checkpoint_grace_and_posts_events(world: World) -> None:
    api = FakeApi()
    recorder, queue, big = carry_out(world, api)
    assert api.calls[0] == ("nominate", "critical", "n1")
    evictions = {c[1]: c[2] for c in api.calls[1:]}
    assert evictions == {"n1-low-0": "90", "n1-low-1": "None", "n1-low-2": "None", "n1-low-3": "None"}
    preempting = [e for e in recorder.events if e[2] == "Preempting"]
    assert len(preempting) == 1 and preempting[0][0] == "critical" and "n1-low-3" in preempting[0][3]
    preempted = sorted(e[0] for e in recorder.events if e[2] == "Preempted")
    assert preempted == [f"n1-low-{i}" for i in range(4)]
    assert all(e[1] == "Warning" and "Preempted by ns/critical (priority 1000) on node n1" in e[3]
               for e in recorder.events if e[2] == "Preempted")
    assert world.state.nomination_live(big["metadata"]["uid"])
    assert queue.where(big["metadata"]["uid"]) == "unschedulable"  # waits for its victims to go


def test_pdb_refusal_aborts_and_spares_the_rest(world: World) -> None:
    order = [f"n1-low-{i}" for i in range(4)]
    # the victims are evicted most important first; refuse the second one
    api = FakeApi()
    probe_world = World()
    carry_out(probe_world, api)
    second = [c[1] for c in api.calls if c[0] == "evict"][1]
    assert second in order
    api = FakeApi({second: ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's "
                                    "disruption budget.")})
    recorder, queue, big = carry_out(world, api)
    evicted = [c[1] for c in api.calls if c[0] == "evict"]
    assert len(evicted) == 2 and evicted[1] == second  # stopped at the refusal
    assert api.calls[-1] == ("nominate", "critical", "None")  # nomination cleared
    assert big["metadata"]["uid"] not in world.state.nominations
    assert [e[0] for e in recorder.events if e[2] == "Preempted"] == [evicted[0]]
    assert any(e[2] == "PreemptionFailed" for e in recorder.events)
    spared = {u for u, o in world.pods.items() if o["metadata"]["name"] not in (evicted[0],)
              and o["spec"]["nodeName"] == "n1"}
    assert all(world.state.pods[u].evicting_for is None for u in spared)
    first = next(u for u, o in world.pods.items() if o["metadata"]["name"] == evicted[0])
    assert world.state.pods[first].evicting_for  # its eviction went out: it stays marked
    assert queue.where(big["metadata"]["uid"]) in ("backoff", "active")  # retried, not parked


def test_victim_already_gone_is_fine(world: World) -> None:
    api = FakeApi({"n1-low-2": ApiError(404, "NotFound", "gone")})
    recorder, _, big = carry_out(world, api)
    assert len([c for c in api.calls if c[0] == "evict"]) == 4
    assert world.state.nomination_live(big["metadata"]["uid"])
    assert "n1-low-2" not in [e[0] for e in recorder.events if e[2] == "Preempted"]


def test_terminating_pods_are_no_victims(world: World) -> None:
    uid = next(u for u, o in world.pods.items() if o["metadata"]["name"] == "n1-low-1")
    leaving = bump(world.pods[uid])
    leaving["metadata"]["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    world.state.apply_pod(leaving)
    assert uid not in {p.uid for p in running_pods(world.state, world.budgets)}
    world.state.apply_pod(bump(leaving), deleted=True)  # no nomination of ours: simply freed
    assert sorted(free_gpus(world.state, "n1")).count(1000) == 1


def test_a_pod_preempts_at_most_max_preemptions_times(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    uid = big["metadata"]["uid"]
    for _ in range(3):
        result = world.schedule(big)
        assert result.preemption is not None
        world.state.spare(uid, (v.uid for v in result.preemption.victims))  # e.g. a PDB refused them all
        world.state.end_nomination(uid)
    assert world.schedule(big).preemption is None
    assert world.state.preemptions[uid] == 3
    world.state.apply_pod(bump(big), deleted=True)
    assert uid not in world.state.preemptions


# ---- a nomination another instance made (failover, restart): rebuilt from status.nominatedNodeName ----

def hold_90s(victims: set[str]) -> float:
    """An adopted nomination's hold: 90 s whatever its victims."""
    return 90.0


def n1_victims(world: World) -> list[str]:
    return [u for u, o in world.pods.items() if o["spec"]["nodeName"] == "n1"]


@pytest.mark.parametrize("victims_first", [False, True])
def test_a_new_leader_adopts_the_nomination_holds_the_room_and_does_not_preempt_again(
    world: World, victims_first: bool
) -> None:
    """`world` is the new leader: it never decided the preemption. The old leader set the pod's
    nominatedNodeName and evicted n1's pods; the new one sees that in either order (a LIST lists
    pods in any order)."""
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    uid = big["metadata"]["uid"]
    victims = n1_victims(world)
    events = [terminating(world.pods[v]) for v in victims[:3]]  # the fourth is evicted later
    pending = nominated(big, "n1")
    if victims_first:
        for obj in events:
            world.state.apply_pod(obj)
    nomination = world.state.adopt_nomination(uid, "ns/critical", "n1", 1000, hold_90s)
    assert nomination is not None and nomination.adopted
    if not victims_first:
        for obj in events:
            world.state.apply_pod(obj)
    assert nomination.victims == set(victims[:3])
    assert world.state.adopt_nomination(uid, "ns/critical", "n1", 1000, hold_90s) is None  # seen: once
    # the preemptor comes up: its victims still terminate, so no second preemption (n2 untouched)
    again = world.schedule(pending)
    assert again.preemption is None and again.statement is None
    assert all(e.evicting_for is None for e in world.state.entries("n2"))
    # the fourth victim is evicted late and joins; the gone ones' GPUs are held, not free
    world.state.apply_pod(terminating(world.pods[victims[3]]))
    assert nomination.victims == set(victims)
    for v in victims:
        world.delete(v)
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    other = prio_pod("other", 500, gpus=1, scheduler="gpupool")
    assert world.schedule(other, preempt=False).statement is None  # lower priority: the room is taken
    placed = world.schedule(pending)
    assert placed.statement is not None and placed.statement.placements[0][1].node == "n1"
    assert uid not in world.state.nominations


def test_an_adopted_nomination_ends_when_its_field_is_cleared_or_expires(world: World) -> None:
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    uid = big["metadata"]["uid"]
    victims = n1_victims(world)
    world.state.adopt_nomination(uid, "ns/critical", "n1", 1000, hold_90s)
    world.state.apply_pod(terminating(world.pods[victims[0]]))
    world.delete(victims[0])
    assert sorted(free_gpus(world.state, "n1")).count(1000) == 0  # held
    assert world.state.drop_adopted(uid)  # the leader cleared nominatedNodeName: the hold is free
    assert sorted(free_gpus(world.state, "n1")).count(1000) == 1
    # a nomination this instance decided itself is not dropped by that path, nor adopted again
    result = world.schedule(big)
    assert result.preemption is not None and result.preemption.node == "n1"
    node = result.preemption.node
    assert not world.state.drop_adopted(uid)
    assert world.state.adopt_nomination(uid, "ns/critical", node, 1000, hold_90s) is None
    # expiry releases an adopted nomination's holds like any other
    world.state.end_nomination(uid)
    world.state.adopt_nomination(uid, "ns/critical", "n2", 1000, hold_90s)
    world.now[0] = 91.0
    assert [n.key for n in world.state.expire_nominations()] == ["ns/critical"]


@pytest.mark.parametrize("victims_first", [False, True])
def test_an_adopted_nomination_lasts_its_victims_real_grace(world: World, victims_first: bool) -> None:
    """After a failover the victims are terminating with the grace their eviction gave them
    (metadata.deletionGracePeriodSeconds, 600 s here): the adopted hold lasts that plus the slack, also
    for victims seen terminating only after the nomination was adopted (a LIST in any order)."""
    big = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    uid = big["metadata"]["uid"]
    events = [terminating(world.pods[v], grace_s=600) for v in n1_victims(world)]

    def hold(victims: set[str]) -> float:
        return nomination_timeout_s(world.state, victims, 60.0)

    if victims_first:
        for obj in events:
            world.state.apply_pod(obj)
    world.now[0] = 10.0
    nomination = world.state.adopt_nomination(uid, "ns/critical", "n1", 1000, hold)
    assert nomination is not None
    if not victims_first:
        world.now[0] = 20.0
        for obj in events:
            world.state.apply_pod(obj)
    assert nomination.victims == set(n1_victims(world))
    assert nomination.deadline == pytest.approx(world.now[0] + 600 + 60)
    world.now[0] = 600.0
    assert world.state.expire_nominations() == []
    assert world.schedule(nominated(big, "n1")).preemption is None  # still live: no second node
    assert all(e.evicting_for is None for e in world.state.entries("n2"))


def test_lower_priority_or_unrelated_terminations_do_not_join(world: World) -> None:
    small = prio_pod("mid", 150, gpus=1, scheduler="gpupool")  # above n1's 100, below n2's 200
    uid = small["metadata"]["uid"]
    world.state.adopt_nomination(uid, "ns/mid", "n2", 150, hold_90s)
    n2 = [u for u, o in world.pods.items() if o["spec"]["nodeName"] == "n2"]
    world.state.apply_pod(terminating(world.pods[n2[0]]))
    assert world.state.nominations[uid].victims == set()  # priority 200 is no victim of 150
    world.state.apply_pod(terminating(world.pods[n1_victims(world)[0]]))
    assert world.state.nominations[uid].victims == set()  # another node


def mid_holding_n1(world: World) -> dict[str, Any]:
    """A 4-GPU pod of priority 500 that preempted n1's four pods, all gone: n1's GPUs are held for it."""
    mid = prio_pod("mid", 500, gpus=4, scheduler="gpupool")
    result = world.schedule(mid)
    assert result.preemption is not None and result.preemption.node == "n1"
    for victim in result.preemption.victims:
        world.delete(victim.uid)
    return mid


def test_a_more_important_pod_takes_a_lower_preemptors_holds_and_equal_or_lower_ones_do_not(world: World) -> None:
    """kube-scheduler counts a nominated pod only against pods of its priority or lower."""
    mid = mid_holding_n1(world)
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # held for mid
    for priority in (100, 500):  # not more important: the room stays mid's
        other = prio_pod(f"other-{priority}", priority, gpus=4, scheduler="gpupool")
        assert world.schedule(other, preempt=False).statement is None
    critical = prio_pod("critical", 1000, gpus=4, scheduler="gpupool")
    placed = world.schedule(critical, preempt=False)  # no eviction needed: it takes the held room
    assert placed.statement is not None and placed.statement.placements[0][1].node == "n1"
    assert all(e.evicting_for is None for e in world.state.entries("n2"))  # n2's pods keep running
    nomination = world.state.nominations[mid["metadata"]["uid"]]
    assert nomination.holds == set() and not [e for e in world.state.pods.values() if e.phase is Phase.NOMINATED]
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # critical's, counted once


def test_holds_on_another_node_come_back_after_a_more_important_pod_is_placed(world: World) -> None:
    mid = mid_holding_n1(world)
    world.state.apply_pod(bump(world.pods[next(u for u, o in world.pods.items()
                                               if o["metadata"]["name"] == "n2-low-0")]), deleted=True)
    critical = prio_pod("critical", 1000, gpus=1, scheduler="gpupool")
    placed = world.schedule(critical, preempt=False)
    assert placed.statement is not None
    assert placed.statement.placements[0][1].node == "n2"  # best fit: n2's one free GPU, not mid's room
    assert len(world.state.nominations[mid["metadata"]["uid"]].holds) == 4  # so mid keeps all its holds
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]


def test_a_more_important_gang_takes_a_lower_preemptors_holds(world: World) -> None:
    mid = mid_holding_n1(world)
    members = [world.state.plan(prio_pod(f"gang-{i}", 1000, gpus=2, scheduler="gpupool")) for i in range(2)]
    low_gang = [world.state.plan(prio_pod(f"low-gang-{i}", 500, gpus=2, scheduler="gpupool")) for i in range(2)]
    assert world.cycle.schedule_gang(low_gang, 2).statement is None  # equal priority: the room is mid's
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]
    placed = world.cycle.schedule_gang(members, 2)  # no preemption asked: only the held room can serve
    assert placed.statement is not None
    assert {p.node for _, p in placed.statement.placements} == {"n1"}
    assert world.state.nominations[mid["metadata"]["uid"]].holds == set()
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0]  # the gang's, counted once


# ---- the statement owns every hold it releases ------------------------------------------------------
def held_gpus(world: World) -> int:
    return sum(1 for e in world.state.pods.values() if e.phase is Phase.NOMINATED and e.applied)


def test_a_discarded_statement_accounts_every_released_hold_again(world: World) -> None:
    mid_holding_n1(world)
    critical = world.state.plan(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    with Statement(world.state) as statement:
        statement.release_holds([critical])  # mid's holds are lower: released for critical's decision
        assert free_gpus(world.state, "n1") == [1000] * 4
    assert statement.committed is False  # left without a commit: discarded
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0] and held_gpus(world) == 4
    with pytest.raises(RuntimeError, match="discarded"):
        statement.commit()


def test_a_failing_decision_leaves_no_hold_released_and_nothing_assumed(world: World) -> None:
    mid = mid_holding_n1(world)

    def broken() -> Any:
        raise RuntimeError("placement core failed")

    world.cycle.policy = broken
    for members in ([world.state.plan(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))],
                    [world.state.plan(prio_pod(f"g-{i}", 1000, gpus=2, scheduler="gpupool")) for i in range(2)]):
        with pytest.raises(RuntimeError, match="placement core failed"):
            if len(members) == 1:
                world.cycle.schedule(members[0])
            else:
                world.cycle.schedule_gang(members, 2)
        assert free_gpus(world.state, "n1") == [0, 0, 0, 0] and held_gpus(world) == 4
        assert len(world.state.nominations[mid["metadata"]["uid"]].holds) == 4
        assert not any(m.uid in world.state.pods for m in members)


def test_a_gang_member_that_cannot_be_assumed_undoes_the_others_and_the_released_holds(world: World) -> None:
    mid_holding_n1(world)
    member = world.state.plan(prio_pod("g-0", 1000, gpus=2, scheduler="gpupool"))
    with pytest.raises(ValueError, match="already in the ledger"):
        world.cycle.schedule_gang([member, member], 2)  # the second assumption of one pod fails
    assert member.uid not in world.state.pods  # the first one was undone
    assert free_gpus(world.state, "n1") == [0, 0, 0, 0] and held_gpus(world) == 4


def test_a_commit_without_placements_gives_every_lower_hold_back(world: World) -> None:
    mid = mid_holding_n1(world)
    critical = world.state.plan(prio_pod("critical", 1000, gpus=4, scheduler="gpupool"))
    with Statement(world.state) as statement:
        statement.release_holds([critical])
        statement.commit()  # nothing placed: nothing taken, every hold comes back
    assert len(world.state.nominations[mid["metadata"]["uid"]].holds) == 4 and held_gpus(world) == 4
    with pytest.raises(RuntimeError, match="committed"):
        statement.release_holds([critical])


def test_running_pods_reuses_unchanged_candidates_and_rebuilds_changed_ones(world: World) -> None:
    first = {p.uid: p for p in running_pods(world.state, world.budgets)}
    again = {p.uid: p for p in running_pods(world.state, world.budgets)}
    assert first.keys() == again.keys() and all(again[u] is first[u] for u in first)  # the memo
    uid = next(u for u, o in world.pods.items() if o["metadata"]["name"] == "n1-low-1")
    obj = bump(world.pods[uid])
    obj["metadata"]["labels"] = {"app": "other"}
    world.pods[uid] = obj
    world.state.apply_pod(obj)
    world.budgets.apply("ADDED", {
        "metadata": {"namespace": "ns", "name": "keep-other"},
        "spec": {"selector": {"matchLabels": {"app": "other"}}},
        "status": {"disruptionsAllowed": 0},
    })
    after = {p.uid: p for p in running_pods(world.state, world.budgets)}
    assert after[uid].pdb_blocked and after[uid].budgets == (("ns/keep-other", 0),)
    assert not any(p.pdb_blocked for u, p in after.items() if u != uid)
    world.state.pods[uid].evicting_for = "someone"  # being evicted: no candidate any more
    assert uid not in {p.uid for p in running_pods(world.state, world.budgets)}
    assert {p.uid for p in running_pods(world.state, world.budgets, below=150)} == {
        u for u, o in world.pods.items() if o["spec"]["nodeName"] == "n1" and u != uid}
