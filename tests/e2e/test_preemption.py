"""Priority preemption on the local control plane (issue 10, scenario 4a): low-priority whole-GPU pods
fill a pool of 4 x 8 GPUs; a train-critical pod asking 8 GPUs gets exactly the 8 victims of one node
evicted (Eviction API, checkpoint grace as the eviction's grace period), is nominated there and binds to
their GPUs; a pod of the same priority whose PriorityClass says `preemptionPolicy: Never` waits instead.
kwok plays the kubelet: it removes a pod as soon as its deletionTimestamp is set, so the grace period is
read from the watch event that sets it (metadata.deletionGracePeriodSeconds)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    device_use,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_bound,
    wait_until,
)
from urllib3.exceptions import ProtocolError

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods

GRACE = "gpupool.io/checkpoint-grace-seconds"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preemption-logs")


@pytest.fixture(scope="module")
def classes(kube: ClusterClient) -> Iterator[dict[str, str]]:
    api = client.SchedulingV1Api(kube.api_client)
    names = {"low": unique("low"), "critical": unique("train-critical"), "never": unique("train-critical-never")}
    specs = {"low": (100, None), "critical": (1000000, None), "never": (1000000, "Never")}
    for role, name in names.items():
        value, policy = specs[role]
        body: dict[str, Any] = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                "metadata": {"name": name}, "value": value}
        if policy:
            body["preemptionPolicy"] = policy
        api.create_priority_class(body)
    yield names
    for name in names.values():
        api.delete_priority_class(name)


@pytest.fixture(scope="module")
def pool(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    name = unique("preempt")
    nodes = add_pool_nodes(kube, name, "dgx-h100", 4)
    yield name, nodes
    kube.delete_nodes(nodes)


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, log_dir: Path, pool: object, classes: object) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), log_dir)
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


class PodWatch:
    """Every pod event of a namespace, from a background watch: what kwok removes at once is seen here."""

    def __init__(self, kube: ClusterClient, namespace: str) -> None:
        self.grace: dict[str, int | None] = {}  # pod -> deletionGracePeriodSeconds when its deletion began
        self.nominated: dict[str, str] = {}  # pod -> status.nominatedNodeName seen
        self.deleted: list[str] = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(kube, namespace), daemon=True)
        self._thread.start()
        time.sleep(1.0)  # the watch is open before the test acts

    def _run(self, kube: ClusterClient, namespace: str) -> None:
        with contextlib.suppress(ApiException, ProtocolError, OSError):  # the cluster may go first at teardown
            self._follow(kube, namespace)

    def _follow(self, kube: ClusterClient, namespace: str) -> None:
        for event in self._watch.stream(kube.core.list_namespaced_pod, namespace, timeout_seconds=600):
            obj = event["object"]
            name = obj.metadata.name
            if obj.metadata.deletion_timestamp is not None and name not in self.grace:
                self.grace[name] = obj.metadata.deletion_grace_period_seconds
            if obj.status and obj.status.nominated_node_name:
                self.nominated[name] = obj.status.nominated_node_name
            if event["type"] == "DELETED":
                self.deleted.append(name)

    def stop(self) -> None:
        self._watch.stop()


def test_train_critical_preempts_exactly_one_node_and_never_pod_waits(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
    classes: dict[str, str],
) -> None:
    name, nodes = pool
    seen = PodWatch(kube, namespace)
    try:
        low = [pod(f"low-{i}", scheduler.name, name, gpus=1, priority_class=classes["low"],
                   annotations={GRACE: "7"} if i % 2 == 0 else None) for i in range(32)]
        for manifest in low:
            manifest["spec"]["terminationGracePeriodSeconds"] = 5  # the pod's own, without the annotation
        create_pods(kube.core, namespace, low, concurrency=8)
        bound = wait_bound(kube, namespace, 32, timeout_s=120)
        assert {p["spec"]["nodeName"] for p in bound} == set(nodes)
        before = {p["metadata"]["name"]: p for p in bound}

        kube.core.create_namespaced_pod(namespace, pod("critical", scheduler.name, name, gpus=8,
                                                       priority_class=classes["critical"]))

        def critical_bound() -> dict[str, Any] | None:
            pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
            crit = pods.get("critical")
            return crit if crit and crit["spec"].get("nodeName") else None

        crit = wait_until(critical_bound, 90, "the train-critical pod bound")
        node = crit["spec"]["nodeName"]
        after = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        gone = sorted(set(before) - set(after))
        # exactly the 8 pods of one node, and that node is where the critical pod runs
        assert len(gone) == 8, f"evicted {gone}"
        assert {before[n]["spec"]["nodeName"] for n in gone} == {node}
        assert sorted(seen.grace) == gone
        assert seen.nominated.get("critical") == node
        # the eviction carried the checkpoint grace; pods without the annotation kept their own (5)
        for victim in gone:
            expected = 7 if (before[victim]["metadata"].get("annotations") or {}).get(GRACE) else 5
            assert seen.grace[victim] == expected, f"{victim}: grace {seen.grace[victim]}"
        # it holds exactly the GPUs its victims held
        victim_gpus, _ = device_use(kube, [before[n] for n in gone])
        crit_gpus, _ = device_use(kube, [crit])
        assert set(crit_gpus) == set(victim_gpus) and len(crit_gpus) == 8

        preempting = events_for(kube, namespace, "critical", "Preempting")
        assert preempting and all(v in preempting[0]["message"] for v in gone)
        for victim in gone:
            events = events_for(kube, namespace, victim, "Preempted")
            assert len(events) == 1 and events[0]["type"] == "Warning"
            assert f"Preempted by {namespace}/critical (priority 1000000) on node {node}" in events[0]["message"]
        assert scheduler.metric("gpupool_scheduler_preemption_victims_total") == 8
        assert scheduler.metric("gpupool_scheduler_preemption_attempts_total", result="planned") == 1

        # same priority, preemptionPolicy Never: waits, evicts nothing
        kube.core.create_namespaced_pod(namespace, pod("polite", scheduler.name, name, gpus=8,
                                                       priority_class=classes["never"]))
        wait_until(lambda: events_for(kube, namespace, "polite", "FailedScheduling"), 30,
                   "FailedScheduling on the Never pod")
        time.sleep(3.0)
        now = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        assert not now["polite"]["spec"].get("nodeName")
        assert now["polite"]["spec"].get("preemptionPolicy") == "Never"
        assert not (now["polite"].get("status") or {}).get("nominatedNodeName")
        assert len([n for n in now if n.startswith("low-")]) == 24
        assert sorted(seen.grace) == gone  # nobody else began deleting
        assert not events_for(kube, namespace, "polite", "Preempting")
        assert scheduler.metric("gpupool_scheduler_preemption_victims_total") == 8
        assert scheduler.metric("gpupool_scheduler_preemption_attempts_total", result="planned") == 1
    finally:
        seen.stop()
    by_node: dict[str, int] = defaultdict(int)
    for p in list_pods(kube, namespace):
        if p["spec"].get("nodeName"):
            by_node[p["spec"]["nodeName"]] += 1
    assert by_node[node] == 1  # only the critical pod on the emptied node
