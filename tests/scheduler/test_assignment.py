"""Placement <-> Assignment: building the handshake annotation and reading a bound pod's devices back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpupool_common.handshake import (
    AllocationAck,
    Assignment,
    ContainerAssignment,
    MemoryShare,
    assignment_annotations,
)
from gpupool_deviceplugin.pods import pod_record
from gpupool_sched.kube.assignment import build_assignment, placement_from_annotations, share_milli
from gpupool_sched.kube.podspec import ClusterFacts, PodPlan, plan_pod
from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, MigSlice, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, GpuShape, PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.registry import build_policy

GIB = 1024
L40S_MIB = 44 * GIB  # 44 units of 1 GiB, as in the handshake's worked example
UUIDS = ["GPU-0000", "GPU-64d41a25", "GPU-9bd1a600", "GPU-23d79b79"]


def l40s_node(name: str = "gpu-node-1") -> NodeSpec:
    gpus = tuple(GpuSpec(i, "NVIDIA-L40S", memory_mib=L40S_MIB, uuid=u) for i, u in enumerate(UUIDS))
    return NodeSpec(name, cpu_milli=64_000, memory_mib=512_000, gpus=gpus)


def mig_node(name: str = "mig-node") -> NodeSpec:
    slices = (MigSlice("MIG-a", "3g.40gb", 0), MigSlice("MIG-b", "1g.10gb", 0), MigSlice("MIG-c", "1g.10gb", 0),
              MigSlice("MIG-d", "1g.10gb", 0))
    gpus = (GpuSpec(0, "NVIDIA-A100-SXM4-80GB", 81_920, "GPU-mig0", mig_enabled=True, mig_slices=slices),
            GpuSpec(1, "NVIDIA-A100-SXM4-80GB", 81_920, "GPU-whole1"))
    return NodeSpec(name, cpu_milli=64_000, memory_mib=512_000, gpus=gpus)


FACTS = ClusterFacts(GIB, frozenset({"NVIDIA-L40S", "NVIDIA-A100-SXM4-80GB"}), frozenset({"1g.10gb", "3g.40gb"}), 79)
RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu-memory", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb")


def res(name: str, limits: dict[str, int], restart: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "image": "x", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}
    if restart:
        out["restartPolicy"] = restart
    return out


def pod_obj(containers: list[dict[str, Any]], init: list[dict[str, Any]] = (), uid: str = "5b7c0a52",
            node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers, "initContainers": list(init)}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid}, "spec": spec}


def plan_of(containers: list[dict[str, Any]], init: list[dict[str, Any]] = (), **kw: Any) -> PodPlan:
    return plan_pod(pod_obj(containers, init, **kw), FACTS)


GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
MIG1, MIG3 = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"


def worked_example() -> tuple[PodPlan, Placement, NodeSpec]:
    plan = plan_of([res("server", {MEM: 20}), res("trainer", {GPU: 2})], [res("fetch-weights", {MEM: 2})])
    share = Placement("gpu-node-1", (2,), share_milli(20 * GIB, l40s_node().gpus[2]), 20 * GIB)
    placement = Placement("gpu-node-1", (1, 3), MILLI, L40S_MIB, extras=(share,))
    return plan, placement, l40s_node()


def check_with_plugin(plan: PodPlan, assignment: Assignment, node: NodeSpec) -> None:
    """The device plugin's own check of an assignment against the pod (gpupool_deviceplugin.pods)."""
    containers = [c for c in plan.containers if not c.init]
    init = [c for c in plan.containers if c.init]

    def spec(c: Any) -> dict[str, Any]:
        limits = {r: n for r, n in c.counts().items()}
        return res(c.name, limits, "Always" if c.sidecar else None)

    obj = pod_obj([spec(c) for c in containers], [spec(c) for c in init], uid=plan.uid, node=node.name)
    obj["metadata"]["annotations"] = assignment_annotations(assignment)
    record = pod_record(obj, RESOURCES, node.name)
    assert record.assignment_error is None
    assert record.assignment == assignment


