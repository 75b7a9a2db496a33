"""`gpupool scheduler` on the local control plane: a mixed GPU workload on ~100 kwok nodes of every
fake profile, the seed cases, bad input, node changes, metrics."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import parse_assignment
from gpupool_common.inventory import parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from gpupool_devcluster.raw import discard, read_json
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    assert_no_oversubscription,
    device_use,
    events_for,
    list_pods,
    pod,
    pod_condition,
    start_scheduler,
    unique,
    wait_bound,
    wait_until,
)

NVLINK_PAIRS = {frozenset(p) for p in ((0, 2), (1, 3), (4, 6), (5, 7))}  # nvlink-pairs.yaml


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scheduler-logs")


@pytest.fixture(scope="module")
def priority_classes(kube: ClusterClient) -> Iterator[dict[str, int]]:
    from kubernetes import client

    api = client.SchedulingV1Api(kube.api_client)
    classes = {unique("e2e-high"): 100000, unique("e2e-low"): 10}
    for name, value in classes.items():
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": name}, "value": value})
    yield classes
    for name in classes:
        api.delete_priority_class(name)


@pytest.fixture(scope="module")
def big_pool(kube: ClusterClient) -> Iterator[tuple[str, dict[str, list[str]]]]:
    pool = unique("pool")
    nodes = {
        "dgx-h100": add_pool_nodes(kube, pool, "dgx-h100", 30),
        "l40s-pcie": add_pool_nodes(kube, pool, "l40s-pcie", 30),
        "nvlink-pairs": add_pool_nodes(kube, pool, "nvlink-pairs", 20),
        "a100-mig": add_pool_nodes(kube, pool, "a100-mig", 20),
    }
    yield pool, nodes
    kube.delete_nodes([n for names in nodes.values() for n in names])


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, log_dir: Path, big_pool: object) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), log_dir)
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def test_mixed_workload_every_pod_that_fits_binds(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, big_pool: tuple[str, dict[str, list[str]]],
    priority_classes: dict[str, int],
) -> None:
    pool, nodes = big_pool
    high, low = sorted(priority_classes, key=priority_classes.__getitem__, reverse=True)
    prio = itertools.cycle([high, low, None])
    manifests = []

    def add(kind: str, count: int, **kw: object) -> None:
        for i in range(count):
            manifests.append(pod(f"{kind}-{i}", scheduler.name, pool, priority_class=next(prio), **kw))  # type: ignore[arg-type]

    add("whole1", 300, gpus=1)
    add("pair", 40, gpus=2, annotations={"gpupool.io/gpu-model": "A100-80GB-PCIe"})  # the nvlink-pairs nodes
    add("whole2", 20, gpus=2)
    add("whole4", 10, gpus=4)
    add("units10", 400, units=10)
    add("units20", 100, units=20)
    add("mig1g", 100, mig={"1g.10gb": 1})
    add("mig3g", 30, mig={"3g.40gb": 1})
    create_pods(kube.core, namespace, manifests, concurrency=16)
    pods = wait_bound(kube, namespace, len(manifests), timeout_s=300)

    assert_no_oversubscription(kube, pods)
    inventories = {}
    for p in pods:
        node = p["spec"]["nodeName"]
        assert node.startswith(pool), f"{p['metadata']['name']} went to {node}, outside the test's pool"
        if p["metadata"]["name"].startswith("pair-"):
            assert node in nodes["nvlink-pairs"]
            if node not in inventories:
                raw = read_json(kube.core.read_node(node, _preload_content=False))
                inventories[node] = parse_inventory(raw["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
            index = {g.uuid: g.index for g in inventories[node].gpus}
            assignment = parse_assignment(p["metadata"]["annotations"])
            assert assignment is not None
            got = frozenset(index[u] for u in assignment.containers[0].devices["nvidia.com/gpu"])
            assert got in NVLINK_PAIRS, f"{p['metadata']['name']} on {node} got GPUs {sorted(got)}"
        if p["metadata"]["name"].startswith("mig"):
            assert node in nodes["a100-mig"]
    assert scheduler.metric("gpupool_scheduler_schedule_attempts_total", result="scheduled") >= len(manifests)
    # the per-node gauges are recomputed every 5 s: the last binds may be newer than the last pass
    wait_until(lambda: scheduler.metric("gpupool_scheduler_node_gpus_bound") >= 300 + 2 * 60 + 40, 15,
               "the whole GPUs bound counted in gpupool_scheduler_node_gpus_bound")
    assert 0 < scheduler.metric("gpupool_scheduler_cluster_gpu_allocated_percent") <= 100


def test_seed_case_small_tenants_do_not_block_a_big_share(
    kube: ClusterClient, namespace: str, log_dir: Path
) -> None:
    """Three 10 GB tenants and a 35 GB job on two free L40S GPUs (44 GiB units each): packing the
    tenants onto one GPU leaves the other whole for the big share; spreading them would not."""
    pool = unique("seed")
    (node,) = add_pool_nodes(kube, pool, "l40s-pcie", 1)
    proc = start_scheduler(kube, unique("seed"), log_dir)
    try:
        create_pods(kube.core, namespace, [pod("trainer", proc.name, pool, gpus=2)])
        wait_bound(kube, namespace, 1)
        create_pods(kube.core, namespace, [pod(f"tenant-{i}", proc.name, pool, units=10) for i in range(3)])
        wait_bound(kube, namespace, 4)
        create_pods(kube.core, namespace, [pod("big", proc.name, pool, units=35)])
        pods = wait_bound(kube, namespace, 5)
        assert_no_oversubscription(kube, pods)
        gpus, _ = device_use(kube, pods)
        tenants = {g for (n, g), use in gpus.items() if any(k.endswith(("tenant-0", "tenant-1", "tenant-2"))
                                                             for k in use.units)}
        assert len(tenants) == 1, f"tenants spread over {tenants}"
    finally:
        proc.stop()
        kube.delete_nodes([node])


def test_bad_requests_get_events_and_the_scheduler_carries_on(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, big_pool: tuple[str, dict[str, list[str]]]
) -> None:
    pool, _ = big_pool
    s = scheduler.name

    def two_resources() -> dict[str, object]:
        limits = {"nvidia.com/gpu": "1", "nvidia.com/gpu-memory": "10"}
        return {"name": "main", "image": "x", "resources": {"limits": limits, "requests": limits}}

    def init_bigger() -> list[dict[str, object]]:
        return [{"name": "warm", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]

    bad = {
        "zero": (pod("zero", s, pool, gpus=0, containers=[{
            "name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "0"}}}]), "nvidia.com/gpu"),
        "both": (pod("both", s, pool, containers=[two_resources()]), "nvidia.com/gpu-memory"),
        "mig": (pod("mig", s, pool, mig={"5g.60gb": 1}), "5g.60gb"),
        "units": (pod("units", s, pool, units=500), "500"),
        "model": (pod("model", s, pool, gpus=1, annotations={"gpupool.io/gpu-model": "V100"}), "V100"),
        "kind": (pod("kind", s, pool, gpus=1, annotations={"gpupool.io/workload": "gaming"}), "gaming"),
        "init": (pod("init", s, pool, gpus=1, init_containers=init_bigger()), "warm"),
        "toobig": (pod("toobig", s, pool, gpus=16), "Insufficient nvidia.com/gpu"),
    }
    create_pods(kube.core, namespace, [m for m, _ in bad.values()] + [pod("fine", s, pool, gpus=1)])
    wait_bound(kube, namespace, 1)

    def all_reported() -> bool:
        return all(events_for(kube, namespace, name, "FailedScheduling") for name in bad)

    wait_until(all_reported, 60, "FailedScheduling events for every bad pod")
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    for name, (_, words) in bad.items():
        message = events_for(kube, namespace, name, "FailedScheduling")[0]["message"]
        assert words in message, f"{name}: {message!r} does not mention {words!r}"
        assert not pods[name]["spec"].get("nodeName")
        cond = pod_condition(pods[name])
        assert cond is not None and cond["status"] == "False" and cond["reason"] == "Unschedulable", cond
    assert "0/" in events_for(kube, namespace, "toobig", "FailedScheduling")[0]["message"]
    # not retried in a hot loop: a few attempts at most while nothing changes
    assert scheduler.metric("gpupool_scheduler_schedule_attempts_total", result="invalid") < 40
    assert scheduler.process.poll() is None


def test_constraints_cordon_taints_and_new_nodes(
    kube: ClusterClient, namespace: str, log_dir: Path
) -> None:
    pool = unique("nodes")
    first, second = add_pool_nodes(kube, pool, "l40s-pcie", 2)
    discard(kube.core.patch_node(first, {"spec": {"unschedulable": True}}, _preload_content=False))
    discard(kube.core.patch_node(second, {"spec": {"taints": [
        {"key": "gpu", "value": "reserved", "effect": "NoSchedule"}]}}, _preload_content=False))
    proc = start_scheduler(kube, unique("nodes"), log_dir)  # its first LIST sees the cordon and the taint
    try:
        cpu_only = pod("cpu-only", proc.name, pool, cpu="500m")
        tolerant = pod("tolerant", proc.name, pool, gpus=1)
        tolerant["spec"]["tolerations"] = [{"key": "gpu", "operator": "Equal", "value": "reserved",
                                            "effect": "NoSchedule"}]
        big = pod("eight", proc.name, pool, gpus=8)
        create_pods(kube.core, namespace, [cpu_only, tolerant, big])
        wait_until(lambda: events_for(kube, namespace, "cpu-only", "FailedScheduling"), 30, "cpu-only unschedulable")
        message = events_for(kube, namespace, "cpu-only", "FailedScheduling")[0]["message"]
        assert "unschedulable" in message and "taint" in message, message
        bound = wait_bound(kube, namespace, 1)
        assert {p["metadata"]["name"]: p["spec"].get("nodeName") for p in bound}["tolerant"] == second
        # uncordon: the CPU pod goes to the first node without a restart
        discard(kube.core.patch_node(first, {"spec": {"unschedulable": False}}, _preload_content=False))
        pods = wait_bound(kube, namespace, 2)
        assert {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}["cpu-only"] == first
        # an 8-GPU pod waits for a node that has 8 GPUs, then binds to it
        wait_until(lambda: events_for(kube, namespace, "eight", "FailedScheduling"), 30, "eight unschedulable")
        nodes_before = proc.metric("gpupool_scheduler_nodes")
        (dgx,) = add_pool_nodes(kube, pool, "dgx-h100", 1)
        pods = wait_bound(kube, namespace, 3, timeout_s=60)
        assert {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}["eight"] == dgx
        # the 8-GPU node goes away: the next 8-GPU pod has nowhere to go, and the message says so
        kube.core.delete_namespaced_pod("eight", namespace, grace_period_seconds=0)
        kube.delete_nodes([dgx])
        wait_until(lambda: proc.metric("gpupool_scheduler_nodes") == nodes_before, 30, "the node removal seen")
        create_pods(kube.core, namespace, [pod("eight-again", proc.name, pool, gpus=8)])
        wait_until(lambda: events_for(kube, namespace, "eight-again", "FailedScheduling"), 30, "eight-again waits")
        message = events_for(kube, namespace, "eight-again", "FailedScheduling")[0]["message"]
        assert "Insufficient nvidia.com/gpu" in message and dgx not in message, message
    finally:
        proc.stop()
        kube.delete_nodes([first, second, *[n for n in kube.created_nodes if n.startswith(pool)]])


def test_deleted_gpu_pod_frees_its_gpus(kube: ClusterClient, namespace: str, log_dir: Path) -> None:
    pool = unique("free")
    (node,) = add_pool_nodes(kube, pool, "l40s-pcie", 1)
    proc = start_scheduler(kube, unique("free"), log_dir)
    try:
        create_pods(kube.core, namespace, [pod("all4", proc.name, pool, gpus=4)])
        wait_bound(kube, namespace, 1)
        create_pods(kube.core, namespace, [pod("next", proc.name, pool, gpus=2)])
        wait_until(lambda: events_for(kube, namespace, "next", "FailedScheduling"), 30, "next unschedulable")
        try:
            kube.core.delete_namespaced_pod("all4", namespace, grace_period_seconds=0)
        except ApiException as exc:
            assert exc.status == 404
        pods = wait_bound(kube, namespace, 1, timeout_s=30)
        assert [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")] == ["next"]
    finally:
        proc.stop()
        kube.delete_nodes([node])



def test_gpu_reported_unhealthy_is_avoided_without_restart(
    kube: ClusterClient, namespace: str, log_dir: Path
) -> None:
    """The device plugin lists failed GPUs in the node's inventory (`unhealthy`); the scheduler stops
    placing pods there at once and resumes when the GPU is healthy again."""
    pool = unique("health")
    (node,) = add_pool_nodes(kube, pool, "l40s-pcie", 1)
    proc = start_scheduler(kube, unique("health"), log_dir)

    def publish_unhealthy(uuids: list[str]) -> None:
        raw = read_json(kube.core.read_node(node, _preload_content=False))
        inventory = parse_inventory(raw["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
        text = inventory.model_copy(update={"unhealthy": tuple(uuids)}).to_annotation()
        discard(kube.core.patch_node(node, {"metadata": {"annotations": {"gpupool.io/gpu-inventory": text}}},
                                     _preload_content=False))

    try:
        raw = read_json(kube.core.read_node(node, _preload_content=False))
        uuids = [g.uuid for g in parse_inventory(raw["metadata"]["annotations"]["gpupool.io/gpu-inventory"]).gpus]
        wait_until(lambda: proc.metric("gpupool_scheduler_gpus", health="healthy") > 0, 30, "the GPU gauges")
        before = proc.metric("gpupool_scheduler_gpus", health="unhealthy")  # other tests' nodes may have some
        publish_unhealthy(uuids[:3])
        wait_until(lambda: proc.metric("gpupool_scheduler_gpus", health="unhealthy") == before + 3, 30,
                   "the scheduler to see 3 more unhealthy GPUs")
        create_pods(kube.core, namespace, [pod("first", proc.name, pool, gpus=1)])
        (first,) = wait_bound(kube, namespace, 1)
        assignment = parse_assignment(first["metadata"]["annotations"])
        assert assignment is not None and assignment.containers[0].devices["nvidia.com/gpu"] == (uuids[3],)
        create_pods(kube.core, namespace, [pod("second", proc.name, pool, gpus=1)])
        wait_until(lambda: events_for(kube, namespace, "second", "FailedScheduling"), 30, "second unschedulable")
        publish_unhealthy([])  # recovered
        pods = wait_bound(kube, namespace, 2, timeout_s=30)
        assert_no_oversubscription(kube, pods)
    finally:
        proc.stop()
        kube.delete_nodes([node])
