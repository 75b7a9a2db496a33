"""The idle-pods node annotation end to end: the plugin process (fake NVML, scripted through its events file)
watches a real kube-apiserver, attributes GPU activity to the pods bound to its node with an assignment, and
keeps `gpupool.io/idle-pods` on its Node equal to the pods that are idle."""

from __future__ import annotations

import json

import pytest

from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, parse_idle_pods
from tests.support.handshake_node import Cluster
from tests.support.kubelet_standin import ContainerRequest
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e
GPU = "nvidia.com/gpu"


def test_idle_pods_are_published_on_the_node_and_leave_it_when_busy(kube, namespace: str, start_plugin) -> None:
    (node,) = kube.add_nodes("l40s-pcie", 1, prefix="dp-idle-")
    cluster = Cluster(kube, namespace, node)
    plugin = start_plugin("l40s-pcie", node=node, kubeconfig=kube.kubeconfig,
                          config={"idle": {"publishIntervalSeconds": 0}},
                          extra_args=["--idle-sample-interval", "0.2", "--idle-window", "1",
                                      "--idle-start-grace", "0"])
    plugin.wait_log(r"idle sampling every 0.2s")
    u = cluster.uuids
    busy_uid = cluster.create("busy", [ContainerRequest("m", {GPU: 1})])
    idle_uid = cluster.create("idle", [ContainerRequest("m", {GPU: 1})])
    with plugin.events.open("a") as fh:  # GPU 0 works, GPU 1 does nothing
        fh.write(json.dumps({"uuid": u[0], "activity": {"utilization": 70, "memoryUsedMiB": 8000}}) + "\n")
    cluster.bind("busy", busy_uid, {"m": {"devices": {GPU: [u[0]]}}})
    cluster.bind("idle", idle_uid, {"m": {"devices": {GPU: [u[1]]}}})
    for name in ("busy", "idle"):  # what the node's kubelet reports once the container runs
        cluster.core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": "Running", "containerStatuses": [
            {"name": "m", "image": "busybox", "imageID": "", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}})

    def published() -> dict:
        return parse_idle_pods((cluster.core.read_node(node).metadata.annotations or {}).get(IDLE_PODS_ANNOTATION))

    eventually(lambda: set(published()) == {idle_uid}, timeout=20, what="the idle pod on the Node, alone")
    assert plugin.metric("gpupool_deviceplugin_pod_gpu_idle", namespace=namespace, pod="idle", uuid=u[1]) == 1
    assert plugin.metric("gpupool_deviceplugin_pod_gpu_activity_percent", namespace=namespace, pod="busy",
                         uuid=u[0]) == 70
    with plugin.events.open("a") as fh:  # the idle pod starts working
        fh.write(json.dumps({"uuid": u[1], "activity": {"utilization": 30}}) + "\n")
    eventually(lambda: published() == {} and IDLE_PODS_ANNOTATION in (cluster.core.read_node(node).metadata
                                                                     .annotations or {}),
               timeout=20, what="no idle pod on the Node once it works")