# ---- build_assignment ----------------------------------------------------------------------------


def test_worked_example_of_the_handshake_doc():
    plan, placement, node = worked_example()
    a = build_assignment(plan, placement, node)
    assert a == Assignment(node="gpu-node-1", pod_uid="5b7c0a52", containers=(
        ContainerAssignment(name="fetch-weights", memory=MemoryShare(gpu="GPU-9bd1a600", units=2, unit_mib=1024)),
        ContainerAssignment(name="server", memory=MemoryShare(gpu="GPU-9bd1a600", units=20, unit_mib=1024)),
        ContainerAssignment(name="trainer", devices={GPU: ("GPU-64d41a25", "GPU-23d79b79")}),
    ))
    check_with_plugin(plan, a, node)


def test_whole_gpus_in_consecutive_chunks_in_kubelet_order():
    plan = plan_of([res("a", {GPU: 1}), res("cpu", {}), res("b", {GPU: 1})], [res("side", {GPU: 2}, "Always")])
    a = build_assignment(plan, Placement("gpu-node-1", (3, 0, 1, 2), MILLI, L40S_MIB), l40s_node())
    assert [(c.name, c.devices[GPU]) for c in a.containers] == [
        ("side", (UUIDS[3], UUIDS[0])), ("a", (UUIDS[1],)), ("b", (UUIDS[2],))]
    check_with_plugin(plan, a, l40s_node())


def test_init_container_gets_the_first_devices_of_the_next_taker():
    plan = plan_of([res("app", {GPU: 2})], [res("i1", {GPU: 1}), res("i2", {GPU: 2}), res("s", {GPU: 2}, "Always")])
    a = build_assignment(plan, Placement("gpu-node-1", (0, 1, 2, 3), MILLI, L40S_MIB), l40s_node())
    got = {c.name: c.devices[GPU] for c in a.containers}
    # i1 hands its GPU on to i2, i2 its GPUs to the sidecar (the next taker); the app gets the rest
    assert got == {"i1": (UUIDS[0],), "i2": tuple(UUIDS[:2]), "s": tuple(UUIDS[:2]), "app": tuple(UUIDS[2:])}
    check_with_plugin(plan, a, l40s_node())


def test_init_container_before_the_app_shares_its_first_devices():
    plan = plan_of([res("app", {GPU: 2})], [res("warm", {GPU: 1})])
    a = build_assignment(plan, Placement("gpu-node-1", (2, 3), MILLI, L40S_MIB), l40s_node())
    assert {c.name: c.devices[GPU] for c in a.containers} == {"warm": (UUIDS[2],), "app": (UUIDS[2], UUIDS[3])}
    check_with_plugin(plan, a, l40s_node())


def test_mig_devices_split_per_profile():
    plan = plan_of([res("a", {MIG1: 1}), res("x", {MIG3: 1}), res("b", {MIG1: 2})], [res("i", {MIG1: 1})])
    assert plan.request.gpu_shapes() == (GpuShape(mig_profile="1g.10gb", mig_count=3),
                                         GpuShape(mig_profile="3g.40gb", mig_count=1))
    placement = Placement("mig-node", mig_devices=("MIG-d", "MIG-b", "MIG-c"),
                          extras=(Placement("mig-node", mig_devices=("MIG-a",)),))
    a = build_assignment(plan, placement, mig_node())
    assert [(c.name, c.devices) for c in a.containers] == [
        ("i", {MIG1: ("MIG-d",)}), ("a", {MIG1: ("MIG-d",)}), ("x", {MIG3: ("MIG-a",)}),
        ("b", {MIG1: ("MIG-b", "MIG-c")})]
    check_with_plugin(plan, a, mig_node())


