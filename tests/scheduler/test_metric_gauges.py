"""What the gauges the alerts and the dashboard read are computed from: GPUs by state, oldest pending pod."""

from __future__ import annotations

import copy

from prometheus_client import generate_latest

from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import QueuedPod, SchedulingQueue
from gpupool_sched.metrics import GPU_STATES, SchedulerMetrics, gpu_states
from tests.support.objects import node_obj, pod_obj
from tests.support.scheduler_state import schedule


def with_unhealthy(obj: dict, *indices: int) -> dict:
    """The node as its plugin publishes it once GPUs `indices` have a hardware fault."""
    obj = copy.deepcopy(obj)
    inventory = parse_inventory(obj["metadata"]["annotations"][INVENTORY_ANNOTATION])
    bad = tuple(g.uuid for g in inventory.gpus if g.index in indices)
    changed = inventory.model_copy(update={"unhealthy": bad})
    obj["metadata"]["annotations"][INVENTORY_ANNOTATION] = changed.to_annotation()
    obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 100000)
    return obj


def test_gpu_states_count_each_gpu_once() -> None:
    state = ClusterState("gpupool")
    state.apply_node(node_obj("n1"))  # l40s-pcie: 4 GPUs
    state.apply_node(with_unhealthy(node_obj("n2"), 3))
    state.apply_node(node_obj("m1", "a100-mig"))
    mig = sum(g.mig_enabled for g in state.nodes["m1"].spec.gpus)
    assert mig, "the a100-mig profile has MIG-enabled GPUs"
    assert gpu_states(state) == {"free": 4 + 3 + 8 - mig, "unhealthy": 1, "mig": mig}

    schedule(state, pod_obj("train", gpus=2))
    schedule(state, pod_obj("infer", units=4))
    schedule(state, pod_obj("infer-2", units=4))  # best-fit packs it next to the first share
    counts = gpu_states(state)
    assert counts["whole"] == 2 and counts["shared"] == 1 and counts["unhealthy"] == 1
    assert sum(counts.values()) == 4 + 4 + 8


def test_cluster_gpus_gauge_exports_every_state() -> None:
    metrics = SchedulerMetrics()
    for state in GPU_STATES:
        metrics.cluster_gpus.labels(state=state).set(0)
    text = generate_latest(metrics.registry).decode()
    for state in GPU_STATES:
        assert f'gpupool_scheduler_cluster_gpus{{state="{state}"}} 0.0' in text


def test_oldest_created_by_priority_covers_waiting_and_in_flight_pods() -> None:
    queue = SchedulingQueue(clock=lambda: 0.0)
    queue.add(QueuedPod("a", "ns/a", priority=100, created=1000.0))
    queue.add(QueuedPod("b", "ns/b", priority=100, created=900.0))
    queue.add(QueuedPod("c", "ns/c", priority=0, created=950.0))
    queue.add(QueuedPod("d", "ns/d", priority=0, created=0.0))  # creation time unknown: left out
    assert queue.oldest_created_by_priority() == {100: 900.0, 0: 950.0}

    popped = queue.pop()  # b: highest priority, oldest; in flight, still pending
    assert popped is not None and popped.uid == "b"
    assert queue.oldest_created_by_priority() == {100: 900.0, 0: 950.0}
    queue.park(popped, ())
    assert queue.oldest_created_by_priority()[100] == 900.0
    queue.delete("b")
    queue.delete("c")
    assert queue.oldest_created_by_priority() == {100: 1000.0}


def test_per_node_gauges_follow_bound_pods_and_drop_removed_nodes() -> None:
    from kubernetes import client

    from gpupool_sched.kube.kubeapi import KubeApi
    from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService

    service = SchedulerService(SchedulerConfig(), KubeApi(client.ApiClient(client.Configuration())))
    service.on_node("ADDED", node_obj("n1"))
    service.on_node("ADDED", node_obj("n2"))
    bound = pod_obj("train", gpus=2, node="n1", phase="Running")
    service.on_pod("ADDED", bound)

    def series() -> dict[str, float]:
        text = generate_latest(service.metrics.registry).decode().splitlines()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text
                if line.startswith("gpupool_scheduler_node_gpus_bound{")}

    service.gauges.set(full=True)
    assert series() == {'gpupool_scheduler_node_gpus_bound{node="n1"}': 2.0,
                        'gpupool_scheduler_node_gpus_bound{node="n2"}': 0.0}
    service.on_pod("DELETED", bound)
    service.on_node("DELETED", node_obj("n2"))
    service.gauges.set(full=True)
    assert series() == {'gpupool_scheduler_node_gpus_bound{node="n1"}': 0.0}
