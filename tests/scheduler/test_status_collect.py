"""`gpupool status`'s figures from plain API objects: fake nodes as the device plugin publishes them, pods
with assignment and ack annotations, pending pods of every kind."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from kubernetes.utils import parse_quantity

from gpupool_common.handshake import (
    AllocationAck,
    Assignment,
    ContainerAssignment,
    MemoryShare,
    ack_annotations,
    assignment_annotations,
)
from gpupool_common.inventory import NodeInventory, parse_inventory
from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.placement.workload import default_prior
from gpupool_sched.status.collect import Listing, collect

NOW = 1_750_000_000.0
INVENTORY = "gpupool.io/gpu-inventory"


def fake_node(name: str, profile: str, unhealthy: tuple[str, ...] = ()) -> dict[str, Any]:
    obj = fake_node_manifest(name, profile, publication_for_profile(profile, name))
    obj["metadata"]["resourceVersion"] = "1"
    if unhealthy:
        raw = json.loads(obj["metadata"]["annotations"][INVENTORY])
        raw["unhealthy"] = list(unhealthy)
        obj["metadata"]["annotations"][INVENTORY] = json.dumps(raw)
    return obj


def inventory(obj: dict[str, Any]) -> NodeInventory:
    return parse_inventory(obj["metadata"]["annotations"][INVENTORY])


def pod(name: str, *, node: str | None = None, gpus: int = 0, units: int = 0, scheduler: str = "gpupool",
        priority: int | None = None, pclass: str | None = None, age_s: float = 60, phase: str | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    limits = {k: str(v) for k, v in (("nvidia.com/gpu", gpus), ("nvidia.com/gpu-memory", units)) if v}
    created = NOW - age_s
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1",
            "creationTimestamp": f"{datetime.fromtimestamp(created, tz=UTC):%Y-%m-%dT%H:%M:%SZ}",
            "annotations": annotations or {}}
    spec: dict[str, Any] = {"schedulerName": scheduler, "containers": [
        {"name": "main", "resources": {"requests": {"cpu": "1", "memory": "1Gi", **limits}, "limits": limits}}]}
    if node:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    if pclass:
        spec["priorityClassName"] = pclass
    return {"metadata": meta, "spec": spec, "status": {"phase": phase or ("Running" if node else "Pending")}}


def assigned(name: str, node: str, container: ContainerAssignment, **kw: Any) -> dict[str, Any]:
    return pod(name, node=node, annotations=assignment_annotations(
        Assignment(node=node, pod_uid=f"uid-{name}", containers=(container,))), **kw)


def test_gpus_pending_and_fragmentation() -> None:
    dgx = fake_node("dgx", "dgx-h100")
    g = inventory(dgx).gpus
    l40 = fake_node("l40", "l40s-pcie", unhealthy=(inventory(fake_node("l40", "l40s-pcie")).gpus[3].uuid,))
    broken = fake_node("broken", "dgx-h100")
    broken["metadata"]["annotations"][INVENTORY] = '{"version": 9}'
    pods = [
        assigned("train", "dgx", ContainerAssignment(name="main", devices={"nvidia.com/gpu": (g[0].uuid, g[1].uuid)}),
                 gpus=2),
        assigned("inf-a", "dgx", ContainerAssignment(name="main", memory=MemoryShare(gpu=g[2].uuid, units=10,
                                                                                      unit_mib=1024)), units=10),
        assigned("inf-b", "dgx", ContainerAssignment(name="main", memory=MemoryShare(gpu=g[2].uuid, units=25,
                                                                                      unit_mib=1024)), units=25),
        # another scheduler's pod: the device plugin's ack says which GPU it got
        pod("other", node="dgx", gpus=1, scheduler="default-scheduler", annotations=ack_annotations(AllocationAck(
            node="dgx", pod_uid="uid-other", containers={"main": {"nvidia.com/gpu": (g[5].uuid,)}}, complete=True))),
        pod("cpu", node="l40"),
        # pending: ours, or asking for a GPU whoever schedules it
        pod("wait-a", gpus=8, priority=1000, pclass="critical", age_s=300),
        pod("wait-b", gpus=8, priority=1000, pclass="critical", age_s=30),
        pod("wait-c", units=4, pclass="batch", age_s=7200),  # no spec.priority: the class's value
        pod("ext", gpus=1, scheduler="default-scheduler", age_s=5),
        # not pending GPU pods
        pod("plain", scheduler="default-scheduler"),
        pod("done", gpus=1, phase="Succeeded"),
        {**pod("leaving", gpus=1),
         "metadata": {**pod("leaving")["metadata"], "deletionTimestamp": "2025-01-01T00:00:00Z"}},
    ]
    classes = [{"metadata": {"name": "critical"}, "value": 1000}, {"metadata": {"name": "batch"}, "value": 10}]
    status = collect(Listing([dgx, l40, broken], pods, classes), server="https://x", now=NOW)

    nodes = {n.name: n for n in status.nodes}
    d = nodes["dgx"]
    assert [(x.use, x.pods, x.memory_units_used) for x in d.gpu_list[:6]] == [
        ("whole", ["ns/train"], 0), ("whole", ["ns/train"], 0), ("shared", ["ns/inf-a", "ns/inf-b"], 35),
        ("free", [], 0), ("free", [], 0), ("whole", ["ns/other"], 0)]
    assert (d.gpus, d.whole, d.shared, d.free, d.mig, d.unhealthy) == (8, 3, 1, 4, 0, 0)
    assert (d.memory_units_used, d.memory_units_total) == (35, sum(x.memory_mib // 1024 for x in g))
    e = nodes["l40"]
    assert (e.gpus, e.free, e.unhealthy) == (4, 3, 1)
    assert e.gpu_list[3].health == "unhealthy" and e.gpu_list[3].use == "free"
    b = nodes["broken"]
    assert b.gpus == 0 and b.inventory_problem and "version 9" in b.inventory_problem
    assert status.totals.pending_pods == 4
    assert [(p.priority, p.priority_class, p.pods, p.oldest_pod, p.oldest_age_seconds) for p in status.pending] == [
        (1000, "critical", 2, "ns/wait-a", 300.0), (10, "batch", 1, "ns/wait-c", 7200.0),
        (0, None, 1, "ns/ext", 5.0)]

    # the core's measure on a snapshot built here, with the scheduler's prior (< 50 pods seen)
    assert status.fragmentation.profile == "prior"
    assert status.fragmentation.pods_observed == 5 + 3  # accounted pods + our pending ones
    specs = []
    for obj in (dgx, l40):
        name = obj["metadata"]["name"]
        bad = set(inventory(obj).unhealthy)
        gpus = tuple(GpuSpec(x.index, x.product, 0 if x.uuid in bad else x.memory_mib // 1024 * 1024, x.uuid,
                             healthy=x.uuid not in bad) for x in inventory(obj).gpus)
        alloc = obj["status"]["allocatable"]
        specs.append(NodeSpec(name, int(alloc["cpu"]) * 1000, memory_mib=_mib(alloc["memory"]), gpus=gpus))
    snap = ClusterSnapshot([*specs, NodeSpec("broken", 224_000, _mib(broken["status"]["allocatable"]["memory"]))])
    mem = specs[0].gpus[2].memory_mib
    snap.assume(PodRequest("train", 1000, 1024, gpu_count=2, gpu_milli=1000), Placement("dgx", (0, 1), 1000))
    snap.assume(PodRequest("inf-a", 1000, 1024, gpu_count=1, gpu_memory_mib=10240),
                Placement("dgx", (2,), 10240 * 1000 // mem, 10240))
    snap.assume(PodRequest("inf-b", 1000, 1024, gpu_count=1, gpu_memory_mib=25600),
                Placement("dgx", (2,), 25600 * 1000 // mem, 25600))
    snap.assume(PodRequest("other", 1000, 1024, gpu_count=1, gpu_milli=1000), Placement("dgx", (5,), 1000))
    snap.assume(PodRequest("cpu", 1000, 1024), Placement("l40"))
    expected = cluster_fragmentation_milli(snap, default_prior())
    assert expected > 0
    assert status.fragmentation.gpus * 1000 == expected
    assert status.fragmentation.percent == 100 * expected / snap.total_gpu_milli
    assert status.fragmentation.allocated_percent == 100 * snap.used_gpu_milli() / snap.total_gpu_milli


def test_profile_learnt_from_enough_pods() -> None:
    node = fake_node("dgx", "dgx-h100")
    g = inventory(node).gpus
    pods = [assigned(f"p{i}", "dgx", ContainerAssignment(name="main", memory=MemoryShare(
        gpu=g[i % 8].uuid, units=1, unit_mib=1024)), units=1) for i in range(60)]
    status = collect(Listing([node], pods, []), now=NOW)
    assert status.fragmentation.profile == "observed" and status.fragmentation.pods_observed == 60
    assert status.totals.memory_units_used == 60 and status.totals.shared == 8


def _mib(quantity: str) -> int:
    return int(parse_quantity(quantity) // 2**20)