def test_memory_share_with_sidecar_and_several_containers():
    plan = plan_of([res("a", {MEM: 4}), res("b", {MEM: 6})], [res("s", {MEM: 2}, "Always")])
    placement = Placement("gpu-node-1", (1,), share_milli(12 * GIB, l40s_node().gpus[1]), 12 * GIB)
    a = build_assignment(plan, placement, l40s_node())
    assert [(c.name, c.memory.units, c.memory.gpu) for c in a.containers] == [
        ("s", 2, UUIDS[1]), ("a", 4, UUIDS[1]), ("b", 6, UUIDS[1])]
    check_with_plugin(plan, a, l40s_node())


def test_cpu_pod_gets_an_empty_assignment():
    plan = plan_of([res("a", {})])
    assert build_assignment(plan, Placement("gpu-node-1"), l40s_node()).containers == ()


@pytest.mark.parametrize(
    ("placement", "says"),
    [
        (Placement("gpu-node-1", (1,), MILLI, L40S_MIB, extras=(Placement("gpu-node-1", (2,), 466, 20 * GIB),)),
         "2 whole GPU(s) placed on GPUs (1,)"),
        (Placement("gpu-node-1", (1, 1), MILLI, L40S_MIB, extras=(Placement("gpu-node-1", (2,), 466, 20 * GIB),)),
         "placed on GPUs (1, 1)"),
        (Placement("gpu-node-1", (1, 3), MILLI, L40S_MIB), "2 GPU shape(s) but a placement of 1 part(s)"),
        (Placement("gpu-node-1", (1, 3), MILLI, L40S_MIB, extras=(Placement("gpu-node-1", (2, 0), 466, 20 * GIB),)),
         "a memory share placed on GPUs (2, 0)"),
        (Placement("gpu-node-1", (1, 3), MILLI, L40S_MIB, extras=(Placement("gpu-node-1", (2,), 233, 10 * GIB),)),
         "share of 10240 MiB placed"),
        (Placement("gpu-node-1", (1, 7), MILLI, L40S_MIB, extras=(Placement("gpu-node-1", (2,), 466, 20 * GIB),)),
         "has no GPU 7"),
        (Placement("other", (1, 3), MILLI, L40S_MIB, extras=(Placement("other", (2,), 466, 20 * GIB),)),
         "placement is on node 'other'"),
    ],
)
def test_placement_that_does_not_match_the_plan_is_a_bug(placement, says):
    plan, _, node = worked_example()
    with pytest.raises(ValueError) as info:
        build_assignment(plan, placement, node)
    assert says in str(info.value)


def test_mig_placement_errors():
    plan = plan_of([res("a", {MIG1: 2})])
    with pytest.raises(ValueError, match=r"not 1g\.10gb devices"):
        build_assignment(plan, Placement("mig-node", mig_devices=("MIG-a", "MIG-b")), mig_node())
    with pytest.raises(ValueError, match=r"2 MIG 1g\.10gb placed as"):
        build_assignment(plan, Placement("mig-node", mig_devices=("MIG-b",)), mig_node())


def test_gpu_without_uuid_cannot_be_assigned():
    node = NodeSpec("n", 1000, 1000, gpus=(GpuSpec(0, "X", 1000),))
    plan = plan_of([res("a", {GPU: 1})])
    with pytest.raises(ValueError, match="has no UUID"):
        build_assignment(plan, Placement("n", (0,), MILLI, 1000), node)


def test_compute_share_has_no_resource():
    plan = plan_of([res("a", {})])
    plan = PodPlan(plan.uid, plan.namespace, plan.name, 0.0, 0, PodRequest("p", gpu_count=1, gpu_milli=500),
                   plan.containers, GIB)
    with pytest.raises(ValueError, match="no device plugin resource"):
        build_assignment(plan, Placement("gpu-node-1", (0,), 500, 0), l40s_node())


def test_plan_violating_rule_3_cannot_be_assigned():
    obj = pod_obj([res("app", {GPU: 1})], [res("warm", {GPU: 2})])
    plan = plan_pod(obj, FACTS, strict=False)  # the pod asks for 2 at init, 1 after
    assert plan.request.gpu_count == 2  # Kubernetes' max(init, app)
    with pytest.raises(ValueError, match=r"the placement has 2 nvidia\.com/gpu but the containers take 1"):
        build_assignment(plan, Placement("gpu-node-1", (0, 1), MILLI, L40S_MIB), l40s_node())


