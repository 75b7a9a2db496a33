"""The whole path on nodes that run the real device plugin: `gpupool scheduler` → Binding with the
assignment → the plugin's pod watch → kubelet admission (GetPreferredAllocation + Allocate per
container) → the plugin's ack → the scheduler's gate.

The nodes here are NOT kwok nodes (kwok would mark their pods Running at once, which opens the
scheduler's gate before any Allocate). Each runs `gpupool-deviceplugin --fake-nvml l40s-pcie` behind
the kubelet stand-in (tests.support.kubelet_standin), and `NodeKubelet` (tests.support.node_kubelet)
plays the rest of the kubelet: it admits the pods bound to its node in the order their binds arrive and
marks them Running once the plugin's ack is on them. Every moment is recorded as the resourceVersion of
the watch event that showed it: one etcd revision counter orders binds, acks and events exactly, with no
clocks. The nodes are made by tests.support.plugin_pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import discard, read_json
from tests.support.node_kubelet import (
    GPU,
    MEM,
    PodLife,
    assert_kubelet_got_the_assignment,
    handshake_of,
    resource_version,
)
from tests.support.plugin_pool import Pool, plugin_pool
from tests.support.plugin_process import plugin_counter
from tests.support.scheduler_harness import (
    assert_no_oversubscription,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    stop_scheduler,
    unique,
    wait_until,
)

HOSTNAME = "kubernetes.io/hostname"


# ---- fixtures: nodes with a plugin and a kubelet each ------------------------------------------
@pytest.fixture(scope="module")
def pool(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Plugins without the kubelet's PodResources: the scheduler's gate keeps same-shape pods apart."""
    with plugin_pool(kube, tmp_path_factory.mktemp("full"), "full", pod_resources=False) as made:
        yield made


