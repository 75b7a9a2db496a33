"""Pod identity end to end (issue 8, items 2 and 3): the kubelet stand-in admits pods with their identity,
one by one in the order their binds arrive or several at once oldest first, and serves the PodResources
API from what it admitted, as the kubelet does; the plugin process watches a real kube-apiserver.

Same-shape pods must never get each other's GPUs, acks must say what the kubelet allocated, an ack the API
server refuses is retried until written, and a plugin restarted after losing an ack rebuilds it from the
kubelet's records instead of treating the admitted pod as pending."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import ACK_ANNOTATION
from gpupool_deviceplugin.resources import split_memory_unit_id
from tests.support.handshake_node import Cluster, gpu_of
from tests.support.kubelet_standin import ContainerRequest, DeviceManager, KubeletStandin, Pod
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
SHAPES = {"whole": (GPU, 1), "memory": (MEM, 5)}


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    """<tmp>/device-plugins, so that the kubelet's PodResources socket is <tmp>/pod-resources/kubelet.sock
    (the kubelet's own layout under /var/lib/kubelet), where the plugin looks for it."""
    with tempfile.TemporaryDirectory(prefix="gpk-") as d:
        path = Path(d) / "device-plugins"
        path.mkdir()
        yield path


@pytest.fixture
def kubelet(kubelet_dir: Path) -> Iterator[KubeletStandin]:
    k = KubeletStandin(kubelet_dir, pod_resources=True)
    k.start()
    yield k
    k.stop()


@pytest.fixture
def cluster(kube, namespace: str) -> Cluster:
    (node,) = kube.add_nodes("l40s-pcie", 1, prefix="dp-id-")
    return Cluster(kube, namespace, node)


@pytest.fixture
def plugin(kube, cluster: Cluster, kubelet: KubeletStandin, start_plugin):
    p = start_plugin("l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig)
    kubelet.wait_registered({GPU, MEM})
    p.wait_healthz(200)
    p.wait_log(r"PodResources API at \S+ answers")
    return p


def standin_pod(cluster: Cluster, name: str, containers: list[ContainerRequest]) -> Pod:
    meta = cluster.core.read_namespaced_pod(name, cluster.ns).metadata
    return Pod(cluster.ns, name, meta.uid, meta.creation_timestamp.timestamp(), tuple(containers))


def gpus(ids: list[str]) -> set[str]:
    return {split_memory_unit_id(i)[0] if "::" in i else i for i in ids}


class AckBlocker:
    """A ValidatingAdmissionPolicy that makes the API server refuse acks on the namespace's pods (as an
    overloaded or partitioned API server would refuse the plugin's patches), until unblocked."""

    def __init__(self, kube, namespace: str) -> None:
        self.core: client.CoreV1Api = kube.core
        self.adm = client.AdmissionregistrationV1Api(kube.core.api_client)
        self.ns = namespace
        self.name = f"gpupool-block-acks-{namespace}"
        self.blocked = False
        self._probe = 0
        self.core.create_namespaced_pod(namespace, client.V1Pod(
            metadata=client.V1ObjectMeta(name="ack-probe"),
            spec=client.V1PodSpec(scheduler_name="nobody", containers=[client.V1Container(name="c", image="x")])))

    def _probe_refused(self) -> bool:
        self._probe += 1
        try:
            self.core.patch_namespaced_pod("ack-probe", self.ns, {"metadata": {"annotations": {
                ACK_ANNOTATION: str(self._probe)}}}, _content_type="application/merge-patch+json")
            return False
        except ApiException as exc:
            assert exc.status in (403, 422), exc
            return True

    def block(self) -> None:
        rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}
        def ack_of(obj: str) -> str:
            return (f"has({obj}.metadata.annotations) && '{ACK_ANNOTATION}' in {obj}.metadata.annotations ? "
                    f"{obj}.metadata.annotations['{ACK_ANNOTATION}'] : ''")

        self.adm.create_validating_admission_policy({"metadata": {"name": self.name}, "spec": {
            "failurePolicy": "Fail", "matchConstraints": {"resourceRules": [rule]},
            "variables": [{"name": "new", "expression": ack_of("object")},
                          {"name": "old", "expression": ack_of("oldObject")}],
            "validations": [{"expression": "variables.new == variables.old", "message": "acks refused by the test"}]}})
        self.adm.create_validating_admission_policy_binding({"metadata": {"name": self.name}, "spec": {
            "policyName": self.name, "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}}}}})
        self.blocked = True
        eventually(self._probe_refused, what="the API server refusing acks")

    def unblock(self) -> None:
        if not self.blocked:
            return
        self.adm.delete_validating_admission_policy_binding(self.name)
        self.adm.delete_validating_admission_policy(self.name)
        self.blocked = False
        eventually(lambda: not self._probe_refused(), what="the API server taking acks again")


@pytest.fixture
def acks_blocked(kube, namespace: str) -> Iterator[AckBlocker]:
    blocker = AckBlocker(kube, namespace)
    blocker.block()
    yield blocker
    blocker.unblock()


def _same_shape_pair(cluster: Cluster, kind: str) -> tuple[list[ContainerRequest], dict[str, Pod]]:
    """Pods "old" (created first, assigned GPU 0) and "new" (a second later, GPU 1), same request shape,
    bound in the other order; returns their containers and stand-in pods."""
    resource, size = SHAPES[kind]
    containers = [ContainerRequest("m", {resource: size})]
    u = cluster.uuids

    def plan(gpu: int) -> dict:
        return {"m": {"devices": {GPU: [u[gpu]]}}} if kind == "whole" else {"m": {"memory": (u[gpu], size, 1024)}}

    uid_old = cluster.create("old", containers)
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    uid_new = cluster.create("new", containers)
    cluster.bind("new", uid_new, plan(1))
    cluster.bind("old", uid_old, plan(0))
    return containers, {name: standin_pod(cluster, name, containers) for name in ("old", "new")}


def _wait_forms(dm: DeviceManager, cluster: Cluster, kind: str, gpu_indices: set[int]) -> None:
    """Wait until exactly these GPUs have changed form (the plugin has seen their pods' binds, or their end)."""
    want = {cluster.uuids[i] for i in gpu_indices}
    if kind == "whole":  # held whole: their memory units are taken out
        dm.watches[MEM].wait(lambda lst: {gpu_of([x]) for x in lst.unhealthy()} == want)
    else:  # shared: their whole-GPU devices are taken out
        dm.watches[GPU].wait(lambda lst: lst.unhealthy() == want)


@pytest.mark.parametrize("kind", ["whole", "memory"])
@pytest.mark.parametrize("order", ["one_by_one", "together"])
def test_same_shape_pods_bound_out_of_age_order_never_swap(cluster: Cluster, kubelet: KubeletStandin, plugin,
                                                           order: str, kind: str) -> None:
    resource, _ = SHAPES[kind]
    _, pods = _same_shape_pair(cluster, kind)
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        _wait_forms(dm, cluster, kind, {0, 1})
        if order == "one_by_one":  # two watch events: the kubelet admits in arrival order, pod new first
            got = {"new": dm.admit(pods["new"]), "old": dm.admit(pods["old"])}
        else:  # one update (kubelet start, re-list): oldest first
            batch = dm.add_pods([pods["new"], pods["old"]])
            got = {name: batch[pod.uid] for name, pod in pods.items()}
        for name, gpu in (("old", 0), ("new", 1)):
            held = got[name]["m"].devices[resource]
            assert gpus(held) == {cluster.uuids[gpu]}, f"pod {name} was given the other pod's GPU"
            ack = eventually(lambda n=name: (a := cluster.ack(n)) and a.complete and a, what=f"ack on {name}")
            assert ack.containers == {"m": {resource: tuple(held)}}, "the ack is not what the kubelet allocated"
        # pod old ends: the GPU it really held changes back, pod new's does not
        cluster.core.delete_namespaced_pod("old", cluster.ns, grace_period_seconds=0)
        dm.remove(pods["old"])
        _wait_forms(dm, cluster, kind, {1})
    finally:
        dm.close()
    assert plugin.metric("gpupool_deviceplugin_handshake_ambiguous_total", resource=resource, call="preferred") == 0
    assert plugin.metric("gpupool_deviceplugin_pod_resources_calls_total", purpose="preferred", result="ok") >= 1


def test_a_kubelet_giving_a_pod_another_pods_gpu_is_refused(cluster: Cluster, kubelet: KubeletStandin,
                                                            plugin) -> None:
    """The kubelet does not follow the preference (a Topology Manager policy, say) and gives pod new the GPU
    assigned to pod old: refused, instead of two pods running on each other's GPUs."""
    _, pods = _same_shape_pair(cluster, "whole")
    u = cluster.uuids
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        _wait_forms(dm, cluster, "whole", {0, 1})
        dm.pods[pods["new"].uid] = pods["new"]  # the kubelet is admitting pod new...
        with pytest.raises(grpc.RpcError) as err:
            dm.clients[GPU].allocate([u[0]])  # ...with pod old's GPU
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot swap GPUs" in err.value.details() and f"{cluster.ns}/old" in err.value.details()
        failed = eventually(lambda: (a := cluster.ack("new")) and a.error and a, what="error ack on new")
        assert "cannot swap GPUs" in failed.error and not failed.containers
        assert dm.admit(pods["old"])["m"].devices[GPU] == [u[0]]  # pod old still gets its own GPU
    finally:
        dm.close()
    assert plugin.metric("gpupool_deviceplugin_handshake_failures_total", resource=GPU, reason="swap") == 1


def test_an_ack_is_retried_until_the_api_server_takes_it(cluster: Cluster, kubelet: KubeletStandin, plugin,
                                                          acks_blocked: AckBlocker) -> None:
    u = cluster.uuids
    containers = [ContainerRequest("t", {GPU: 1})]
    cluster.bind("p", cluster.create("p", containers), {"t": {"devices": {GPU: [u[2]]}}})
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        _wait_forms(dm, cluster, "whole", {2})
        held = dm.admit(standin_pod(cluster, "p", containers))["t"].devices[GPU]
        plugin.wait_log(rf"ack on pod {cluster.ns}/p failed")
        time.sleep(4.0)  # longer than five attempts with backoff from 0.1 s
        assert cluster.ack("p") is None
        assert plugin.metric("gpupool_deviceplugin_acks_pending") == 1
        assert plugin.metric("gpupool_deviceplugin_ack_patches_total", result="error") >= 5
        acks_blocked.unblock()
        ack = eventually(lambda: cluster.ack("p"), timeout=30, what="the ack, once the API server takes it")
        assert ack.complete and ack.containers == {"t": {GPU: tuple(held)}}
        eventually(lambda: plugin.metric("gpupool_deviceplugin_acks_pending") == 0, what="no ack pending")
    finally:
        dm.close()


def test_an_ack_lost_in_a_plugin_restart_is_rebuilt_from_the_kubelets_records(
        kube, cluster: Cluster, kubelet: KubeletStandin, plugin, start_plugin, acks_blocked: AckBlocker) -> None:
    """The plugin dies after Allocate, before its ack is written. Restarted, it must not take the admitted
    pod for a pending one (it would capture the next same-shape pod's Allocate on that GPU)."""
    u = cluster.uuids
    containers = [ContainerRequest("m", {MEM: 5})]
    cluster.bind("first", cluster.create("first", containers), {"m": {"memory": (u[0], 5, 1024)}})
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        _wait_forms(dm, cluster, "memory", {0})
        first = dm.admit(standin_pod(cluster, "first", containers))["m"].devices[MEM]
        eventually(lambda: sum(plugin.metric("gpupool_deviceplugin_ack_patches_total", result=r)
                               for r in ("error", "gone")) >= 1, what="an ack attempt")
        plugin.kill()
        acks_blocked.unblock()
        assert cluster.ack("first") is None
        since = time.monotonic()
        restarted = start_plugin("l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig)
        kubelet.wait_registered({GPU, MEM}, since=since)
        dm.reconnect()
        ack = eventually(lambda: cluster.ack("first"), what="the ack rebuilt from PodResources")
        assert ack.complete and ack.containers == {"m": {MEM: tuple(first)}}
        assert restarted.metric("gpupool_deviceplugin_reconcile_corrections_total", kind="missing") == 1
        restarted.wait_log(r"pod \S+/first container m holds nvidia.com/gpu-memory .* \(missing\); corrected")

        # a later pod of the same shape on the same GPU is its own, not the first one's
        cluster.bind("second", cluster.create("second", containers), {"m": {"memory": (u[0], 5, 1024)}})
        second = dm.admit(standin_pod(cluster, "second", containers))["m"].devices[MEM]
        assert gpu_of(second) == u[0] and not set(second) & set(first)
        ack = eventually(lambda: (a := cluster.ack("second")) and a.complete and a, what="ack on second")
        assert ack.containers == {"m": {MEM: tuple(second)}}
        assert cluster.ack("first").containers == {"m": {MEM: tuple(first)}}
    finally:
        dm.close()


def test_records_the_kubelet_contradicts_are_corrected_periodically(kube, cluster: Cluster, kubelet: KubeletStandin,
                                                                   start_plugin, monkeypatch) -> None:
    """Two pods of another scheduler, same shape, admitted in one update (oldest first) while the plugin
    cannot see PodResources: it guesses by bind order, wrongly, and the acks say so. Once the socket is
    there, the periodic reconciliation corrects both records and acks, logs and counts it."""
    monkeypatch.setenv("GPUPOOL_RECONCILE_PERIOD_S", "0.5")
    kubelet.stop_pod_resources()
    plugin = start_plugin("l40s-pcie", node=cluster.node, kubeconfig=kube.kubeconfig)
    kubelet.wait_registered({GPU, MEM})
    plugin.wait_log(r"PodResources API not available")
    containers = [ContainerRequest("c", {GPU: 1})]
    uid_old = cluster.create("old", containers)
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    uid_new = cluster.create("new", containers)
    cluster.bind("new", uid_new, None)
    cluster.bind("old", uid_old, None)
    time.sleep(1.0)  # the plugin's watch has both binds (nothing on the node shows it for such pods)
    dm = DeviceManager(kubelet, [GPU, MEM])
    try:
        pods = {name: standin_pod(cluster, name, containers) for name in ("old", "new")}
        batch = dm.add_pods(list(pods.values()))
        held = {name: tuple(batch[pod.uid]["c"].devices[GPU]) for name, pod in pods.items()}
        guessed = {n: eventually(lambda n=n: cluster.ack(n), what=f"ack on {n}").containers["c"][GPU] for n in pods}
        assert guessed == {"old": held["new"], "new": held["old"]}  # bind order: pod new first, a wrong guess
        kubelet.serve_pod_resources()
        for name in pods:
            eventually(lambda n=name: cluster.ack(n).containers == {"c": {GPU: held[n]}},
                       what=f"ack on {name} corrected")
        assert plugin.metric("gpupool_deviceplugin_reconcile_corrections_total", kind="differs") == 2
        plugin.wait_log(rf"pod {cluster.ns}/old container c holds nvidia.com/gpu .* \(differs\); corrected")
    finally:
        dm.close()
