"""A dev cluster of the test's own with real nodes (kubelet + containerd + kube-proxy, realnode.py), and
what the tests check of it: pods Running on a node, their logs, nothing left after `down`."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster import nodenet, realnode
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.errors import DevClusterError
from tests.support.image import require_or_skip

WORKLOAD_IMAGE = "gpupool-workload:0.1.0"


def require_real_nodes() -> None:
    """Skip when real nodes cannot run here; fail instead where GPUPOOL_IMAGE_TESTS=required (CI)."""
    reason = realnode.can_run_real_nodes()
    if reason is None:
        try:
            realnode.default_images()
        except DevClusterError as exc:
            reason = str(exc)
    require_or_skip(reason)


@contextlib.contextmanager
def real_cluster(name: str, nodes: int = 1) -> Iterator[tuple[DevCluster, ClusterClient]]:
    require_real_nodes()
    cluster = DevCluster(name)
    try:
        cluster.up(real_nodes=nodes)
        handle = ClusterClient.connect(cluster)
    except BaseException:
        cluster.down()
        raise
    try:
        yield cluster, handle
    finally:
        handle.close()
        cluster.down()


def machine_leftovers(cluster: DevCluster, net: nodenet.ClusterNet | None, nodes: int) -> list[str]:
    """Everything of `cluster`'s real nodes still on the machine (empty after a clean `down`)."""
    found: list[str] = []
    for i in range(nodes):
        found += realnode.RealNode(cluster.name, i, cluster.layout).leftovers()
    if (nodenet.RUN_ROOT / cluster.name).exists():
        found.append(f"folder {nodenet.RUN_ROOT / cluster.name}")
    if net is not None:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        found += [f"link {name}" for name in (net.bridge, *(net.veth(i) for i in range(nodes))) if f" {name}:" in links
                  or f" {name}@" in links]
        rules = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=True).stdout
        found += [f"iptables {line}" for line in rules.splitlines() if f"dev-cluster {net.bridge}" in line]
    return found


def workload_pod(name: str, node: str, *, env: dict[str, str] | None = None,
                 resources: dict[str, Any] | None = None, scheduler: str | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "Never",
                                 "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 2,
                            "automountServiceAccountToken": False}
    spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def wait_running(core: client.CoreV1Api, namespace: str, name: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    pod = None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == "Running" and all(s.ready for s in pod.status.container_statuses or [None]):
            return pod
        time.sleep(0.5)
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    raise AssertionError(f"pod {namespace}/{name} not Running within {timeout_s}s: phase "
                         f"{pod.status.phase if pod else '?'}; events: {[(e.reason, e.message) for e in events]}")


def logged_env(core: client.CoreV1Api, namespace: str, name: str, timeout_s: float = 30) -> dict[str, str]:
    """The environment the workload printed (its log, through the API server and the kubelet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = core.read_namespaced_pod_log(name, namespace)
        except ApiException:
            text = ""
        if text.strip() or time.monotonic() > deadline:
            return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        time.sleep(0.5)
