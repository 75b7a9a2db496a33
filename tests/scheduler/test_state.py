"""The scheduler's ledger and live snapshot, fed with the JSON the API server would send."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from gpupool_common.handshake import (
    AllocationAck,
    ack_annotations,
    assignment_annotations,
)
from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.kube.assignment import build_assignment
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.registry import build_policy
from tests.support.objects import bump, node_obj, pod_obj
from tests.support.scheduler_state import free_gpus, schedule


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState("gpupool")
    s.apply_node(node_obj("n1"))
    s.apply_node(node_obj("n2"))
    return s


def test_assume_twice_is_refused_and_forget_releases(state: ClusterState) -> None:
    obj = pod_obj("a", gpus=2)
    placement = schedule(state, obj)
    assert state.pods[obj["metadata"]["uid"]].phase is Phase.ASSUMED
    assert sorted(free_gpus(state, placement.node)).count(0) == 2
    with pytest.raises(ValueError, match="already in the ledger"):
        state.assume(state.plan(obj), placement)
    state.forget(obj["metadata"]["uid"])
    assert free_gpus(state, placement.node) == [1000] * 4
    assert obj["metadata"]["uid"] not in state.pods


def test_bound_pod_rebuilds_from_its_assignment_and_ack_corrects(state: ClusterState) -> None:
    """After a restart the ledger comes from annotations: the assignment, then the kubelet's ack."""
    obj = pod_obj("a", gpus=1)
    plan = state.plan(obj)
    spec = state.nodes["n1"].spec
    assignment = build_assignment(plan, Placement(node="n1", gpu_indices=(2,), gpu_milli=1000,
                                                  gpu_memory_mib=spec.gpus[2].memory_mib), spec)
    fresh = ClusterState("gpupool")
    fresh.apply_node(node_obj("n1", pod_identity=False))  # a plugin that needs the gate
    bound = bump(obj, node="n1", annotations=assignment_annotations(assignment))
    fresh.apply_pod(bound)
    assert free_gpus(fresh, "n1") == [1000, 1000, 0, 1000]
    assert fresh.pods[plan.uid].gate_since is not None  # pending, not acknowledged: holds its gate
    # the plugin acknowledges GPU 3 instead (the kubelet's choice wins)
    ack = AllocationAck(node="n1", pod_uid=plan.uid, containers={"main": {"nvidia.com/gpu": (spec.gpus[3].uuid,)}},
                        complete=True)
    update = fresh.apply_pod(bump(bound, annotations=ack_annotations(ack)))
    assert update.gate_released == "n1"
    assert free_gpus(fresh, "n1") == [1000, 1000, 1000, 0]


def test_stale_events_never_move_state_backwards(state: ClusterState) -> None:
    obj = pod_obj("a", gpus=1, node="n1", scheduler="other")
    older = copy.deepcopy(obj)
    state.apply_pod(bump(obj, phase="Running"))
    assert sum(1 for f in free_gpus(state, "n1") if f == 0) == 1
    deleted = bump(obj)
    state.apply_pod(deleted, deleted=True)
    assert free_gpus(state, "n1") == [1000] * 4
    state.apply_pod(older)  # a re-list that started before the deletion
    assert free_gpus(state, "n1") == [1000] * 4
    assert state.is_gone(obj["metadata"]["uid"])


def test_foreign_gpu_pod_without_ack_is_reserved_somewhere(state: ClusterState) -> None:
    obj = pod_obj("theirs", gpus=3, node="n2", scheduler="default-scheduler")
    state.apply_pod(obj)
    assert sorted(free_gpus(state, "n2")) == [0, 0, 0, 1000]
    assert state.unknown_devices == 1


