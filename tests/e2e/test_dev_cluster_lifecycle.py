"""Lifecycle of dev clusters of their own (not the session's): start, reuse, restart after a crash, add
kube-controller-manager, stop by pid with nothing left."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster


def test_up_twice_reuses_and_down_leaves_no_process_or_data() -> None:
    cluster = DevCluster(f"e2e-life-{os.getpid()}")
    try:
        first = cluster.up()
        assert not first.reused and first.started == ("etcd", "kube-apiserver", "kwok")
        processes = cluster.processes()
        pids = {name: p.pid for name, p in processes.items()}
        assert set(pids) == {"etcd", "kube-apiserver", "kwok"}
        data_dir = Path(first.state.etcd_data_dir)
        assert data_dir.is_dir()
        assert cluster.kubeconfig.is_file() and oct(cluster.kubeconfig.stat().st_mode)[-3:] == "600"

        second = cluster.up()
        assert second.reused and second.started == ()
        assert second.state.server == first.state.server
        assert {name: p.pid for name, p in cluster.processes().items()} == pids
    finally:
        stopped = cluster.down()  # keeps logs/: checked below, then purged
    assert set(stopped) == {"etcd", "kube-apiserver", "kwok"}
    for name, process in processes.items():
        assert _same_process_exists(process.pid, process.start_ticks) is False, f"{name} still there"
    assert not data_dir.exists()
    assert cluster.processes() == {}
    assert cluster.running_state() is None
    assert cluster.down() == []  # stopping a stopped cluster is fine
    assert (cluster.layout.root / "logs" / "kube-apiserver.log").is_file()
    cluster.down(purge=True)
    assert not cluster.layout.root.exists()


def test_up_restarts_a_cluster_whose_apiserver_died() -> None:
    cluster = DevCluster(f"e2e-crash-{os.getpid()}")
    try:
        first = cluster.up()
        apiserver = cluster.processes()["kube-apiserver"]
        os.kill(apiserver.pid, signal.SIGKILL)  # a crash
        deadline = time.monotonic() + 10
        while apiserver.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.running_state() is None
        second = cluster.up()
        assert not second.reused
        assert Path(second.state.etcd_data_dir) != Path(first.state.etcd_data_dir)
        assert not Path(first.state.etcd_data_dir).exists()
        assert all(p.alive() for p in cluster.processes().values())
    finally:
        cluster.down(purge=True)
    assert cluster.processes() == {}



def _same_process_exists(pid: int, start_ticks: int) -> bool:
    """Whether /proc still shows this very process (same pid and start time), running or as a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return int(stat[stat.rindex(")") + 2:].split()[19]) == start_ticks


def test_controller_manager_joins_a_running_cluster_and_kwok_renews_node_leases() -> None:
    cluster = DevCluster(f"e2e-kcm-{os.getpid()}")
    try:
        cluster.up()
        result = cluster.up(optional=["kube-controller-manager"])
        assert result.reused and result.started == ("kube-controller-manager",)
        kube = ClusterClient.connect(cluster)
        try:
            node = kube.add_nodes("l40s-pcie", 1, prefix="kcm-")[0]
            # kwok was restarted to renew node Leases, the heartbeat the node lifecycle controller reads
            leases = client.CoordinationV1Api(kube.api_client)
            lease = _eventually(lambda: leases.read_namespaced_lease(node, "kube-node-lease"))
            assert lease.spec.lease_duration_seconds == 40 and lease.spec.renew_time is not None
            # the service-account controller runs: a new namespace gets its default ServiceAccount
            kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="kcm-check")))
            account = _eventually(lambda: kube.core.read_namespaced_service_account("default", "kcm-check"))
            assert account.metadata.name == "default"
            ready = [c for c in kube.core.read_node(node).status.conditions if c.type == "Ready"]
            assert ready[0].status == "True"
            _controllers_act_with_their_own_rights(kube, node, "kcm-check")
        finally:
            kube.close()
    finally:
        cluster.down(purge=True)
    assert cluster.processes() == {}


def _controllers_act_with_their_own_rights(kube: ClusterClient, node: str, namespace: str) -> None:
    """Each controller runs as its ServiceAccount in kube-system (--use-service-account-credentials) with
    its bootstrap role: the disruption controller writes PDB status, the ReplicaSet controller recreates an
    evicted pod, the garbage collector removes what a deleted Deployment owned."""
    apps = client.AppsV1Api(kube.api_client)
    policy = client.PolicyV1Api(kube.api_client)
    accounts = {a.metadata.name for a in kube.core.list_namespaced_service_account("kube-system").items}
    assert {"disruption-controller", "replicaset-controller", "generic-garbage-collector"} <= accounts
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                                       "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}})
    policy.create_namespaced_pod_disruption_budget(namespace, {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}})

    def ready_pods() -> list[client.V1Pod]:
        return [p for p in kube.core.list_namespaced_pod(namespace, label_selector="app=web").items
                if p.metadata.deletion_timestamp is None
                and any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or ()))]

    def status() -> tuple[int, int, int, int]:
        s = policy.read_namespaced_pod_disruption_budget("web", namespace).status
        return (s.expected_pods, s.current_healthy, s.desired_healthy, s.disruptions_allowed) if s else (0, 0, 0, 0)

    _until(lambda: len(ready_pods()) == 2 and status() == (2, 2, 1, 1), "2 ready pods and the PDB status")
    first = ready_pods()[0]
    kube.core.create_namespaced_pod_eviction(first.metadata.name, namespace, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=first.metadata.name, namespace=namespace)))
    _until(lambda: len(ready_pods()) == 2 and first.metadata.uid not in {p.metadata.uid for p in ready_pods()},
           "the ReplicaSet recreating the evicted pod")
    _until(lambda: status() == (2, 2, 1, 1), "the PDB status after the eviction")
    apps.delete_namespaced_deployment("web", namespace, propagation_policy="Background")
    _until(lambda: not apps.list_namespaced_replica_set(namespace).items
           and not kube.core.list_namespaced_pod(namespace).items, "garbage collection of the ReplicaSet and pods")


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)


T = TypeVar("T")


def _eventually(read: Callable[[], T], timeout_s: float = 30) -> T:
    """`read()` once it stops raising 404, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read()
        except ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)