# ---- placement_from_annotations: round trips ----------------------------------------------------


def parts(p: Placement) -> list[tuple[tuple[int, ...], int, int, tuple[str, ...]]]:
    return [(q.gpu_indices, q.gpu_milli, q.gpu_memory_mib, q.mig_devices) for q in (p, *p.extras)]


def test_round_trip_of_the_worked_example():
    plan, placement, node = worked_example()
    a = build_assignment(plan, placement, node)
    request, back = placement_from_annotations(plan, node, a, None)
    assert request is plan.request
    assert parts(back) == parts(placement) and back.node == node.name


@pytest.mark.parametrize(
    ("containers", "init"),
    [
        ([res("a", {GPU: 1}), res("b", {GPU: 2})], [res("w", {GPU: 1})]),
        ([res("a", {MEM: 7}), res("b", {MEM: 3})], [res("s", {MEM: 2}, "Always"), res("w", {MEM: 5})]),
        ([res("a", {GPU: 1}), res("b", {MEM: 10})], []),
        ([res("a", {MIG1: 2}), res("c", {MIG3: 1})], [res("w", {MIG1: 1})]),
        ([res("a", {GPU: 1}), res("c", {MIG1: 1})], []),
    ],
)
def test_round_trip_through_decide_and_the_snapshot(containers, init):
    """decide() places the plan, the assignment is built, read back, and accounts the same GPUs."""
    node = mig_node() if any(MIG1 in c["resources"]["limits"] for c in containers) else l40s_node()
    plan = plan_of(containers, init)
    snap = ClusterSnapshot([node])
    placement = decide(snap, plan.request, build_policy("best-fit"))
    assert isinstance(placement, Placement), placement
    a = build_assignment(plan, placement, node)
    check_with_plugin(plan, a, node)
    request, back = placement_from_annotations(plan, node, a, None)
    assert request is plan.request
    assert parts(back) == parts(placement)
    # accounting the read-back placement equals accounting the decided one
    other = ClusterSnapshot([node])
    snap.assume(plan.request, placement)
    other.assume(request, back)
    assert (snap.free_milli == other.free_milli).all() and (snap.gpu_mem_free == other.gpu_mem_free).all()
    assert snap.mig_taken == other.mig_taken
    other.release(request, back)
    assert (other.free_milli == ClusterSnapshot([node]).free_milli).all()


def test_share_milli_matches_the_placement_core():
    node = l40s_node()
    for units in (1, 7, 20, 44):
        req = PodRequest("p", gpu_count=1, gpu_memory_mib=units * GIB)
        placement = decide(ClusterSnapshot([node]), req, build_policy("best-fit"))
        assert placement.gpu_milli == share_milli(units * GIB, node.gpus[placement.gpu_indices[0]])


def test_share_milli_of_unknown_memory_is_a_whole_gpu():
    assert share_milli(1024, GpuSpec(0, "X", 0)) == MILLI
    assert share_milli(10 * 1024, GpuSpec(0, "X", 1024)) == MILLI  # more than the GPU has: capped
    assert share_milli(1, GpuSpec(0, "X", 81_920)) == 1


# ---- placement_from_annotations: acks and precedence --------------------------------------------


def ack(containers: dict[str, dict[str, list[str]]], *, complete: bool = True, uid: str = "5b7c0a52",
        node: str = "gpu-node-1", error: str | None = None) -> AllocationAck:
    return AllocationAck(node=node, pod_uid=uid, complete=complete, error=error,
                         containers={c: {r: tuple(ids) for r, ids in rs.items()} for c, rs in containers.items()})


def units(gpu: str, *ks: int) -> list[str]:
    return [f"{gpu}::{k}" for k in ks]