def test_node_replaced_keeps_its_pods_and_removed_node_hides_them(state: ClusterState) -> None:
    obj = pod_obj("a", gpus=2, node="n1", scheduler="other")
    state.apply_pod(obj)
    node = node_obj("n1")
    node["spec"]["taints"] = [{"key": "k", "value": "v", "effect": "NoSchedule"}]
    state.apply_node(node)
    assert sorted(free_gpus(state, "n1")) == [0, 0, 1000, 1000]
    assert state.snapshot.nodes[state.snapshot.index["n1"]].taints
    state.delete_node("n1")
    assert "n1" not in state.snapshot.index
    assert not state.pods[obj["metadata"]["uid"]].applied
    state.apply_node(node_obj("n1"))  # it comes back: its pod is accounted again
    assert sorted(free_gpus(state, "n1")) == [0, 0, 1000, 1000]


def test_heartbeat_does_not_touch_the_snapshot(state: ClusterState) -> None:
    version = state.snapshot.version.copy()
    node = node_obj("n1")
    node["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastHeartbeatTime": "now"}]
    assert state.apply_node(node) is None
    assert np.array_equal(state.snapshot.version, version)


def test_gate_blocks_same_shape_until_ack_or_running(state: ClusterState) -> None:
    a, b, c = pod_obj("a", gpus=1), pod_obj("b", gpus=1), pod_obj("c", gpus=2)
    pa = schedule(state, a)
    state.hold_gate(a["metadata"]["uid"], {("nvidia.com/gpu", 1)})
    assert state.gate_blocker(b["metadata"]["uid"], pa.node, frozenset({("nvidia.com/gpu", 1)})) is not None
    assert state.gate_blocker(c["metadata"]["uid"], pa.node, frozenset({("nvidia.com/gpu", 2)})) is None
    state.mark_bound(a["metadata"]["uid"])
    released = state.apply_pod(bump(a, node=pa.node, phase="Running"))
    assert released.gate_released == pa.node
    assert state.gate_blocker(b["metadata"]["uid"], pa.node, frozenset({("nvidia.com/gpu", 1)})) is None


GPU1 = frozenset({("nvidia.com/gpu", 1)})


def test_same_shape_pods_go_where_the_gate_is_open() -> None:
    """Best-fit packs consecutive pods onto one node; while a pod there waits for its ack, the next
    pod of the same shape goes to a node whose gate is open (another shape still packs)."""
    s = ClusterState("gpupool")
    for name in ("n1", "n2"):
        s.apply_node(node_obj(name, pod_identity=False))
    a, b, c = pod_obj("a", gpus=1), pod_obj("b", gpus=1), pod_obj("c", gpus=2)
    pa = schedule(s, a)
    assert s.needs_gate(pa.node) and s.gate_busy(GPU1) == {pa.node}
    pb = schedule(s, b)
    assert pb.node != pa.node, "b was placed behind a's gate although another node was open"
    pc = schedule(s, c)
    assert pc.node == pa.node, "a pod of another shape is not held back by the gate"
    assert s.gate_busy(GPU1) == {"n1", "n2"}
    pd = schedule(s, pod_obj("d", gpus=1))  # every node busy for this shape: placed anyway, waits at the gate
    assert pd.node in ("n1", "n2")
    s.hold_gate(a["metadata"]["uid"], GPU1)
    s.mark_bound(a["metadata"]["uid"])
    s.apply_pod(bump(a, node=pa.node, phase="Running"))  # a's gate opens
    s.forget(pd_uid := next(u for u, e in s.pods.items() if e.key == "ns/d"))
    assert pd_uid not in s.pods
    assert s.gate_busy(GPU1) == {pb.node}
    assert schedule(s, pod_obj("e", gpus=1)).node == pa.node


def test_no_gate_where_the_plugin_knows_pod_identity(state: ClusterState) -> None:
    """Nodes whose inventory says pod_identity (the plugin reads PodResources): no gate is held, so
    best-fit packs same-shape pods onto one node as the simulator does."""
    a, b = pod_obj("a", gpus=1), pod_obj("b", gpus=1)
    pa, pb = schedule(state, a), schedule(state, b)
    assert not state.needs_gate(pa.node)
    assert state.gate_busy(GPU1) == set()
    assert pb.node == pa.node


