"""The assignment handshake end to end: a real kube-apiserver (dev cluster), pods bound with their
assignment in the Binding, the plugin process watching them, the kubelet stand-in admitting them."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import grpc
import pytest

from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, parse_idle_pods
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_deviceplugin.publication import OWNED_LABELS
from tests.support.handshake_node import Cluster, gpu_of
from tests.support.kubelet_standin import ContainerRequest, DeviceManager, KubeletStandin, Pod
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"


@pytest.fixture
def cluster(kube, namespace: str) -> Cluster:
    (node,) = kube.add_nodes("l40s-pcie", 1, prefix="dp-e2e-")
    return Cluster(kube, namespace, node)


def running_plugin(kube, cluster: Cluster, kubelet: KubeletStandin, start_plugin, config: dict[str, Any] | None = None):
    """The plugin on the cluster's node, registered with the kubelet stand-in and healthy."""
    p = start_plugin("l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig, config=config)
    kubelet.wait_registered({GPU, MEM})
    p.wait_healthz(200)
    return p


@pytest.fixture
def plugin(kube, cluster: Cluster, kubelet: KubeletStandin, start_plugin):
    return running_plugin(kube, cluster, kubelet, start_plugin)


def test_shared_then_whole_follow_the_scheduler_and_flip_health(cluster: Cluster, kubelet: KubeletStandin,
                                                                plugin) -> None:
    u = cluster.uuids
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        shared = [ContainerRequest("m", {MEM: 10})]
        uid = cluster.create("shared", shared)
        cluster.bind("shared", uid, {"m": {"memory": (u[2], 10, 1024)}})
        # the pod watch sees the binding: GPU 2 has a tenant before the kubelet admits anything, so its
        # whole-GPU device is already Unhealthy (the kubelet cannot hand it out whole meanwhile)
        dm.watches[GPU].wait(lambda lst: lst.unhealthy() == {u[2]})
        got = dm.admit_pod(shared)["m"]
        assert gpu_of(got.devices[MEM]) == u[2]
        env = got.responses[MEM].envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == u[2] and env["GPUPOOL_MEMORY_LIMIT_MIB"] == "10240"
        assert dm.watches[GPU].latest().unhealthy() == {u[2]}
        ack = eventually(lambda: cluster.ack("shared"), what="ack on the shared pod")
        assert ack.complete and ack.containers["m"][MEM] == tuple(got.devices[MEM])

        # a two-GPU pod on GPUs 1 and 3: not the pair topology alone would pick (0,1 share a switch)
        whole = [ContainerRequest("t", {GPU: 2})]
        uid = cluster.create("whole", whole)
        cluster.bind("whole", uid, {"t": {"devices": {GPU: [u[1], u[3]]}}})
        got = dm.admit_pod(whole)["t"]
        assert sorted(got.devices[GPU]) == sorted([u[1], u[3]])
        assert got.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.devices[GPU])
        lst = dm.watches[MEM].wait(lambda lst: {gpu_of([x]) for x in lst.unhealthy()} == {u[1], u[3]})
        assert len(lst.unhealthy()) == 2 * (46068 // 1024)

        # the shared pod ends: GPU 2 is whole-allocatable again
        cluster.core.delete_namespaced_pod("shared", cluster.ns, grace_period_seconds=0)
        dm.watches[GPU].wait(lambda lst: not lst.unhealthy())
        assert plugin.metric("gpupool_deviceplugin_gpu_mode", uuid=u[1], mode="whole") == 1
    finally:
        dm.close()


def test_multi_container_pods_admitted_back_to_back(cluster: Cluster, kubelet: KubeletStandin, plugin) -> None:
    u = cluster.uuids
    pods = {
        "a": ([ContainerRequest("prep", {MEM: 2}, init=True), ContainerRequest("x", {MEM: 4}),
               ContainerRequest("y", {MEM: 4})],
              {"prep": {"memory": (u[0], 2, 1024)}, "x": {"memory": (u[0], 4, 1024)},
               "y": {"memory": (u[3], 4, 1024)}}),
        "b": ([ContainerRequest("x", {MEM: 6}), ContainerRequest("g", {GPU: 1})],
              {"x": {"memory": (u[3], 6, 1024)}, "g": {"devices": {GPU: [u[1]]}}}),
        "c": ([ContainerRequest("solo", {MEM: 3})], {"solo": {"memory": (u[2], 3, 1024)}}),
    }
    # all three are bound before the kubelet admits any, like a burst of binds to one node
    for name, (containers, plan) in pods.items():
        cluster.bind(name, cluster.create(name, containers), plan)
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        for name, (containers, plan) in pods.items():  # kubelet order: by creation time
            admitted = dm.admit_pod(containers)
            for cname, want in plan.items():
                if "memory" in want:
                    assert gpu_of(admitted[cname].devices[MEM]) == want["memory"][0], f"{name}/{cname}"
                    env = admitted[cname].responses[MEM].envs
                    assert env["GPUPOOL_MEMORY_LIMIT_MIB"] == str(want["memory"][1] * 1024)
                else:
                    assert admitted[cname].devices[GPU] == want["devices"][GPU]
            ack = eventually(lambda n=name: (a := cluster.ack(n)) and a.complete and a, what=f"ack on {name}")
            assert set(ack.containers) == set(plan)
    finally:
        dm.close()
    assert plugin.metric("gpupool_deviceplugin_handshake_ambiguous_total", resource=MEM, call="preferred") == 0


def test_same_shape_pods_follow_the_order_of_their_binds(cluster: Cluster, kubelet: KubeletStandin, plugin) -> None:
    """The scheduler's gate should prevent this. If it happens, without the kubelet's PodResources (this
    stand-in serves none here) the plugin follows the order in which the binds arrived, which is the order
    in which the kubelet admits pods bound a moment apart: not their age. (With PodResources the plugin
    knows the pod: test_pod_identity_e2e.py.)"""
    u = cluster.uuids
    containers = [ContainerRequest("m", {MEM: 5})]
    uid_old = cluster.create("old", containers)
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    uid_new = cluster.create("new", containers)
    cluster.bind("new", uid_new, {"m": {"memory": (u[1], 5, 1024)}})
    cluster.bind("old", uid_old, {"m": {"memory": (u[0], 5, 1024)}})
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        dm.watches[GPU].wait(lambda lst: lst.unhealthy() == {u[0], u[1]})  # the plugin has seen both binds
        pods = {}
        for name in ("new", "old"):  # the kubelet admits them as their binds arrive: pod new first
            meta = cluster.core.read_namespaced_pod(name, cluster.ns).metadata
            pods[name] = Pod(cluster.ns, name, meta.uid, meta.creation_timestamp.timestamp(), tuple(containers))
        new = dm.admit(pods["new"])["m"].devices[MEM]
        old = dm.admit(pods["old"])["m"].devices[MEM]
        assert gpu_of(new) == u[1] and gpu_of(old) == u[0]
        for name, held in (("new", new), ("old", old)):
            ack = eventually(lambda n=name: (a := cluster.ack(n)) and a.complete and a, what=f"ack on {name}")
            assert ack.containers == {"m": {MEM: tuple(held)}}
    finally:
        dm.close()
    assert plugin.metric("gpupool_deviceplugin_handshake_ambiguous_total", resource=MEM, call="preferred") == 1


def _pod_lists(kube) -> float:
    """LIST requests for pods across namespaces the API server has served (the plugin's re-lists)."""
    api = kube.core.api_client
    method, url, headers, _, _ = api.param_serialize(method="GET", resource_path="/metrics",
                                                     auth_settings=["BearerToken"])
    text = api.call_api(method, url, header_params=headers).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_request_total{") and 'resource="pods"' in line
               and 'scope="cluster"' in line and 'verb="LIST"' in line)


def test_pods_of_other_schedulers_do_not_relist_on_every_call(kube, cluster: Cluster, kubelet: KubeletStandin,
                                                              plugin) -> None:
    """A pod without an assignment is the plugin's to explain once its watch has shown it: its
    GetPreferredAllocation calls cost no synchronous re-list of the node's pods."""
    containers = [ContainerRequest("a", {GPU: 1}), ContainerRequest("b", {GPU: 1})]
    cluster.bind("foreign", cluster.create("foreign", containers), None)
    gpu = kubelet.plugin(GPU)
    time.sleep(0.5)  # the watch has delivered the bind
    gpu.preferred(cluster.uuids, 1)
    before = _pod_lists(kube)
    for _ in range(30):
        assert len(gpu.preferred(cluster.uuids, 1)) == 1
    # one list per call before; a little slack for other clients of a shared dev cluster listing pods
    assert _pod_lists(kube) - before <= 5
    assert plugin.metric("gpupool_deviceplugin_pod_relists_total", reason="sync") <= 1


def test_allocations_contradicting_the_node_are_refused(cluster: Cluster, kubelet: KubeletStandin, plugin) -> None:
    u = cluster.uuids
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        uid = cluster.create("whole", [ContainerRequest("t", {GPU: 1})])
        cluster.bind("whole", uid, {"t": {"devices": {GPU: [u[0]]}}})
        dm.admit_pod([ContainerRequest("t", {GPU: 1})])
        mem = kubelet.plugin(MEM)
        # units of a GPU held whole (the kubelet would not offer them; a buggy caller might)
        uid = cluster.create("late", [ContainerRequest("m", {MEM: 2})])
        cluster.bind("late", uid, {"m": {"memory": (u[0], 2, 1024)}})
        with pytest.raises(grpc.RpcError) as err:
            mem.allocate([f"{u[0]}::0", f"{u[0]}::1"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "held whole by" in err.value.details() and f"{cluster.ns}/whole" in err.value.details()
        failed = eventually(lambda: (a := cluster.ack("late")) and a.error and a, what="error ack")
        assert "held whole" in failed.error
        # units with no assignment at all
        with pytest.raises(grpc.RpcError) as err:
            mem.allocate([f"{u[3]}::0"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "only allocatable to pods scheduled by gpupool" in err.value.details()
    finally:
        dm.close()
    assert plugin.metric("gpupool_deviceplugin_handshake_failures_total", resource=MEM, reason="gpu_is_whole") == 1


def test_node_labels_and_inventory_are_patched_only_when_they_change(kube, cluster: Cluster, kubelet, tmp_path,
                                                                     kubelet_dir) -> None:
    from tests.support.plugin_process import PluginProcess

    core = cluster.core
    remove = {k: None for k in OWNED_LABELS}
    core.patch_node(cluster.node, {"metadata": {"labels": remove, "annotations": {INVENTORY_ANNOTATION: None}}},
                    _content_type="application/merge-patch+json")
    first = PluginProcess(tmp_path, kubelet_dir, "l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig).start()
    try:
        first.wait_log(r"published GPU labels/inventory on node")
        # The idle sampler's first measurement lands before or after the first patch (one patch or two).
        node = eventually(lambda: (n := core.read_node(cluster.node)) and IDLE_PODS_ANNOTATION in
                          (n.metadata.annotations or {}) and n, what="the idle pods measured and published")
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-L40S"
        assert node.metadata.labels["nvidia.com/gpu.count"] == "4"
        inv = json.loads(node.metadata.annotations[INVENTORY_ANNOTATION])
        assert inv["version"] == 1 and [g["uuid"] for g in inv["gpus"]] == cluster.uuids
        parse_idle_pods(node.metadata.annotations[IDLE_PODS_ANNOTATION])
        patches = re.findall(r"published GPU labels/inventory on node \S+ \((.*)\)", first.log())
        assert first.metric("gpupool_deviceplugin_node_patches_total", result="patched") == len(patches)
        written = [key for line in patches for key in line.split(", ")]
        assert len(written) == len(set(written)), f"a key was patched twice: {patches}"
        owned = set(OWNED_LABELS) | {INVENTORY_ANNOTATION, IDLE_PODS_ANNOTATION}
        on_node = {k for k in owned if k in node.metadata.labels or k in node.metadata.annotations}
        assert set(written) == on_node
    finally:
        first.stop()
    version = core.read_node(cluster.node).metadata.resource_version
    second = PluginProcess(tmp_path, kubelet_dir, "l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig)
    second.start()
    try:
        # unchanged at least once: the labels and inventory, and (once measured) the idle pods again
        eventually(lambda: second.metric("gpupool_deviceplugin_node_patches_total", result="unchanged") >= 1,
                   what="an unchanged publication")
        assert second.metric("gpupool_deviceplugin_node_patches_total", result="patched") == 0
        assert core.read_node(cluster.node).metadata.resource_version == version
    finally:
        second.stop()


def test_hardware_fault_is_published_in_the_inventory(cluster: Cluster, kubelet: KubeletStandin, plugin) -> None:
    """An Xid on a GPU reaches the Node's inventory annotation (`unhealthy`), where the scheduler reads it."""

    def unhealthy() -> tuple[str, ...]:
        node = cluster.core.read_node(cluster.node)
        return parse_inventory(node.metadata.annotations[INVENTORY_ANNOTATION]).unhealthy

    assert unhealthy() == ()
    plugin.inject(uuid=cluster.uuids[1], xid=79)
    eventually(lambda: unhealthy() == (cluster.uuids[1],), what="GPU 1 published as unhealthy")


def test_mps_mode_gives_a_share_its_limit_pipe_and_shm_and_a_whole_gpu_none(
    kube, cluster: Cluster, kubelet: KubeletStandin, start_plugin, tmp_path
) -> None:
    """`gpuMemory.mps: true`: a memory share gets the MPS client settings NVIDIA's MPS daemon needs (its
    budget as CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for its only visible device, the daemon's pipe directory,
    and the daemon's shared-memory tmpfs as /dev/shm); a whole GPU is the container's alone and gets none."""
    pipe, shm = str(tmp_path / "mps"), str(tmp_path / "mps" / "shm")
    running_plugin(kube, cluster, kubelet, start_plugin,
                   config={"gpuMemory": {"mps": True, "mpsPipeDirectory": pipe, "mpsShmDirectory": shm}})
    u = cluster.uuids
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        shared = [ContainerRequest("m", {MEM: 12})]
        uid = cluster.create("mps-shared", shared)
        cluster.bind("mps-shared", uid, {"m": {"memory": (u[0], 12, 1024)}})
        got = dm.admit_pod(shared)["m"]
        resp = got.responses[MEM]
        assert dict(resp.envs) == {
            "NVIDIA_VISIBLE_DEVICES": u[0], "GPUPOOL_MEMORY_LIMIT_MIB": "12288", "GPUPOOL_MEMORY_UNITS": "12",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12288M", "CUDA_MPS_PIPE_DIRECTORY": pipe,
        }
        assert [(m.container_path, m.host_path, m.read_only) for m in resp.mounts] == [
            (pipe, pipe, False), ("/dev/shm", shm, False)]

        whole = [ContainerRequest("t", {GPU: 1})]
        uid = cluster.create("mps-whole", whole)
        cluster.bind("mps-whole", uid, {"t": {"devices": {GPU: [u[3]]}}})
        got = dm.admit_pod(whole)["t"]
        assert dict(got.responses[GPU].envs) == {"NVIDIA_VISIBLE_DEVICES": u[3]}
        assert not got.responses[GPU].mounts
    finally:
        dm.close()