def test_from_ack_alone():
    plan, _, node = worked_example()
    got = placement_from_annotations(plan, node, None, ack({
        "fetch-weights": {MEM: units(UUIDS[2], 0, 1)},
        "server": {MEM: units(UUIDS[2], *range(20))},
        "trainer": {GPU: [UUIDS[3], UUIDS[1]]},
    }))
    request, back = got
    assert request is plan.request
    assert parts(back) == [((1, 3), MILLI, L40S_MIB, ()), ((2,), share_milli(20 * GIB, node.gpus[2]), 20 * GIB, ())]


def test_ack_with_more_gpus_than_the_pod_asks_wins_and_the_request_follows():
    plan = plan_of([res("a", {GPU: 1})])
    request, back = placement_from_annotations(plan, l40s_node(), None, ack({"a": {GPU: [UUIDS[0], UUIDS[2]]}}))
    assert request.gpu_shapes() == (GpuShape(gpu_count=2, gpu_milli=MILLI),)
    assert (request.name, request.namespace, request.cpu_milli, request.kind) == (
        plan.request.name, plan.request.namespace, plan.request.cpu_milli, plan.request.kind)
    assert back.gpu_indices == (0, 2)
    snap = ClusterSnapshot([l40s_node()])
    snap.assume(request, back)
    assert list(snap.free_milli[0][:4]) == [0, MILLI, 0, MILLI]


def test_ack_of_a_different_kind_replaces_the_shape():
    plan = plan_of([res("a", {GPU: 1})])
    request, back = placement_from_annotations(plan, l40s_node(), None, ack({"a": {MEM: units(UUIDS[1], 0, 1, 2)}}))
    assert request.gpu_shapes() == (GpuShape(gpu_count=1, gpu_memory_mib=3 * GIB),)
    assert back.gpu_indices == (1,) and back.gpu_memory_mib == 3 * GIB


def test_unknown_ids_are_ignored_and_nothing_known_is_none():
    plan = plan_of([res("a", {GPU: 2})])
    request, back = placement_from_annotations(plan, l40s_node(), None,
                                               ack({"a": {GPU: ["GPU-elsewhere", UUIDS[1]]}}))
    assert back.gpu_indices == (1,) and request.gpu_count == 1
    assert placement_from_annotations(plan, l40s_node(), None, ack({"a": {GPU: ["GPU-elsewhere"]}})) is None
    assert placement_from_annotations(plan, l40s_node(), None, ack({"a": {MEM: ["garbage", "GPU-x::1"]}})) is None
    assert placement_from_annotations(plan, l40s_node(), None, None) is None


def test_foreign_annotations_are_ignored():
    plan, placement, node = worked_example()
    a = build_assignment(plan, placement, node)
    other_uid = Assignment(node=a.node, pod_uid="someone-else", containers=a.containers)
    other_node = Assignment(node="gpu-node-2", pod_uid=a.pod_uid, containers=a.containers)
    assert placement_from_annotations(plan, node, other_uid, None) is None
    assert placement_from_annotations(plan, node, other_node, None) is None
    assert placement_from_annotations(plan, node, None, ack({"trainer": {GPU: UUIDS[:2]}}, uid="x")) is None
    assert placement_from_annotations(plan, node, None, ack({"trainer": {GPU: UUIDS[:2]}}, node="y")) is None


def test_cpu_pod_without_devices_holds_cpu_only():
    plan = plan_of([res("a", {})])
    request, back = placement_from_annotations(plan, l40s_node(), None, None)
    assert request is plan.request and back == Placement("gpu-node-1")


def test_complete_ack_beats_the_assignment_and_a_partial_one_does_not():
    plan, placement, node = worked_example()
    a = build_assignment(plan, placement, node)
    truth = {"fetch-weights": {MEM: units(UUIDS[2], 0, 1)}, "server": {MEM: units(UUIDS[2], *range(20))},
             "trainer": {GPU: [UUIDS[0], UUIDS[3]]}}  # the kubelet gave GPU 0 instead of GPU 1
    _, back = placement_from_annotations(plan, node, a, ack(truth))
    assert back.gpu_indices == (0, 3)
    _, back = placement_from_annotations(plan, node, a, ack(truth, complete=False))
    assert back.gpu_indices == (1, 3)
    _, back = placement_from_annotations(plan, node, a, ack(truth, error="refused"))
    assert back.gpu_indices == (1, 3)
    _, back = placement_from_annotations(plan, node, None, ack({"trainer": {GPU: [UUIDS[0]]}}, complete=False))
    assert back.gpu_indices == (0,)