def test_gate_times_out() -> None:
    now = [0.0]
    s = ClusterState("gpupool", gate_timeout_s=5.0, clock=lambda: now[0])
    s.apply_node(node_obj("n1"))
    a = pod_obj("a", gpus=1)
    schedule(s, a)
    s.hold_gate(a["metadata"]["uid"], {("nvidia.com/gpu", 1)})
    assert s.gate_blocker("other", "n1", frozenset({("nvidia.com/gpu", 1)})) is not None
    now[0] = 6.0
    assert s.gate_blocker("other", "n1", frozenset({("nvidia.com/gpu", 1)})) is None
    assert s.gate_timeouts == 1


def test_bound_but_never_seen_is_marked_uncertain_not_freed() -> None:
    """kube-scheduler forgets an assumed pod the watch never confirms; after a watch gap that frees GPUs
    a bound pod uses. Here it keeps them, marked for a read (tests/scheduler/test_bind_outcomes.py)."""
    now = [0.0]
    s = ClusterState("gpupool", confirm_ttl_s=10.0, clock=lambda: now[0])
    s.apply_node(node_obj("n1"))
    a = pod_obj("a", gpus=4)
    schedule(s, a)
    s.mark_bound(a["metadata"]["uid"])
    now[0] = 11.0
    assert [e.key for e in s.expire()] == ["ns/a"]
    assert s.pods[a["metadata"]["uid"]].uncertain and free_gpus(s, "n1") == [0] * 4
    assert s.expire() == []  # asked once; the read settles it


def test_scheduler_state_decides_exactly_as_the_simulator() -> None:
    """The same small trace through the simulator's replay and through the scheduler's state and cycle."""
    from gpupool_sched.kube.podspec import PodPlan
    from gpupool_sched.placement.fragmentation import WorkloadProfile
    from gpupool_sched.simulate.replay import replay
    from gpupool_sched.simulate.trace import read_trace

    trace = read_trace()
    nodes = list(trace.nodes[:60])
    pods = list(trace.pods[:400])
    profile = WorkloadProfile.from_requests(trace.pods, spec_of=trace.spec_of)
    policy = build_policy("gpupool", profile)
    expected = replay(nodes, pods, policy, profile, seed=3)

    plain = ClusterSnapshot(nodes)
    rng = np.random.default_rng(3)
    sim_decisions = []
    for request in pods:
        d = decide(plain, request, policy, rng)
        if isinstance(d, Placement):
            plain.assume(request, d)
            sim_decisions.append((d.node, d.gpu_indices, d.gpu_milli))
        else:
            sim_decisions.append(None)

    state = ClusterState("gpupool")
    for spec in reversed(nodes):  # arrival order of nodes must not matter
        state.upsert_node(NodeView(spec, None, None, None, False))
    cycle = Cycle(state, lambda: policy, seed=3)
    got = []
    for i, request in enumerate(pods):
        plan = PodPlan(uid=f"p{i}", namespace="ns", name=request.name, created=float(i), priority=0,
                       request=request, containers=(), memory_unit_mib=1024)
        result = cycle.schedule(plan)
        if result.statement is None:
            got.append(None)
            continue
        d = result.statement.placements[0][1]
        got.append((d.node, d.gpu_indices, d.gpu_milli))
    assert got == sim_decisions
    assert [g is None for g in got] == expected.failed.tolist()
    used = [sum(p.gpu_milli * len(p.gpu_indices) for p in (e.placement,)) for e in state.pods.values()]
    assert sum(used) == int(expected.used_milli[-1])