@pytest.fixture(scope="module")
def identity_pool(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Plugins that read the kubelet's PodResources: they publish pod_identity, no gate is held."""
    with plugin_pool(kube, tmp_path_factory.mktemp("ident"), "ident", pod_resources=True) as made:
        yield made


@pytest.fixture
def idle_pool(pool: Pool) -> Pool:
    for kubelet in pool.kubelets():
        kubelet.hold_running = False
        wait_until(kubelet.idle, 30, f"{kubelet.node}: the pods of earlier tests gone, every device Healthy",
                   interval=0.05)
    return pool


@pytest.fixture(scope="module")
def priority_classes(kube: ClusterClient) -> Iterator[tuple[str, str]]:
    api = client.SchedulingV1Api(kube.api_client)
    high, low = unique("full-high"), unique("full-low")
    for cls, value in ((high, 1000), (low, 10)):
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": cls}, "value": value})
    yield high, low
    for cls in (high, low):
        api.delete_priority_class(cls)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fullpath-logs")


# ---- checks ---------------------------------------------------------------------------------------
def one_gpu_on(node: str, pod_name: str, scheduler: str, pool: Pool, priority_class: str) -> dict[str, Any]:
    """A one-GPU pod of `scheduler` pinned to `node` (same-shape pods on one node)."""
    m = pod(pod_name, scheduler, pool.name, gpus=1, priority_class=priority_class)
    m["spec"]["nodeSelector"][HOSTNAME] = node
    return m


def assert_gate_held(pods: list[dict[str, Any]], pool: Pool) -> None:
    """docs/handshake.md rule 4 as the kubelets saw it: on a node, a pod sharing a shape with an earlier
    bound pod is bound only after that pod's ack."""
    by_node: dict[str, list[tuple[PodLife, set[tuple[str, int]]]]] = {}
    for p in pods:
        assignment, _ = handshake_of(p)
        by_node.setdefault(p["spec"]["nodeName"], []).append((pool.life(f"{p['metadata']['namespace']}/"
                                                                         f"{p['metadata']['name']}"),
                                                               assignment.shapes()))
    for node, lives in by_node.items():
        lives.sort(key=lambda item: item[0].bind_rv)
        for i, (later, shapes) in enumerate(lives):
            for earlier, other in lives[:i]:
                if shapes & other:
                    assert earlier.ack_rv is not None and earlier.ack_rv < later.bind_rv, (
                        f"{node}: {later.key} (shapes {sorted(shapes)}) bound at rv {later.bind_rv}, before "
                        f"{earlier.key}'s ack (rv {earlier.ack_rv}, bound at {earlier.bind_rv})")


def preferred_sources(pool: Pool) -> dict[str, float]:
    """GetPreferredAllocation answers of every plugin of the pool, by source (assignment / topology)."""
    name = "gpupool_deviceplugin_preferred_allocations_total"
    return {src: sum(plugin_counter(n.plugin, name, source=src) for n in pool.nodes.values())
            for src in ("assignment", "topology")}


# ---- the tests ------------------------------------------------------------------------------------
def test_pods_get_exactly_their_assigned_devices_through_the_plugin(
    kube: ClusterClient, namespace: str, idle_pool: Pool, log_dir: Path
) -> None:
    pool = idle_pool
    preferred_before = preferred_sources(pool)
    proc = start_scheduler(kube, unique("full"), log_dir)
    try:
        manifests = [pod("whole-1", proc.name, pool.name, gpus=1), pod("whole-2", proc.name, pool.name, gpus=2)]
        manifests += [pod(f"units10-{i}", proc.name, pool.name, units=10) for i in range(4)]
        manifests += [pod("units20", proc.name, pool.name, units=20)]
        for m in manifests:
            discard(kube.core.create_namespaced_pod(namespace, m, _preload_content=False))
        keys = {f"{namespace}/{m['metadata']['name']}" for m in manifests}
        pool.wait_acked(keys)

        pods = list_pods(kube, namespace)
        assert {f"{namespace}/{p['metadata']['name']}" for p in pods} == keys
        for p in pods:
            assert p["spec"]["nodeName"] in pool.nodes, f"{p['metadata']['name']} on {p['spec']['nodeName']}"
            assert_kubelet_got_the_assignment(p, pool.life(f"{namespace}/{p['metadata']['name']}"))
        assert_no_oversubscription(kube, pods)
        assert_gate_held(pods, pool)

        # the kubelets mark them Running; the scheduler accounts what the acks say
        wait_until(lambda: all(p["status"].get("phase") == "Running" for p in list_pods(kube, namespace)),
                   30, "every pod Running", interval=0.1)
        whole = {n: 0 for n in pool.nodes}
        units = {n: 0 for n in pool.nodes}
        for p in pods:
            _, ack = handshake_of(p)
            for devices in ack.containers.values():
                whole[ack.node] += len(devices.get(GPU, ()))
                units[ack.node] += len(devices.get(MEM, ()))
        assert sum(whole.values()) == 3 and sum(units.values()) == 60

        def ledger_agrees() -> bool:
            return all(proc.metric("gpupool_scheduler_node_gpus_bound", node=n) == whole[n]
                       and proc.metric("gpupool_scheduler_node_gpu_memory_units_bound", node=n) == units[n]
                       for n in pool.nodes)

        wait_until(ledger_agrees, 15, "the scheduler's per-node GPUs and units to match the acks", interval=0.2)
        assert proc.metric("gpupool_scheduler_gate_timeouts") == 0
        assert proc.metric("gpupool_scheduler_bind_failures_total") == 0
        # every GetPreferredAllocation was answered from an assignment, none by topology (the kubelet skips
        # the call when exactly as many devices are free as the container asks for, so some may be missing)
        preferred = preferred_sources(pool)
        assert 1 <= preferred["assignment"] - preferred_before["assignment"] <= len(manifests), preferred
        assert preferred["topology"] == preferred_before["topology"], preferred
        for n in pool.nodes.values():
            assert plugin_counter(n.plugin, "gpupool_deviceplugin_handshake_ambiguous_total") == 0, n.name
            assert plugin_counter(n.plugin, "gpupool_deviceplugin_handshake_failures_total") == 0, n.name
    finally:
        stop_scheduler(proc)


def test_same_shape_pods_created_a_b_are_bound_b_then_a_behind_the_gate(
    kube: ClusterClient, namespace: str, idle_pool: Pool, log_dir: Path, priority_classes: tuple[str, str]
) -> None:
    """A is created first, B second with a higher priority; both exist before the scheduler starts, so
    its first LIST queues both and it pops B first (priority before age). B's bind takes the node's
    gate for (nvidia.com/gpu, 1) before A is even decided, so A waits at the gate until the plugin acks
    B. B is held Pending meanwhile, so only the ack can open the gate (the timeout is far away)."""
    pool = idle_pool
    high, low = priority_classes
    node = sorted(pool.nodes)[0]
    kubelet = pool.nodes[node].kubelet
    kubelet.hold_running = True
    name = unique("gate")

    created_a = read_json(kube.core.create_namespaced_pod(
        namespace, one_gpu_on(node, "a", name, pool, low), _preload_content=False))
    created_b = read_json(kube.core.create_namespaced_pod(
        namespace, one_gpu_on(node, "b", name, pool, high), _preload_content=False))
    assert resource_version(created_a) < resource_version(created_b)
    a, b = f"{namespace}/a", f"{namespace}/b"
    proc = start_scheduler(kube, name, log_dir, "--gate-timeout", "60")
    try:
        pool.wait_acked({a, b})
        life_a, life_b = pool.life(a), pool.life(b)
        assert kubelet.order[-2:] == [b, a], f"the kubelet admitted {kubelet.order}"
        b_acked, a_acked = life_b.ack_rv or 0, life_a.ack_rv or 0
        assert life_b.bind_rv < b_acked < life_a.bind_rv < a_acked, (
            f"b bound at rv {life_b.bind_rv}, acked {b_acked}; a bound {life_a.bind_rv}, acked {a_acked}")
        assert not life_b.running, "b was marked Running: the phase, not the ack, may have opened the gate"
        assert proc.metric("gpupool_scheduler_gate_waits_total") == 1
        assert proc.metric("gpupool_scheduler_gate_timeouts") == 0

        def scheduled(pod_name: str) -> dict[str, Any] | None:
            found = events_for(kube, namespace, pod_name, "Scheduled")
            return found[0] if found else None

        event_a = wait_until(lambda: scheduled("a"), 15, "a's Scheduled event", interval=0.1)
        event_b = wait_until(lambda: scheduled("b"), 15, "b's Scheduled event", interval=0.1)
        assert node in event_a["message"] and node in event_b["message"]
        assert resource_version(event_b) < resource_version(event_a), (
            "Scheduled events in the creation order, not B then A")
        assert resource_version(event_a) > b_acked, "a's Scheduled event before b's ack"

        pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        gpus = {}
        for pod_name, life in (("a", life_a), ("b", life_b)):
            p = pods[pod_name]
            assert p["spec"]["nodeName"] == node
            assert_kubelet_got_the_assignment(p, life)
            assignment, ack = handshake_of(p)
            (gpu,) = assignment.containers[0].devices[GPU]
            assert ack.containers["main"][GPU] == (gpu,), f"{pod_name}: assigned {gpu}, acked {ack.containers}"
            gpus[pod_name] = gpu
        assert gpus["a"] != gpus["b"]
        assert_no_oversubscription(kube, list(pods.values()))
        assert plugin_counter(pool.nodes[node].plugin, "gpupool_deviceplugin_handshake_ambiguous_total") == 0

        kubelet.release_running()
        wait_until(lambda: all(p["status"].get("phase") == "Running" for p in list_pods(kube, namespace)),
                   15, "a and b Running", interval=0.1)
    finally:
        kubelet.hold_running = False
        stop_scheduler(proc)


def test_same_shape_pods_are_pending_together_where_the_plugin_knows_pod_identity(
    kube: ClusterClient, namespace: str, identity_pool: Pool, log_dir: Path, priority_classes: tuple[str, str]
) -> None:
    """On nodes whose plugin reads the kubelet's PodResources (inventory `pod_identity`), the scheduler
    holds no gate: two pods of the same shape are both bound while the kubelet has admitted neither
    (behind a gate the second bind would wait for the first ack, which cannot come), and each still gets
    exactly its assigned GPU when the kubelet admits them, because the plugin asks the kubelet which pod
    each call is for."""
    pool = identity_pool
    for node in pool.nodes:
        def identity(node: str = node) -> bool:
            obj = read_json(kube.core.read_node(node, _preload_content=False))
            return parse_inventory(obj["metadata"]["annotations"][INVENTORY_ANNOTATION]).pod_identity
        wait_until(identity, 30, f"{node}: the plugin publishes pod_identity", interval=0.1)
    for kubelet in pool.kubelets():
        wait_until(kubelet.idle, 30, f"{kubelet.node}: idle", interval=0.05)
    high, low = priority_classes
    node = sorted(pool.nodes)[0]
    kubelet = pool.nodes[node].kubelet
    kubelet.hold_admission = True
    name = unique("ident")

    discard(kube.core.create_namespaced_pod(namespace, one_gpu_on(node, "a", name, pool, low), _preload_content=False))
    discard(kube.core.create_namespaced_pod(namespace, one_gpu_on(node, "b", name, pool, high), _preload_content=False))
    a, b = f"{namespace}/a", f"{namespace}/b"
    proc = start_scheduler(kube, name, log_dir, "--gate-timeout", "60")
    try:
        def both_bound() -> bool:
            return {p.key for p in kubelet.lives()} >= {a, b}
        wait_until(both_bound, 30, "a and b both bound while neither is admitted", interval=0.05)
        assert not any(p.admitted or p.ack_rv for p in kubelet.lives() if p.key in (a, b))
        bound_order = [key for key in kubelet.held_keys() if key in (a, b)]
        # Admit against the bind order: a plugin guessing by arrival would hand each pod the other's GPU.
        kubelet.release_admission(reverse=True)
        pool.wait_acked({a, b})
        assert kubelet.order[-2:] == bound_order[::-1], f"bound {bound_order}, admitted {kubelet.order}"
        assert proc.metric("gpupool_scheduler_gate_waits_total") == 0
        pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        gpus = {}
        for pod_name, key in (("a", a), ("b", b)):
            p = pods[pod_name]
            assert p["spec"]["nodeName"] == node
            assert_kubelet_got_the_assignment(p, pool.life(key))
            assignment, ack = handshake_of(p)
            (gpu,) = assignment.containers[0].devices[GPU]
            assert ack.containers["main"][GPU] == (gpu,), f"{pod_name}: assigned {gpu}, acked {ack.containers}"
            gpus[pod_name] = gpu
        assert gpus["a"] != gpus["b"]
        assert_no_oversubscription(kube, list(pods.values()))
        plugin = pool.nodes[node].plugin
        assert plugin_counter(plugin, "gpupool_deviceplugin_handshake_ambiguous_total") == 0
        assert plugin_counter(plugin, "gpupool_deviceplugin_handshake_failures_total") == 0
    finally:
        kubelet.release_admission()
        stop_scheduler(proc)