def test_ack_units_of_init_and_app_containers_count_once():
    plan = plan_of([res("a", {MEM: 4})], [res("w", {MEM: 2})])
    _, back = placement_from_annotations(plan, l40s_node(), None, ack({
        "w": {MEM: units(UUIDS[0], 5, 6)}, "a": {MEM: units(UUIDS[0], 5, 6, 7, 8)}}))
    assert back.gpu_memory_mib == 4 * GIB


def test_ack_units_on_two_gpus_count_on_the_larger():
    plan = plan_of([res("a", {MEM: 4})])
    request, back = placement_from_annotations(plan, l40s_node(), None, ack({
        "a": {MEM: units(UUIDS[0], 1) + units(UUIDS[3], 1, 2, 3)}}))
    assert back.gpu_indices == (3,) and request.gpu_memory_mib == 3 * GIB


def test_assignment_units_follow_kubernetes_accounting():
    # sidecar 2 + app 4 run together; init w (5) runs beside the sidecar: max(6, 7) = 7
    obj = pod_obj([res("a", {MEM: 4})], [res("s", {MEM: 2}, "Always"), res("w", {MEM: 5})])
    plan = plan_pod(obj, FACTS, strict=False)
    share = MemoryShare(gpu=UUIDS[1], units=1, unit_mib=GIB)
    a = Assignment(node="gpu-node-1", pod_uid=plan.uid, containers=(
        ContainerAssignment(name="s", memory=share.model_copy(update={"units": 2})),
        ContainerAssignment(name="w", memory=share.model_copy(update={"units": 5})),
        ContainerAssignment(name="a", memory=share.model_copy(update={"units": 4})),
    ))
    request, back = placement_from_annotations(plan, l40s_node(), a, None)
    assert back.gpu_memory_mib == 7 * GIB and request.gpu_memory_mib == 7 * GIB


def test_assignment_unit_size_is_the_assignments():
    plan = plan_of([res("a", {MEM: 4})])
    a = Assignment(node="gpu-node-1", pod_uid=plan.uid, containers=(
        ContainerAssignment(name="a", memory=MemoryShare(gpu=UUIDS[2], units=4, unit_mib=512)),))
    request, back = placement_from_annotations(plan, l40s_node(), a, None)
    assert back.gpu_memory_mib == 2048 and request.gpu_memory_mib == 2048


def test_mig_ids_under_nvidia_gpu_count_as_mig():
    plan = plan_of([res("a", {GPU: 1})])  # migStrategy=single: nvidia.com/gpu devices are MIG devices
    request, back = placement_from_annotations(plan, mig_node(), None, ack({"a": {GPU: ["MIG-b"]}}, node="mig-node"))
    assert request.gpu_shapes() == (GpuShape(mig_profile="1g.10gb", mig_count=1),)
    assert back.mig_devices == ("MIG-b",)


def test_mig_enabled_gpu_uuid_is_never_held_whole():
    plan = plan_of([res("a", {GPU: 1})])
    assert placement_from_annotations(plan, mig_node(), None, ack({"a": {GPU: ["GPU-mig0"]}}, node="mig-node")) is None


def test_annotation_json_round_trip():
    """What the binder writes is what the state reads back after a restart."""
    plan, placement, node = worked_example()
    text = assignment_annotations(build_assignment(plan, placement, node))
    a = Assignment.model_validate(json.loads(text["gpupool.io/assignment"]))
    _, back = placement_from_annotations(plan, node, a, None)
    assert parts(back) == parts(placement)
