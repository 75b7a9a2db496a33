"""The plugin driven by the kubelet's own device manager (hack/kubelet-harness: k8s.io/kubernetes
pkg/kubelet/cm/devicemanager of the cluster's release), with pods bound through the dev cluster's real
kube-apiserver: registration, capacity, admission with the handshake, the checkpoint file, a kubelet
restart, and the kubelet's PodResources API (its own server), which the plugin reconciles with.
kubelet_standin.py re-implements the same path in Python; docs/deviceplugin.md says what each covers.

The harness is built by `make cluster-bins`; without it these tests fail with that instruction."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from gpupool_common.handshake import AllocationAck, parse_ack, parse_assignment
from gpupool_common.inventory import INVENTORY_ANNOTATION, NodeInventory, parse_inventory
from gpupool_deviceplugin.api.podresources.v1 import api_pb2 as pr_pb2
from gpupool_deviceplugin.api.podresources.v1 import api_pb2_grpc as pr_grpc
from gpupool_deviceplugin.resources import split_memory_unit_id
from tests.support.kubelet_harness import (
    CHECKPOINT_FILE,
    Checkpoint,
    KubeletHarness,
    Refused,
    RunOptions,
    harness_binary,
)
from tests.support.objects import assignment
from tests.support.waiting import eventually

GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
UNIT_MIB = 1024
e2e = pytest.mark.e2e


class Node:
    """One fake node on the dev cluster: create pods, bind them (with or without an assignment), read them
    back as the kubelet receives them (the API server's JSON)."""

    def __init__(self, kube, namespace: str, name: str) -> None:
        self.core: client.CoreV1Api = kube.core
        self.api = kube.core.api_client
        self.ns = namespace
        self.name = name
        node = self.core.read_node(name)
        self.inventory: NodeInventory = parse_inventory(node.metadata.annotations[INVENTORY_ANNOTATION])
        self.uuids = [g.uuid for g in self.inventory.gpus]
        self.units_per_gpu = self.inventory.gpus[0].memory_mib // UNIT_MIB

    def pod(self, name: str, containers: dict[str, dict[str, int]], *, init: dict[str, dict[str, int]] | None = None,
            plan: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Create, bind (with `plan` as the assignment, or none: a pod of another scheduler) and return the
        bound pod's JSON."""
        def spec(cname: str, limits: dict[str, int]) -> client.V1Container:
            return client.V1Container(name=cname, image="busybox", resources=client.V1ResourceRequirements(
                limits={k: str(v) for k, v in limits.items()}))

        body = client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=client.V1PodSpec(
            scheduler_name="nobody", containers=[spec(c, r) for c, r in containers.items()],
            init_containers=[spec(c, r) for c, r in (init or {}).items()] or None))
        uid = self.core.create_namespaced_pod(self.ns, body).metadata.uid
        annotations = assignment(self.name, uid, plan) if plan is not None else None
        self.core.create_namespaced_binding(self.ns, client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, annotations=annotations),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=self.name)), _preload_content=False)
        return self.read(name)

    def read(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.api.sanitize_for_serialization(self.core.read_namespaced_pod(name, self.ns))
        return got

    def delete(self, pod: dict[str, Any]) -> None:
        self.core.delete_namespaced_pod(pod["metadata"]["name"], self.ns, grace_period_seconds=0)

    def ack(self, name: str) -> AllocationAck | None:
        return parse_ack(self.core.read_namespaced_pod(name, self.ns).metadata.annotations)

    def complete_ack(self, name: str) -> AllocationAck:
        ack: AllocationAck = eventually(lambda: (a := self.ack(name)) and a.complete and a, what=f"ack on {name}")
        return ack

    def units(self, gpu: int) -> set[str]:
        return {f"{self.uuids[gpu]}::{k}" for k in range(self.units_per_gpu)}

    def numa_of(self, uuid: str) -> str:
        gpu = self.inventory.gpu_by_uuid(uuid)
        assert gpu is not None
        return str(gpu.numa_node if gpu.numa_node is not None else -1)


def gpu_of(units: tuple[str, ...] | list[str]) -> str:
    gpus = {split_memory_unit_id(u)[0] for u in units}  # type: ignore[index]
    assert len(gpus) == 1, f"units on several GPUs: {sorted(gpus)}"
    return gpus.pop()


def admitted(result: dict[str, RunOptions] | Refused) -> dict[str, RunOptions]:
    assert not isinstance(result, Refused), f"the kubelet refused the pod: {result}"
    return result


@pytest.fixture
def harness(kubelet_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeletHarness]:
    """The real device manager on the plugin's kubelet directory, with the kubelet's PodResources API, which
    plugins started after it are pointed at."""
    with tempfile.TemporaryDirectory(prefix="gpr-") as pr:  # a short path: unix sockets are limited to 107 bytes
        socket = Path(pr) / "kubelet.sock"
        monkeypatch.setenv("GPUPOOL_POD_RESOURCES_SOCKET", str(socket))
        h = KubeletHarness(kubelet_dir, tmp_path / "kubelet-harness.log", pod_resources=socket).start()
        yield h
        h.close()


def pod_resources(harness: KubeletHarness) -> tuple[dict[str, dict[str, dict[str, set[str]]]], dict[str, set[str]]]:
    """The kubelet's PodResources answers: List as {pod: {container: {resource: ids}}} and
    GetAllocatableResources as {resource: ids}."""
    assert harness.pod_resources is not None
    with grpc.insecure_channel(f"unix://{harness.pod_resources}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        listed = stub.List(pr_pb2.ListPodResourcesRequest(), timeout=5)
        allocatable = stub.GetAllocatableResources(pr_pb2.AllocatableResourcesRequest(), timeout=5)
    pods: dict[str, dict[str, dict[str, set[str]]]] = {}
    for p in listed.pod_resources:
        containers = pods.setdefault(p.name, {})
        for c in p.containers:
            held = containers.setdefault(c.name, {})
            for d in c.devices:
                held.setdefault(d.resource_name, set()).update(d.device_ids)
    free: dict[str, set[str]] = {}
    for d in allocatable.devices:
        free.setdefault(d.resource_name, set()).update(d.device_ids)
    return pods, free


@pytest.fixture
def node(kube, namespace: str) -> Node:
    (name,) = kube.add_nodes("l40s-pcie", 1, prefix="dp-real-")
    return Node(kube, namespace, name)


@pytest.fixture
def plugin(kube, node: Node, harness: KubeletHarness, start_plugin):
    p = start_plugin("l40s-pcie", node=node.name, kubeconfig=kube.kubeconfig)
    try:
        harness.wait(capacity={GPU: 4, MEM: 4 * node.units_per_gpu}, registrations={GPU: 1, MEM: 1}, timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nplugin log:\n{p.log()[-4000:]}") from None
    p.wait_healthz(200)
    return p


def test_a_missing_harness_fails_with_the_build_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(AssertionError, match=r"kubelet-harness.*run `make cluster-bins`"):
        harness_binary()


@e2e
def test_registration_capacity_and_first_checkpoint(node: Node, harness: KubeletHarness, plugin,
                                                    kubelet_dir: Path) -> None:
    cap = harness.capacity()
    assert cap.capacity == cap.allocatable == {GPU: 4, MEM: 4 * node.units_per_gpu}
    assert cap.healthy[GPU] == set(node.uuids)
    assert cap.healthy[MEM] == set().union(*(node.units(i) for i in range(4)))
    assert cap.registrations == {GPU: 1, MEM: 1}
    # the kubelet's registration dials the plugin back on the endpoint it names, in the kubelet's directory
    assert {p.name for p in kubelet_dir.glob("*.sock")} == {"kubelet.sock", "gpupool-gpu.sock",
                                                             "gpupool-gpu-memory.sock"}

    def written() -> Checkpoint | None:  # the manager writes it from its device-update callback, a moment later
        if not (kubelet_dir / CHECKPOINT_FILE).is_file():
            return None
        cp = harness.checkpoint()
        return cp if cp.registered == cap.healthy else None

    cp = eventually(written, what="the first checkpoint with every registered device")
    assert cp.entries == ()


@e2e
def test_admission_through_the_real_manager_follows_the_assignment(node: Node, harness: KubeletHarness,
                                                                   plugin) -> None:
    u = node.uuids
    shared = node.pod("shared", {"m": {MEM: 10}}, plan={"m": {"memory": (u[2], 10, UNIT_MIB)}})
    # the plugin flips GPU 2's whole device to Unhealthy; the kubelet's allocatable follows, capacity does not
    cap = eventually(lambda: (c := harness.capacity()).allocatable[GPU] == 3 and c, what="GPU 2 out of allocatable")
    assert cap.capacity[GPU] == 4 and cap.healthy[GPU] == set(u) - {u[2]}
    got = admitted(harness.admit(shared))["m"]
    assert len(got.devices[MEM]) == 10 and gpu_of(got.devices[MEM]) == u[2]
    assert got.envs == {"NVIDIA_VISIBLE_DEVICES": u[2], "GPUPOOL_MEMORY_LIMIT_MIB": "10240",
                        "GPUPOOL_MEMORY_UNITS": "10"}
    # the manager asked GetPreferredAllocation (it read GetDevicePluginOptions), and the answer was the assignment
    assert plugin.metric("gpupool_deviceplugin_preferred_allocations_total", resource=MEM, source="assignment") == 1
    assert set(node.complete_ack("shared").containers["m"][MEM]) == set(got.devices[MEM])

    # two whole GPUs, 1 and 3: not the pair topology alone would pick (0 and 1 share a PCIe switch)
    whole = node.pod("whole", {"t": {GPU: 2}}, plan={"t": {"devices": {GPU: [u[1], u[3]]}}})
    got = admitted(harness.admit(whole))["t"]
    assert got.devices[GPU] == tuple(sorted([u[1], u[3]]))
    assert set(got.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == {u[1], u[3]}
    assert plugin.metric("gpupool_deviceplugin_preferred_allocations_total", resource=GPU, source="assignment") == 1
    assert set(node.complete_ack("whole").containers["t"][GPU]) == {u[1], u[3]}
    eventually(lambda: not harness.capacity().healthy[MEM] & (node.units(1) | node.units(3)),
               what="units of the whole GPUs out of allocatable")

    # an init container's units are reused by the next container (the kubelet's devicesToReuse)
    staged = node.pod("staged", {"x": {MEM: 4}}, init={"prep": {MEM: 2}},
                      plan={"prep": {"memory": (u[0], 2, UNIT_MIB)}, "x": {"memory": (u[0], 4, UNIT_MIB)}})
    got_staged = admitted(harness.admit(staged))
    prep, x = got_staged["prep"].devices[MEM], got_staged["x"].devices[MEM]
    assert gpu_of(prep) == gpu_of(x) == u[0] and len(prep) == 2 and len(x) == 4 and set(prep) <= set(x)
    assert got_staged["x"].envs["GPUPOOL_MEMORY_LIMIT_MIB"] == "4096"
    assert set(node.complete_ack("staged").containers) == {"prep", "x"}

    # the shared pod ends: the pod manager drops it, the plugin's watch sees it, GPU 2 is whole-allocatable
    # again (GPU 0 stays out: the staged pod shares it)
    node.delete(shared)
    harness.remove(shared["metadata"]["uid"])
    eventually(lambda: harness.capacity().healthy[GPU] == set(u) - {u[0]}, what="GPU 2 back in allocatable")


@e2e
def test_pods_of_other_schedulers_and_refusals(node: Node, harness: KubeletHarness, plugin) -> None:
    u = node.uuids
    # no assignment, whole GPUs: the plugin's topology preference (GPUs 0 and 1 share a PCIe switch)
    foreign = node.pod("foreign", {"c": {GPU: 2}})
    got = admitted(harness.admit(foreign))["c"]
    assert got.devices[GPU] == tuple(sorted(u[:2]))
    assert plugin.metric("gpupool_deviceplugin_preferred_allocations_total", resource=GPU, source="topology") == 1
    ack = eventually(lambda: node.ack("foreign"), what="ack on the foreign pod")
    assert set(ack.containers["c"][GPU]) == set(u[:2])

    # no assignment, memory units: Allocate is refused, so the kubelet fails the pod's admission
    refused = harness.admit(node.pod("foreign-share", {"c": {MEM: 2}}))
    assert isinstance(refused, Refused) and refused.container == "c"
    assert "only allocatable to pods scheduled by gpupool" in refused.error
    # ... and the manager takes back the units it had picked: a share of all of GPU 2's units fits next
    full = node.pod("full", {"m": {MEM: node.units_per_gpu}},
                    plan={"m": {"memory": (u[2], node.units_per_gpu, UNIT_MIB)}})
    got = admitted(harness.admit(full))["m"]
    assert set(got.devices[MEM]) == node.units(2)


@e2e
def test_checkpoint_and_kubelet_restart(node: Node, harness: KubeletHarness, plugin, kubelet_dir: Path) -> None:
    u = node.uuids
    shared = node.pod("shared", {"m": {MEM: 6}}, plan={"m": {"memory": (u[0], 6, UNIT_MIB)}})
    whole = node.pod("whole", {"t": {GPU: 1}}, plan={"t": {"devices": {GPU: [u[3]]}}})
    eventually(lambda: harness.capacity().allocatable[GPU] == 3, what="GPU 0 out of allocatable")
    first = {p["metadata"]["uid"]: admitted(harness.admit(p)) for p in (shared, whole)}
    uid_shared, uid_whole = shared["metadata"]["uid"], whole["metadata"]["uid"]

    cp = harness.checkpoint()
    assert set(cp.of(uid_shared)) == {("m", MEM)} and set(cp.of(uid_whole)) == {("t", GPU)}
    for uid, (cname, resource) in ((uid_shared, ("m", MEM)), (uid_whole, ("t", GPU))):
        entry, run = cp.of(uid)[(cname, resource)], first[uid][cname]
        assert entry.devices == run.devices[resource] and entry.envs == run.envs
        gpu = gpu_of(entry.devices) if resource == MEM else entry.devices[0]
        assert entry.devices_by_numa == {node.numa_of(gpu): entry.devices}
    # the checkpoint registers healthy devices only: GPU 0 (shared) is not there as a whole GPU
    assert cp.registered[GPU] == set(u) - {u[0]}
    assert cp.registered[MEM] == set().union(*(node.units(i) for i in (0, 1, 2)))

    allocations = plugin.metric("gpupool_deviceplugin_allocations_total", resource=MEM, via="assignment", result="ok")
    harness.restart(sources_ready=False)
    # until the plugin re-registers, the new manager knows the resources (checkpoint) with no devices
    restarted = harness.wait(capacity={GPU: 4, MEM: 4 * node.units_per_gpu}, registrations={GPU: 2, MEM: 2})
    assert restarted.healthy[GPU] == set(u) - {u[0]}
    assert {p.name for p in kubelet_dir.iterdir()} >= {"kubelet.sock", "gpupool-gpu.sock",
                                                       "gpupool-gpu-memory.sock", CHECKPOINT_FILE}
    # the restarted kubelet re-admits its running pods: same devices and options, no new Allocate
    for pod in (shared, whole):
        again = admitted(harness.admit(pod))
        assert again == first[pod["metadata"]["uid"]]
    assert plugin.metric("gpupool_deviceplugin_allocations_total", resource=MEM, via="assignment",
                         result="ok") == allocations
    harness.sources_ready()

    # the whole pod ends: the manager frees its GPU lazily, at the next allocation, for the next pod
    node.delete(whole)
    harness.remove(uid_whole)
    eventually(lambda: harness.capacity().healthy[MEM] >= node.units(3), what="GPU 3's units back")
    nxt = node.pod("next", {"t": {GPU: 1}}, plan={"t": {"devices": {GPU: [u[3]]}}})
    got_next = admitted(harness.admit(nxt))
    assert got_next["t"].devices[GPU] == (u[3],)
    # a second share of GPU 0 gets units the checkpointed share does not hold
    more = node.pod("more", {"m": {MEM: 4}}, plan={"m": {"memory": (u[0], 4, UNIT_MIB)}})
    got = admitted(harness.admit(more))["m"].devices[MEM]
    assert gpu_of(got) == u[0] and not set(got) & set(first[uid_shared]["m"].devices[MEM])

    cp = harness.checkpoint()
    running = {uid_shared: first[uid_shared], nxt["metadata"]["uid"]: got_next}
    assert {e.pod_uid for e in cp.entries} == {*running, more["metadata"]["uid"]}

    # a restart whose config sources are ready at once: re-admission takes the full check this time (the
    # plugin registered and every device a running container holds is Healthy), still without an Allocate
    allocations = plugin.metric("gpupool_deviceplugin_allocations_total", resource=GPU, via="assignment", result="ok")
    harness.restart(sources_ready=True)
    harness.wait(capacity={GPU: 4, MEM: 4 * node.units_per_gpu}, registrations={GPU: 3, MEM: 3})
    for uid, pod in ((uid_shared, shared), (nxt["metadata"]["uid"], nxt)):
        assert admitted(harness.admit(pod)) == running[uid]
    assert plugin.metric("gpupool_deviceplugin_allocations_total", resource=GPU, via="assignment",
                         result="ok") == allocations


@e2e
def test_mig_devices_and_cdi_through_the_real_manager(harness: KubeletHarness, start_plugin) -> None:
    """No API server: whole GPUs and MIG devices only. A container asking for two MIG profiles gets both
    devices as CDI devices (the kubelet unions them across resources)."""
    start_plugin("a100-mig", config={"cdi": {"enabled": True}})
    mig1, mig3 = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
    cap = harness.wait(capacity={GPU: 5, mig1: 9, "nvidia.com/mig-2g.20gb": 1, mig3: 3},
                       registrations={GPU: 1, mig1: 1, "nvidia.com/mig-2g.20gb": 1, mig3: 1})
    assert cap.allocatable == cap.capacity and MEM not in cap.capacity
    pod = {"metadata": {"name": "mig", "namespace": "ns", "uid": "mig-pod-1"},
           "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {mig1: "1", mig3: "1"}}}]}}
    got = admitted(harness.admit(pod))["c"]
    held = got.devices
    assert {r: len(ids) for r, ids in held.items()} == {mig1: 1, mig3: 1}
    assert set(got.cdi_devices) == {f"nvidia.com/gpu={ids[0]}" for ids in held.values()}
    entries = harness.checkpoint().of("mig-pod-1")
    assert {r: e.devices for (_, r), e in entries.items()} == held


@e2e
def test_pod_resources_of_the_real_kubelet(node: Node, harness: KubeletHarness, plugin) -> None:
    """The kubelet's own PodResources server over the real manager: what the plugin reconciles with."""
    u = node.uuids
    staged = node.pod("staged", {"x": {MEM: 4}}, init={"prep": {MEM: 2}},
                      plan={"prep": {"memory": (u[0], 2, UNIT_MIB)}, "x": {"memory": (u[0], 4, UNIT_MIB)}})
    whole = node.pod("whole", {"t": {GPU: 2}}, plan={"t": {"devices": {GPU: [u[2], u[3]]}}})
    eventually(lambda: not harness.capacity().healthy[MEM] & node.units(2), what="GPU 2's units out")
    got = {p["metadata"]["name"]: admitted(harness.admit(p)) for p in (staged, whole)}
    refused = harness.admit(node.pod("foreign-share", {"c": {MEM: 1}}))
    assert isinstance(refused, Refused)

    pods, allocatable = pod_resources(harness)
    # app containers only (a finished init container is not listed), with exactly what admission gave them;
    # a pod that failed admission is still known to the pod manager, holding nothing
    assert pods["staged"] == {"x": {MEM: set(got["staged"]["x"].devices[MEM])}}
    assert pods["whole"] == {"t": {GPU: {u[2], u[3]}}}
    assert pods["foreign-share"] == {"c": {}}
    cap = harness.capacity()
    assert allocatable == {r: set(ids) for r, ids in cap.healthy.items()}

    # the plugin asked the same API and found nothing to correct
    eventually(lambda: plugin.metric("gpupool_deviceplugin_pod_resources_calls_total", result="ok") > 0,
               what="the plugin's PodResources calls")
    assert plugin.metric("gpupool_deviceplugin_pod_resources_calls_total", result="unavailable") == 0
    for kind in ("missing", "differs", "held_by_other", "unknown_device"):
        assert plugin.metric("gpupool_deviceplugin_reconcile_corrections_total", kind=kind) == 0, kind

    # a kubelet restart restarts the API with it; the checkpointed pods are listed again
    harness.restart(sources_ready=True)
    harness.wait(capacity={GPU: 4, MEM: 4 * node.units_per_gpu}, registrations={GPU: 2, MEM: 2})
    assert pod_resources(harness)[0]["whole"] == {"t": {GPU: {u[2], u[3]}}}


# -- same-shape pods bound out of age order (issue 16, A11) ----------------------------------------------------
CHECK_BOUND_S = 5.0  # an ack the kubelet contradicts is corrected well within this (docs/handshake.md)


class PodResourcesLink:
    """The plugin's path to the kubelet's PodResources socket, a symlink the test can cut (the API does not
    answer the plugin: a kubelet restarting, its rate limit spent by other clients) and restore."""

    def __init__(self, target: Path, link: Path) -> None:
        self.target, self.link = target, link
        self.restore()

    def cut(self) -> None:
        self.link.unlink(missing_ok=True)

    def restore(self) -> None:
        if not self.link.is_symlink():
            self.link.symlink_to(self.target)


@pytest.fixture
def linked_harness(kubelet_dir: Path, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[KubeletHarness, PodResourcesLink]]:
    """The real device manager with its PodResources API, which plugins started after it reach through a
    link the test can cut. No periodic reconciliation within a test: corrections must come from the check
    after admission."""
    with tempfile.TemporaryDirectory(prefix="gpr-") as pr:
        socket = Path(pr) / "kubelet.sock"
        link = PodResourcesLink(socket, Path(pr) / "plugin.sock")
        monkeypatch.setenv("GPUPOOL_POD_RESOURCES_SOCKET", str(link.link))
        monkeypatch.setenv("GPUPOOL_RECONCILE_PERIOD_S", "3600")
        h = KubeletHarness(kubelet_dir, tmp_path / "kubelet-harness.log", pod_resources=socket).start()
        yield h, link
        h.close()


def held_by_scheduler(node: Node, names: list[str]) -> dict[str, dict[str, set[str]]]:
    """What gpupool's scheduler accounts for each pod (state.py follows a complete ack, else the
    assignment): {pod: {"whole": GPU UUIDs, "units": memory unit IDs, "shared": GPU UUIDs}}."""
    out: dict[str, dict[str, set[str]]] = {}
    for name in names:
        meta = node.core.read_namespaced_pod(name, node.ns).metadata
        ack = parse_ack(meta.annotations)
        held: dict[str, set[str]] = {"whole": set(), "units": set(), "shared": set()}
        if ack is not None and ack.complete and not ack.error:
            for by_resource in ack.containers.values():
                held["whole"] |= set(by_resource.get(GPU, ()))
                held["units"] |= set(by_resource.get(MEM, ()))
            held["shared"] = {gpu_of([u]) for u in held["units"]}
        else:
            plan = parse_assignment(meta.annotations)
            assert plan is not None, f"pod {name}: neither a complete ack nor an assignment"
            for ca in plan.containers:
                held["whole"] |= set(ca.devices.get(GPU, ()))
                if ca.memory is not None:
                    held["shared"].add(ca.memory.gpu)
        out[name] = held
    return out


def audit(node: Node, names: list[str]) -> None:
    """The double-allocation audit: no GPU held whole by two pods, no memory unit in two pods, no GPU both
    held whole and shared."""
    held = held_by_scheduler(node, names)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not held[a]["whole"] & held[b]["whole"], f"pods {a} and {b} both hold {held[a]['whole']}"
            assert not held[a]["units"] & held[b]["units"], f"pods {a} and {b} share memory units"
            assert not held[a]["whole"] & held[b]["shared"] and not held[b]["whole"] & held[a]["shared"], \
                f"pods {a} and {b}: one GPU held whole and shared"


@e2e
@pytest.mark.parametrize("answering", [True, False], ids=["pod_resources", "pod_resources_cut"])
@pytest.mark.parametrize("order", ["bind", "creation"])
@pytest.mark.parametrize("kind", ["memory", "whole"])
def test_same_shape_pods_bound_out_of_age_order_get_acks_the_kubelet_confirms(
        kube, node: Node, linked_harness: tuple[KubeletHarness, PodResourcesLink], start_plugin,
        kind: str, order: str, answering: bool) -> None:
    """Pods "old" (assigned GPU 0) and "new" (GPU 1), same request shape, created old -> new and bound
    new -> old, admitted by the real device manager in bind order (binds reaching the kubelet one by one) or
    in creation order (one update: HandlePodAdditions sorts by creation time). Where the plugin cannot ask
    the kubelet which pod it is admitting (PodResources cut during admission), it guesses by bind order:
    wrong in creation order, so the two pods swap GPUs and both first acks repeat the assignments. Once
    PodResources answers, every ack must say what the kubelet allocated, within CHECK_BOUND_S, and the
    scheduler-side audit must hold."""
    harness, link = linked_harness
    plugin = start_plugin("l40s-pcie", node=node.name, kubeconfig=kube.kubeconfig)
    harness.wait(capacity={GPU: 4, MEM: 4 * node.units_per_gpu}, registrations={GPU: 1, MEM: 1}, timeout=30)
    plugin.wait_log(r"PodResources API at \S+ answers")
    u = node.uuids
    resource, size = (MEM, 5) if kind == "memory" else (GPU, 1)

    def plan(gpu: int) -> dict[str, dict[str, Any]]:
        return {"m": {"memory": (u[gpu], size, UNIT_MIB)}} if kind == "memory" else {"m": {"devices": {GPU: [u[gpu]]}}}

    limits = client.V1ResourceRequirements(limits={resource: str(size)})
    body = {n: client.V1Pod(metadata=client.V1ObjectMeta(name=n), spec=client.V1PodSpec(
        scheduler_name="nobody", containers=[client.V1Container(name="m", image="busybox", resources=limits)]))
        for n in ("old", "new")}
    uid = {"old": node.core.create_namespaced_pod(node.ns, body["old"]).metadata.uid}
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    uid["new"] = node.core.create_namespaced_pod(node.ns, body["new"]).metadata.uid
    for name, gpu in (("new", 1), ("old", 0)):
        node.core.create_namespaced_binding(node.ns, client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, annotations=assignment(node.name, uid[name], plan(gpu))),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node.name)), _preload_content=False)
    # the plugin has seen both binds: GPUs 0 and 1 changed form in the kubelet's view
    if kind == "memory":
        eventually(lambda: harness.capacity().healthy[GPU] == {u[2], u[3]}, what="GPUs 0 and 1 shared")
    else:
        eventually(lambda: not harness.capacity().healthy[MEM] & (node.units(0) | node.units(1)),
                   what="GPUs 0 and 1 held whole")
    if not answering:
        link.cut()
    pods = {n: node.read(n) for n in ("old", "new")}
    sequence = ("new", "old") if order == "bind" else ("old", "new")
    got = {n: set(admitted(harness.admit(pods[n]))["m"].devices[resource]) for n in sequence}
    link.restore()
    if order == "creation" and not answering:  # the case the issue saw: a guess by bind order, a swap
        assert {n: gpu_of(list(g)) if kind == "memory" else next(iter(g)) for n, g in got.items()} == \
            {"old": u[1], "new": u[0]}, "the guess by bind order did not swap the pods"
    else:  # the kubelet followed the assignments
        assert {n: gpu_of(list(g)) if kind == "memory" else next(iter(g)) for n, g in got.items()} == \
            {"old": u[0], "new": u[1]}

    def acks_confirmed() -> bool:
        listed, _ = pod_resources(harness)
        for n in ("old", "new"):
            ack = node.ack(n)
            if ack is None or not ack.complete or ack.error:
                return False
            if {c: {r: set(ids) for r, ids in by_r.items()} for c, by_r in ack.containers.items()} != listed[n] or \
                    listed[n] != {"m": {resource: got[n]}}:
                return False
        return True

    start = time.monotonic()
    try:
        eventually(acks_confirmed, timeout=CHECK_BOUND_S, what="every ack equal to what PodResources lists")
    except AssertionError:
        listed, _ = pod_resources(harness)
        raise AssertionError(f"acks {[node.ack(n) for n in ('old', 'new')]} != PodResources {listed} "
                             f"within {CHECK_BOUND_S}s\nplugin log:\n{plugin.log()[-3000:]}") from None
    took = time.monotonic() - start
    audit(node, ["old", "new"])
    swapped = order == "creation" and not answering
    assert plugin.metric("gpupool_deviceplugin_reconcile_corrections_total", kind="differs") == (2 if swapped else 0)
    print(f"[{kind}, {order} order, PodResources {'answering' if answering else 'cut'}] acks equal to "
          f"PodResources {took:.2f}s after admission{'' if answering else ' and PodResources answering again'}")
