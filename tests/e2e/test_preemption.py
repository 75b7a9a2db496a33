"""Priority preemption on the local control plane (issue 10).

Scenario 4a: low-priority whole-GPU pods fill a pool of 4 x 8 GPUs; a train-critical pod asking 8 GPUs
gets exactly the 8 victims of one node evicted (Eviction API, checkpoint grace as the eviction's grace
period), is nominated there and binds to their GPUs; a pod of the same priority whose PriorityClass says
`preemptionPolicy: Never` waits instead.

Scenario 4d (with kube-controller-manager, whose disruption controller fills in PDB status and whose
Deployment/ReplicaSet controllers recreate pods): a PodDisruptionBudget protecting an inference Deployment
makes preemption pick other victims, or wait when only protected pods would do; once the budget is gone the
waiting pod preempts the inference pods and the Deployment recreates them.

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
from urllib3.exceptions import ProtocolError

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from tests.support.scheduler_harness import (
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

GRACE = "gpupool.io/checkpoint-grace-seconds"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preemption-logs")


@pytest.fixture(scope="module")
def classes(kube: ClusterClient) -> Iterator[dict[str, str]]:
    api = client.SchedulingV1Api(kube.api_client)
    names = {"low": unique("low"), "mid": unique("mid"), "critical": unique("train-critical"),
             "never": unique("train-critical-never")}
    specs = {"low": (100, None), "mid": (500, None), "critical": (1000000, None), "never": (1000000, "Never")}
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


# ---- scenario 4d: a PodDisruptionBudget protecting an inference Deployment --------------------------

def _pinned(manifest: dict[str, Any], node: str) -> dict[str, Any]:
    manifest["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
    return manifest


def _pods_of(pods: list[dict[str, Any]], app: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in pods
            if (p["metadata"].get("labels") or {}).get("app") == app and not p["metadata"].get("deletionTimestamp")}


def _named(kube: ClusterClient, namespace: str, name: str) -> dict[str, Any] | None:
    return next((p for p in list_pods(kube, namespace) if p["metadata"]["name"] == name), None)


def _running(p: dict[str, Any]) -> bool:
    return (p.get("status") or {}).get("phase") == "Running" and bool(p["spec"].get("nodeName"))


def test_pdb_makes_preemption_pick_other_victims_or_wait_and_the_deployment_recreates_evicted_pods(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, classes: dict[str, str],
    controller_manager: None,
) -> None:
    apps = client.AppsV1Api(kube.api_client)
    policy = client.PolicyV1Api(kube.api_client)
    pool = unique("pdb")
    node_a, node_b = add_pool_nodes(kube, pool, "dgx-h100", 2)
    victims_before = scheduler.metric("gpupool_scheduler_preemption_victims_total")
    blocked_before = scheduler.metric("gpupool_scheduler_preemption_attempts_total", result="pdb_blocked")
    seen = PodWatch(kube, namespace)
    try:
        # B: one training job of priority 500 on all 8 GPUs
        kube.core.create_namespaced_pod(namespace, _pinned(
            pod("train", scheduler.name, pool, gpus=8, priority_class=classes["mid"]), node_b))
        wait_until(lambda: _running(_named(kube, namespace, "train") or {"spec": {}}), 60, "train running on B")
        # A (the only room left): the inference Deployment, 2 replicas x 4 GPUs at priority 100, and a
        # budget that allows no disruption (minAvailable = replicas)
        template = pod("unused", scheduler.name, pool, gpus=4, priority_class=classes["low"],
                       labels={"app": "infer"})
        template["spec"]["restartPolicy"] = "Always"
        del template["metadata"]["name"]
        apps.create_namespaced_deployment(namespace, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "infer"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "infer"}},
                     "template": {"metadata": template["metadata"], "spec": template["spec"]}}})
        policy.create_namespaced_pod_disruption_budget(namespace, {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "infer"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "infer"}}}})

        def infer_running() -> dict[str, dict[str, Any]] | None:
            found = _pods_of(list_pods(kube, namespace), "infer")
            return found if len(found) == 2 and all(_running(p) for p in found.values()) else None

        infer = wait_until(infer_running, 60, "2 inference replicas running")
        assert {p["spec"]["nodeName"] for p in infer.values()} == {node_a}
        infer_uids = {p["metadata"]["uid"] for p in infer.values()}

        # kube-controller-manager's disruption controller fills in the budget's status
        def budget_status() -> dict[str, Any] | None:
            obj = policy.read_namespaced_pod_disruption_budget("infer", namespace)
            status = obj.status
            if status is None or status.observed_generation != obj.metadata.generation:
                return None
            values = {"currentHealthy": status.current_healthy, "desiredHealthy": status.desired_healthy,
                      "disruptionsAllowed": status.disruptions_allowed, "expectedPods": status.expected_pods}
            return values if values["currentHealthy"] == 2 else None

        assert wait_until(budget_status, 30, "PDB status from the disruption controller") == {
            "currentHealthy": 2, "desiredHealthy": 2, "disruptionsAllowed": 0, "expectedPods": 2}

        # 1. critical-1 needs a whole node. A's victims have the lowest priority (100 < 500), which would
        #    decide without the budget; with it, A would violate it, so B's training job is the victim
        kube.core.create_namespaced_pod(namespace, pod("critical-1", scheduler.name, pool, gpus=8,
                                                       priority_class=classes["critical"]))

        def bound(name: str) -> dict[str, Any] | None:
            found = _named(kube, namespace, name)
            return found if found and found["spec"].get("nodeName") else None

        assert wait_until(lambda: bound("critical-1"), 90, "critical-1 bound")["spec"]["nodeName"] == node_b
        assert seen.nominated.get("critical-1") == node_b
        assert sorted(seen.grace) == ["train"]
        assert {p["metadata"]["uid"] for p in _pods_of(list_pods(kube, namespace), "infer").values()} == infer_uids
        preempting = events_for(kube, namespace, "critical-1", "Preempting")
        assert len(preempting) == 1 and f"on node {node_b}: {namespace}/train" in preempting[0]["message"]
        preempted = events_for(kube, namespace, "train", "Preempted")
        assert len(preempted) == 1 and f"Preempted by {namespace}/critical-1" in preempted[0]["message"]
        assert all(not events_for(kube, namespace, name, "Preempted") for name in infer)

        # 2. critical-2 needs a whole node too: only the protected inference pods are of lower priority,
        #    so it waits, evicting nobody (the Eviction API would refuse them anyway)
        kube.core.create_namespaced_pod(namespace, pod("critical-2", scheduler.name, pool, gpus=8,
                                                       priority_class=classes["critical"]))
        waiting = wait_until(
            lambda: [e for e in events_for(kube, namespace, "critical-2", "FailedScheduling")
                     if "PodDisruptionBudget" in e["message"]], 30, "FailedScheduling naming the budget")
        assert f"preemption would need 2 pod(s) a PodDisruptionBudget protects on {node_a}" in waiting[0]["message"]
        time.sleep(3.0)
        now = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        assert not now["critical-2"]["spec"].get("nodeName")
        assert not (now["critical-2"].get("status") or {}).get("nominatedNodeName")
        assert {p["metadata"]["uid"] for p in _pods_of(list(now.values()), "infer").values()} == infer_uids
        assert sorted(seen.grace) == ["train"]
        assert not events_for(kube, namespace, "critical-2", "Preempting")
        assert not events_for(kube, namespace, "critical-2", "PreemptionFailed")
        assert scheduler.metric("gpupool_scheduler_preemption_attempts_total", result="pdb_blocked") > blocked_before
        assert scheduler.metric("gpupool_scheduler_preemption_victims_total") == victims_before + 1

        # 3. without the budget (deleting it wakes the waiting pod) the inference pods are the victims;
        #    their Deployment recreates them, and they run once there is room again
        policy.delete_namespaced_pod_disruption_budget("infer", namespace)
        assert wait_until(lambda: bound("critical-2"), 90, "critical-2 bound")["spec"]["nodeName"] == node_a
        assert sorted(seen.grace) == sorted(["train", *infer])
        for name in infer:
            events = events_for(kube, namespace, name, "Preempted")
            assert len(events) == 1 and f"Preempted by {namespace}/critical-2" in events[0]["message"]
        assert scheduler.metric("gpupool_scheduler_preemption_victims_total") == victims_before + 3

        def recreated() -> dict[str, dict[str, Any]] | None:
            found = _pods_of(list_pods(kube, namespace), "infer")
            fresh = {n: p for n, p in found.items() if p["metadata"]["uid"] not in infer_uids}
            return fresh if len(fresh) == 2 else None

        fresh = wait_until(recreated, 30, "the Deployment recreating 2 inference pods")
        owners = {(o["kind"], o["name"]) for p in fresh.values() for o in p["metadata"]["ownerReferences"]}
        assert len(owners) == 1 and next(iter(owners))[0] == "ReplicaSet"  # the same ReplicaSet as before
        assert all(not p["spec"].get("nodeName") for p in fresh.values())  # no room: A and B are critical
        node_c = add_pool_nodes(kube, pool, "dgx-h100", 1)[0]
        running = wait_until(infer_running, 60, "the recreated replicas running on the new node")
        assert set(running) == set(fresh) and {p["spec"]["nodeName"] for p in running.values()} == {node_c}
        placed = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in list_pods(kube, namespace)}
        assert placed == {"critical-1": node_b, "critical-2": node_a, **{n: node_c for n in fresh}}
    finally:
        seen.stop()
        # the garbage collector removes the ReplicaSet and its pods once the Deployment is gone
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("infer", namespace, propagation_policy="Background")
    wait_until(lambda: not apps.list_namespaced_replica_set(namespace).items
               and not _pods_of(list_pods(kube, namespace), "infer"), 30, "ReplicaSet and pods collected")


def test_victims_with_a_long_grace_keep_the_nomination_and_nobody_else_is_evicted(
    kube: ClusterClient, namespace: str, log_dir: Path, classes: dict[str, str],
) -> None:
    """Issue 16 A7. Two full 8-GPU nodes of 1-GPU pods that take 35 s to stop (kwok's
    `gpupool.io/stop-takes`) within their 45 s terminationGracePeriodSeconds; the scheduler holds a
    nomination for the victims' longest grace + `--nomination-slack 1`. An 8-GPU critical pod preempts
    one node and waits for it. When the hold followed the default 30 s grace instead of the pods' own,
    it expired at 31 s while the victims were still stopping, and the preemptor evicted the other
    node's 8 pods too (16 evicted for one pod)."""
    pool = unique("grace")
    nodes = add_pool_nodes(kube, pool, "dgx-h100", 2)
    proc = start_scheduler(kube, unique("gpupool"), log_dir, "--nomination-slack", "1")
    seen = PodWatch(kube, namespace)
    try:
        low = [pod(f"low-{i}", proc.name, pool, gpus=1, priority_class=classes["low"],
                   annotations={"gpupool.io/stop-takes": "35s"}) for i in range(16)]
        for manifest in low:
            manifest["spec"]["terminationGracePeriodSeconds"] = 45
        create_pods(kube.core, namespace, low, concurrency=8)
        placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in wait_bound(kube, namespace, 16)}
        assert set(placed.values()) == set(nodes)
        started = time.monotonic()
        kube.core.create_namespaced_pod(namespace, pod("critical", proc.name, pool, gpus=8,
                                                       priority_class=classes["critical"]))

        def critical_node() -> str | None:
            crit = next((p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "critical"), None)
            return crit["spec"].get("nodeName") if crit else None

        node = wait_until(critical_node, 90, "the critical pod bound after its victims stopped")
        waited = time.monotonic() - started
        victims = sorted(n for n, at in placed.items() if at == node)
        assert len(victims) == 8
        assert waited > 31, f"bound after {waited:.0f} s: the victims cannot have stopped yet"
        assert sorted(seen.grace) == victims, f"evicted: {sorted(seen.grace)}"  # nobody else
        assert all(seen.grace[v] == 45 for v in victims)  # their own grace (no checkpoint annotation)
        assert seen.nominated.get("critical") == node
        assert proc.metric("gpupool_scheduler_preemption_attempts_total", result="planned") == 1
        assert proc.metric("gpupool_scheduler_preemption_victims_total") == 8
    finally:
        seen.stop()
        proc.stop()
        kube.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        kube.delete_nodes(nodes)


def test_a_pod_naming_a_missing_priority_class_is_refused_with_a_clear_message(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
) -> None:
    """Scenario 4e, PriorityClass part: with the API server's Priority admission (on by default) such a
    pod never reaches a scheduler; the creator is told at once. Where admission is off, the scheduler
    reports it itself (tests/scheduler/test_podspec.py: "priority class ... does not exist")."""
    name, _ = pool
    missing = unique("no-such-class")
    with pytest.raises(ApiException) as refused:
        kube.core.create_namespaced_pod(namespace, pod("misconfigured", scheduler.name, name, gpus=1,
                                                       priority_class=missing))
    assert refused.value.status == 403
    assert f"no PriorityClass with name {missing} was found" in (refused.value.body or ""), refused.value.body
    assert not list_pods(kube, namespace)
    assert scheduler.process.poll() is None, "the scheduler carries on"
