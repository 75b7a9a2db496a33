"""Migration's marks on the ledger (cache/reservations.py) and the statement that owns them, and who may
move (framework/plugins/movers.py)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

import pytest

from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.movers import Movers
from gpupool_sched.framework.plugins.victims import DisruptionBudgets
from gpupool_sched.framework.statement import Statement
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.registry import build_policy
from tests.support.objects import node_obj, pod_obj

_n = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def world() -> tuple[ClusterState, Clock]:
    clock = Clock()
    state = ClusterState("gpupool", clock=clock)
    state.apply_node(node_obj("n1"))
    state.apply_node(node_obj("n2"))
    return state, clock


def running(state: ClusterState, node: str, *, gpus: int = 1, owner: str | None = "ReplicaSet",
            annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
            started: str = "2026-11-30T10:00:00Z") -> str:
    obj: dict[str, Any] = pod_obj(f"p{next(_n)}", gpus=gpus, node=node, phase="Running", annotations=annotations)
    if owner is not None:
        obj["metadata"]["ownerReferences"] = [{"kind": owner, "name": "app", "uid": "o", "controller": True}]
    if labels:
        obj["metadata"]["labels"] = labels
    obj["status"]["startTime"] = started
    state.apply_pod(obj)
    return str(obj["metadata"]["uid"])


def free_gpus(state: ClusterState, node: str) -> int:
    row = state.snapshot.index[node]
    return int((state.snapshot.free_milli[row][: len(state.nodes[node].spec.gpus)] == 1000).sum())


def test_a_reservation_is_accounted_at_once_and_a_replacement_claims_it() -> None:
    state, _ = world()
    mover = running(state, "n1")
    before = free_gpus(state, "n2")
    reservation = state.reserve("blocked", state.pods[mover], Placement("n2", (3,), 1000, 46068), 60.0)
    assert state.pods[reservation.uid].phase is Phase.RESERVED and free_gpus(state, "n2") == before - 1
    assert state.migrating_nodes() == {"n2"}
    replacement = pod_obj("new", gpus=1)
    replacement["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "app", "uid": "o",
                                                   "controller": True}]
    plan = state.plan(replacement)
    assert state.reservation_for(plan) is reservation
    other = pod_obj("stranger", gpus=1)  # no owner: not a replacement
    assert state.reservation_for(state.plan(other)) is None
    with Statement(state) as statement:
        statement.claim(plan, reservation.uid)
        assert free_gpus(state, "n2") == before  # released for the decision
        statement.assume(plan, Placement("n2", (3,), 1000, 46068))
        statement.commit()
    assert not state.reservations and reservation.uid not in state.pods
    assert state.replaced[plan.uid] == mover and free_gpus(state, "n2") == before - 1


def test_a_replacement_lands_on_the_reserved_devices_not_just_the_node() -> None:
    """The policy would put a one-GPU pod on one GPU; the reservation holds another of that node. The
    replacement must take the reserved one: on the mover's own node (shares gathered to free a whole GPU)
    the policy's pick may be the GPU the blocked pod waits for (tests/e2e/test_defrag.py saw a second
    move for a whole-GPU pod when the replacement joined the GPU its mover left)."""
    state, _ = world()
    mover = running(state, "n1")
    probe = decide(state.snapshot, state.plan(pod_obj("probe", gpus=1)).request, build_policy("best-fit"))
    assert isinstance(probe, Placement)  # where the policy puts a one-GPU pod on its own
    row = state.snapshot.index[probe.node]
    reserved = max(j for j in range(4) if state.snapshot.free_milli[row][j] == 1000 and (j,) != probe.gpu_indices)
    reservation = state.reserve("blocked", state.pods[mover], Placement(probe.node, (reserved,), 1000, 46068), 60.0)
    replacement = pod_obj("new", gpus=1)
    replacement["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "app", "uid": "o",
                                                   "controller": True}]
    result = Cycle(state, lambda: build_policy("best-fit")).schedule(state.plan(replacement))
    assert result.statement is not None
    placed = result.statement.placements[0][1]
    assert (placed.node, placed.gpu_indices) == (probe.node, (reserved,)), placed
    assert not state.reservations and reservation.uid not in state.pods


def test_a_claim_not_placed_and_a_discarded_reservation_are_undone() -> None:
    state, _ = world()
    mover = running(state, "n1")
    before = free_gpus(state, "n2")
    reservation = state.reserve("blocked", state.pods[mover], Placement("n2", (0,), 1000, 46068), 60.0)
    plan = state.plan(pod_obj("x", gpus=1))
    with Statement(state) as statement:
        statement.claim(plan, reservation.uid)
        statement.commit()  # nothing placed: the reservation is accounted again
    assert reservation.uid in state.reservations and free_gpus(state, "n2") == before - 1
    with Statement(state) as statement:
        statement.claim(plan, reservation.uid)
        statement.discard()
    assert free_gpus(state, "n2") == before - 1
    other = running(state, "n1")
    with Statement(state) as statement:
        statement.reserve(plan, state.pods[other], Placement("n2", (1,), 1000, 46068), 60.0)
        assert free_gpus(state, "n2") == before - 2
    assert free_gpus(state, "n2") == before - 1  # not committed: the new reservation is gone
    with pytest.raises(ValueError):
        state.reserve("blocked", state.pods[mover], Placement("n2", (1,), 1000, 46068), 60.0)


def test_reservations_expire_and_end_with_their_blocked_pod() -> None:
    state, clock = world()
    before = free_gpus(state, "n2")
    a, b = running(state, "n1"), running(state, "n1")
    state.reserve("blocked-1", state.pods[a], Placement("n2", (0,), 1000, 46068), 60.0)
    state.reserve("blocked-2", state.pods[b], Placement("n2", (1,), 1000, 46068), 600.0)
    clock.now += 61
    assert [r.mover for r in state.expire_reservations()] == [a]
    blocked = pod_obj("blocked-2", gpus=1, uid="blocked-2")
    state.apply_pod(blocked)
    state.apply_pod(blocked, deleted=True)  # the pod it moved for is gone: the migration is abandoned
    assert not state.reservations and free_gpus(state, "n2") == before


def test_who_may_move() -> None:
    state, clock = world()
    budgets = DisruptionBudgets()
    now = datetime(2026, 11, 30, 10, 10, tzinfo=UTC).timestamp()  # pods started at 10:00 ran 10 minutes
    movers = Movers(state, budgets, DefragConfig(min_runtime_s=300), clock=clock, wall=lambda: now)
    rs = running(state, "n1")
    sts = running(state, "n1", owner="StatefulSet")
    opted_in = running(state, "n1", owner=None, annotations={"gpupool.io/movable": "true"})
    running(state, "n1", owner=None)  # bare
    running(state, "n1", owner="Job")  # a Job's pod without the annotation
    running(state, "n1", annotations={"gpupool.io/movable": "false"})
    running(state, "n2", labels={"scheduling.x-k8s.io/pod-group": "g"})  # a gang member
    running(state, "n2", started="2026-11-30T10:09:00Z")  # a young pod: 1 minute
    running(state, "n2", gpus=0)  # holds no GPU
    assert {m.pod.uid for m in movers.candidates(priority=0)} == {rs, sts, opted_in}
    assert movers.candidates(priority=-1) == []  # never a pod of higher priority than the blocked one
    budgets.apply("ADDED", {"metadata": {"namespace": "ns", "name": "pdb"},
                            "spec": {"selector": {"matchLabels": {}}}, "status": {"disruptionsAllowed": 0}})
    assert movers.candidates(priority=0) == []  # a budget that allows nothing protects them all


def test_the_budget_and_the_cooldown() -> None:
    state, clock = world()
    movers = Movers(state, DisruptionBudgets(), DefragConfig(per_hour=2, cooldown_s=3600), clock=clock)
    a, b = running(state, "n1"), running(state, "n1")
    assert movers.budget_left() == 2 and movers.may_move_for(120) is None
    assert movers.may_move_for(10) is not None  # not waited `after_s` (60 s) yet
    movers.carried_out([a])
    assert movers.budget_left() == 1
    assert {m.pod.uid for m in movers.candidates(0)} == {b}  # a cools down
    state.replaced["a-replacement"] = a  # its replacement inherits the cooldown
    movers.carried_out([b])
    assert movers.budget_left() == 0 and "budget (2 moves per hour) is spent" in (movers.may_move_for(120) or "")
    clock.now += 3601
    assert movers.budget_left() == 2
    default = Movers(state, DisruptionBudgets(), DefragConfig(), clock=clock)
    assert default.budget() == 1  # 1 % of 2 running GPU pods, at least 1


def test_a_refused_surge_refunds_its_own_move_not_the_newest() -> None:
    state, clock = world()
    movers = Movers(state, DisruptionBudgets(), DefragConfig(per_hour=1, cooldown_s=60), clock=clock)
    a, b = running(state, "n1"), running(state, "n1")
    movers.carried_out([a])  # a surge for a's Deployment starts
    clock.now += 100
    movers.carried_out([b])
    b_at = clock.now
    clock.now += 100
    movers.refuse("ReplicaSet/a-owner", refunded=a)  # a's surge was refused: nothing was disturbed
    assert movers.budget_left() == 0
    assert movers.budget_frees_at() == b_at + 3600.0  # when b's move leaves the hour, not a's (100 s earlier)
    movers.refuse("ReplicaSet/b-owner")  # rolled back: it disturbed, so it still counts
    assert movers.budget_frees_at() == b_at + 3600.0