def test_gpus_the_kubelet_cannot_allocate_yet_are_not_offered() -> None:
    """After a kubelet restart the node's allocatable nvidia.com/gpu is 0 until the device plugin registers
    again; a GPU pod bound then fails admission (UnexpectedAdmissionError, seen on a real kubelet). The
    node offers its GPUs again once the kubelet reports them."""
    s = ClusterState("gpupool")
    restarted = node_obj("n1")
    for key in ("nvidia.com/gpu", "nvidia.com/gpu-memory"):
        restarted["status"]["allocatable"][key] = "0"
    s.apply_node(restarted)
    result = Cycle(s, lambda: build_policy("best-fit")).schedule(s.plan(pod_obj("a", gpus=1)))
    assert result.statement is None and result.unschedulable is not None
    assert "kubelet reports 0 allocatable nvidia.com/gpu" in str(s.nodes["n1"].problem)
    result = Cycle(s, lambda: build_policy("best-fit")).schedule(s.plan(pod_obj("b", units=4)))
    assert result.statement is None
    s.apply_node(node_obj("n1"))  # registered again
    assert schedule(s, pod_obj("c", gpus=1)).node == "n1"


# ---- idle pods (gpupool.io/idle-pods, issue 20 §2) ------------------------------------------------

def _with_idle(node: dict, text: str | None) -> dict:
    out = copy.deepcopy(node)
    out["metadata"]["resourceVersion"] = str(int(out["metadata"]["resourceVersion"]) + 1000)
    if text is None:
        out["metadata"]["annotations"].pop("gpupool.io/idle-pods", None)
    else:
        out["metadata"]["annotations"]["gpupool.io/idle-pods"] = text
    return out


def test_idle_pods_annotation_is_read_per_node_and_a_pod_no_longer_listed_is_busy_at_once() -> None:
    state = ClusterState("gpupool")
    node = node_obj("n1")
    state.apply_node(node)
    obj = pod_obj("a", gpus=1, node="n1", phase="Running")
    state.apply_pod(obj)
    uid = obj["metadata"]["uid"]
    assert state.idle_since(uid) is None
    node = _with_idle(node, f'{{"{uid}":"2026-12-02T14:00:00Z","other":"2026-12-02T13:00:00Z"}}')
    state.apply_node(node)
    assert state.idle_since(uid) == 1_796_220_000.0  # 2026-12-02T14:00:00Z
    node = _with_idle(node, "{}")
    state.apply_node(node)
    assert state.idle_since(uid) is None
    node = _with_idle(node, f'{{"{uid}":"2026-12-02T14:00:00Z"}}')
    state.apply_node(node)
    node = _with_idle(node, None)  # absent: nothing is idle
    state.apply_node(node)
    assert state.idle_since(uid) is None


def test_idle_pods_listed_by_another_node_do_not_count() -> None:
    state = ClusterState("gpupool")
    n1, n2 = node_obj("n1"), node_obj("n2")
    state.apply_node(n1)
    obj = pod_obj("a", gpus=1, node="n1", phase="Running")
    state.apply_pod(obj)
    uid = obj["metadata"]["uid"]
    state.apply_node(_with_idle(n2, f'{{"{uid}":"2026-12-02T14:00:00Z"}}'))
    assert state.idle_since(uid) is None
    state.delete_node("n2")
    assert "n2" not in state.idle_pods


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"u": 5}', '{"u": "yesterday"}'])
def test_a_malformed_idle_pods_annotation_means_nothing_idle_and_is_counted(text: str) -> None:
    state = ClusterState("gpupool")
    seen: list[tuple[str, str]] = []
    state.on_idle_invalid = lambda node, problem: seen.append((node, problem))
    node = node_obj("n1")
    state.apply_node(node)
    obj = pod_obj("a", gpus=1, node="n1", phase="Running")
    state.apply_pod(obj)
    uid = obj["metadata"]["uid"]
    state.apply_node(_with_idle(node, f'{{"{uid}":"2026-12-02T14:00:00Z"}}'))
    state.apply_node(_with_idle(node, text))
    assert state.idle_since(uid) is None
    assert [n for n, _ in seen] == ["n1"]
    state.apply_node(_with_idle(node, text))  # the same text again: counted once
    assert len(seen) == 1
