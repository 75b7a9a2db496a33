"""The whole path on nodes that run the real device plugin: `gpupool scheduler` → Binding with the
assignment → the plugin's pod watch → kubelet admission (GetPreferredAllocation + Allocate per
container) → the plugin's ack → the scheduler's gate.

The nodes here are NOT kwok nodes (kwok would mark their pods Running at once, which opens the
scheduler's gate before any Allocate). Each runs `gpupool-deviceplugin --fake-nvml l40s-pcie` behind
the kubelet stand-in of tests/deviceplugin, and `NodeKubelet` below plays the rest of the kubelet: it
watches the pods bound to its node (field selector spec.nodeName, as the kubelet does), admits each
in the order its bind arrives through the stand-in's DeviceManager, and marks it Running once the
plugin's ack is on it (standing in for container start-up, so that the ack, not the phase, is what
opens the gate). Every moment is recorded as the resourceVersion of the watch event that showed it:
one etcd revision counter (the dev cluster has a single etcd) orders binds, acks and events exactly,
with no clocks.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from deviceplugin.kubelet_standin import Admitted, ContainerRequest, DeviceManager, KubeletStandin, Pod
from deviceplugin.plugin_process import PluginProcess
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from scheduler_harness import (
    POOL_LABEL,
    SchedulerProcess,
    assert_no_oversubscription,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_until,
)

from gpupool_common.handshake import AllocationAck, Assignment, parse_ack, parse_assignment
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_devcluster.raw import discard, read_json
from gpupool_deviceplugin.resources import split_memory_unit_id

GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
PROFILE = "l40s-pcie"  # 4 GPUs, 44 units of 1 GiB each, no MIG
NODES = 2
HOSTNAME = "kubernetes.io/hostname"


# ---- the kubelet of one node ---------------------------------------------------------------------
@dataclass
class PodLife:
    """What the kubelet of a node saw of one pod, as resourceVersions of the watch events."""

    key: str
    uid: str
    bind_rv: int  # first event showing it bound here
    admitted: dict[str, Admitted] = field(default_factory=dict)
    error: str | None = None  # admission refused (the kubelet's UnexpectedAdmissionError)
    ack_rv: int | None = None  # first event with a complete ack on it
    running: bool = False
    deleted: bool = False


def _rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def _containers(obj: dict[str, Any]) -> list[ContainerRequest]:
    """The pod's containers as the devicemanager sees them: init containers first, device requests only."""
    def one(c: dict[str, Any], init: bool) -> ContainerRequest:
        limits = (c.get("resources") or {}).get("limits") or {}
        requests = {r: int(limits[r]) for r in (GPU, MEM) if int(limits.get(r, 0) or 0) > 0}
        return ContainerRequest(c["name"], requests, init=init, sidecar=init and c.get("restartPolicy") == "Always")

    spec = obj["spec"]
    return [one(c, True) for c in spec.get("initContainers") or ()] + [one(c, False) for c in spec["containers"]]


def _identity(obj: dict[str, Any]) -> Pod:
    """The pod as the kubelet's pod manager knows it (what PodResources List answers with)."""
    meta = obj["metadata"]
    created = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00")).timestamp()
    return Pod(meta["namespace"], meta["name"], meta["uid"], created, tuple(_containers(obj)))


class NodeKubelet:
    """Admits the pods bound to `node`, one at a time in the order their binds arrive."""

    def __init__(self, kube: ClusterClient, node: str, standin: KubeletStandin) -> None:
        self.kube = kube
        self.node = node
        self.standin = standin
        self.dm: DeviceManager | None = None
        self.pods: dict[str, PodLife] = {}
        self.order: list[str] = []  # admission order (pod keys)
        self.hold_running = False  # while set, acked pods stay Pending (see test_same_shape...)
        self.hold_admission = False  # while set, bound pods wait unadmitted (release_admission())
        self._held: list[tuple[PodLife, dict[str, Any]]] = []
        self.failure: str | None = None  # the loop itself broke
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{node}", daemon=True)

    def start(self) -> None:
        self.dm = DeviceManager(self.standin, [GPU, MEM])
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            resp.shutdown()  # urllib3: unblocks the reader's socket read
        self._thread.join(timeout=5)
        if self.dm is not None:
            self.dm.close()

    # ---- the watch ----------------------------------------------------------------------------
    def _run(self) -> None:
        selector = f"spec.nodeName={self.node}"
        version: str | None = None
        try:
            while not self._stop.is_set():
                if version is None:
                    listing = read_json(self.kube.core.list_pod_for_all_namespaces(
                        field_selector=selector, _preload_content=False))
                    for obj in sorted(listing["items"], key=_rv):
                        self._handle("ADDED", obj)
                    version = listing["metadata"]["resourceVersion"]
                self._resp = self.kube.core.list_pod_for_all_namespaces(
                    field_selector=selector, watch=True, resource_version=version, allow_watch_bookmarks=True,
                    timeout_seconds=300, _preload_content=False)
                try:
                    for line in iter_resp_lines(self._resp):
                        event = json.loads(line)
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":
                            version = None  # 410 Gone: list again
                            break
                        version = obj["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK" and not self._stop.is_set():
                            self._handle(kind, obj)
                finally:
                    self._resp.release_conn()
        except Exception as exc:
            if not self._stop.is_set():
                with self._cond:
                    self.failure = f"kubelet loop of {self.node} failed: {exc!r}"
                    self._cond.notify_all()

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        meta, status = obj["metadata"], obj.get("status") or {}
        uid, key = meta["uid"], f"{meta['namespace']}/{meta['name']}"
        with self._cond:
            life = self.pods.get(uid)
            if kind == "DELETED" or status.get("phase") in ("Succeeded", "Failed"):
                if life is not None and not life.deleted:
                    life.deleted = True
                    assert self.dm is not None
                    self.dm.remove(_identity(obj))  # frees its devices and leaves the pod manager
                    self._cond.notify_all()
                return
            if life is None:
                if status.get("phase", "Pending") != "Pending":
                    return  # not a new pod for admission (e.g. listed after a restart)
                life = self.pods[uid] = PodLife(key, uid, _rv(obj))
                if self.hold_admission:
                    self._held.append((life, obj))
                else:
                    self.order.append(key)
                    self._admit(life, obj)
                self._cond.notify_all()
                return
            ack = parse_ack(meta.get("annotations"))
            if life.ack_rv is None and ack is not None and ack.complete and ack.pod_uid == uid:
                life.ack_rv = _rv(obj)
                self._cond.notify_all()
            if life.ack_rv is not None and not life.running and not self.hold_running:
                self._mark_running(life, obj)

    def _admit(self, life: PodLife, obj: dict[str, Any]) -> None:
        assert self.dm is not None
        try:
            life.admitted = self.dm.admit(_identity(obj))
        except grpc.RpcError as exc:
            life.error = f"{exc.code().name}: {exc.details()}"
        except AssertionError as exc:  # the stand-in found too few healthy devices
            life.error = str(exc)
        if life.error is not None:
            self._patch_status(obj, {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                     "message": f"Allocate failed: {life.error}"})

    def _mark_running(self, life: PodLife, obj: dict[str, Any]) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("Initialized", "ContainersReady", "Ready")]
        statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "started": True,
                     "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in obj["spec"]["containers"]]
        self._patch_status(obj, {"phase": "Running", "startTime": now, "conditions": conditions,
                                 "containerStatuses": statuses})
        life.running = True

    def _patch_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        meta = obj["metadata"]
        try:
            discard(self.kube.core.patch_namespaced_pod_status(
                meta["name"], meta["namespace"], {"status": status}, _preload_content=False))
        except ApiException as exc:
            if exc.status != 404:
                raise

    # ---- for the test thread ------------------------------------------------------------------
    def release_running(self) -> None:
        """Stop holding acked pods Pending: mark them Running now."""
        with self._cond:
            self.hold_running = False
            for life in self.pods.values():
                if life.ack_rv is not None and not life.running and not life.deleted:
                    ns, name = life.key.split("/")
                    obj = read_json(self.kube.core.read_namespaced_pod(name, ns, _preload_content=False))
                    self._mark_running(life, obj)

    def release_admission(self, reverse: bool = False) -> None:
        """Admit the held pods now, in the order their binds arrived (or the reverse), and stop holding."""
        with self._cond:
            self.hold_admission = False
            held, self._held = self._held, []
            if reverse:
                held.reverse()
            for life, obj in held:
                self.order.append(life.key)
                self._admit(life, obj)
            self._cond.notify_all()

    def held_keys(self) -> list[str]:
        """Pods bound here and not yet admitted, in the order their binds arrived."""
        with self._cond:
            return [life.key for life, _ in self._held]

    def lives(self) -> list[PodLife]:
        with self._cond:
            assert self.failure is None, self.failure
            return [PodLife(**vars(p)) for p in self.pods.values()]

    def idle(self) -> bool:
        """Nothing of an earlier test left: every pod gone, every device Healthy again on the plugin's lists."""
        assert self.dm is not None
        return all(p.deleted for p in self.lives()) and all(
            not w.latest().unhealthy() for w in self.dm.watches.values())


# ---- fixtures: nodes with a plugin and a kubelet each ------------------------------------------
@dataclass
class PluginNode:
    name: str
    plugin: PluginProcess
    standin: KubeletStandin
    kubelet: NodeKubelet


@dataclass
class Pool:
    name: str
    nodes: dict[str, PluginNode]

    def kubelets(self) -> list[NodeKubelet]:
        return [n.kubelet for n in self.nodes.values()]

    def life(self, key: str) -> PodLife:
        found = [p for k in self.kubelets() for p in k.lives() if p.key == key]
        assert len(found) == 1, f"{key}: seen by {len(found)} kubelets"
        return found[0]

    def wait_acked(self, keys: set[str], timeout_s: float = 30.0) -> None:
        """Every pod bound to a plugin node, admitted without error and acknowledged by the plugin."""
        def seen() -> dict[str, PodLife]:
            return {p.key: p for k in self.kubelets() for p in k.lives() if p.key in keys}

        def done() -> bool:
            lives = seen()
            return any(p.error for p in lives.values()) or (
                set(lives) == keys and all(p.ack_rv is not None for p in lives.values()))

        try:
            wait_until(done, timeout_s, "every pod acknowledged", interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the kubelets saw {seen()}") from None
        errors = {k: p.error for k, p in seen().items() if p.error}
        assert not errors, f"admission refused: {errors}"


def _create_node(kube: ClusterClient, name: str, pool: str, pod_identity: bool) -> None:
    """The Node a kubelet + our plugin would register, without kwok's annotation."""
    published = publication_for_profile(PROFILE, node_name=name, pod_identity=pod_identity)
    body = fake_node_manifest(name, PROFILE, published)
    body["metadata"]["annotations"].pop("kwok.x-k8s.io/node")
    body["metadata"]["labels"][POOL_LABEL] = pool
    discard(kube.core.create_node(body=body, _preload_content=False))


@pytest.fixture(scope="module")
def pool(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Plugins without the kubelet's PodResources: the scheduler's gate keeps same-shape pods apart."""
    with _plugin_pool(kube, tmp_path_factory, "full", pod_resources=False) as made:
        yield made


@pytest.fixture(scope="module")
def identity_pool(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Plugins that read the kubelet's PodResources: they publish pod_identity, no gate is held."""
    with _plugin_pool(kube, tmp_path_factory, "ident", pod_resources=True) as made:
        yield made


@contextlib.contextmanager
def _plugin_pool(
    kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory, prefix: str, *, pod_resources: bool
) -> Iterator[Pool]:
    name = unique(prefix)
    work = tmp_path_factory.mktemp(prefix)
    nodes: dict[str, PluginNode] = {}
    dirs: list[tempfile.TemporaryDirectory[str]] = []
    created: list[str] = []
    try:
        for i in range(NODES):
            node = f"{name}-n{i}"
            _create_node(kube, node, name, pod_identity=pod_resources)
            created.append(node)
            d = tempfile.TemporaryDirectory(prefix="gpk-")  # unix socket paths: keep it short
            dirs.append(d)
            kubelet_dir = Path(d.name) / "device-plugins"  # PodResources beside it: <d>/pod-resources
            kubelet_dir.mkdir()
            standin = KubeletStandin(kubelet_dir, pod_resources=pod_resources)
            standin.start()
            plugin = PluginProcess(work, kubelet_dir, PROFILE, node=node, kubeconfig=kube.kubeconfig).start()
            nodes[node] = PluginNode(node, plugin, standin, NodeKubelet(kube, node, standin))
        for n in nodes.values():
            n.standin.wait_registered({GPU, MEM}, timeout=30)
            n.plugin.wait_healthz(200, timeout=30)
            n.kubelet.start()
        yield Pool(name, nodes)
    finally:
        for n in nodes.values():
            n.kubelet.stop()
            n.plugin.stop()
            n.standin.stop()
        for d in dirs:
            d.cleanup()
        for node in created:
            try:
                discard(kube.core.delete_node(node, _preload_content=False))
            except ApiException as exc:
                if exc.status != 404:
                    raise


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


def _handshake(p: dict[str, Any]) -> tuple[Assignment, AllocationAck]:
    annotations = p["metadata"].get("annotations")
    assignment, ack = parse_assignment(annotations), parse_ack(annotations)
    key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
    assert assignment is not None, f"{key}: bound without an assignment"
    assert ack is not None and ack.complete and not ack.error, f"{key}: ack {ack}"
    assert assignment.node == ack.node == p["spec"]["nodeName"], f"{key}: {assignment.node} / {ack.node}"
    assert assignment.pod_uid == ack.pod_uid == p["metadata"]["uid"], key
    return assignment, ack


def assert_kubelet_got_the_assignment(p: dict[str, Any], life: PodLife) -> None:
    """Per container: the ack's devices are the assignment's (whole GPUs exactly; memory units all on
    the assigned GPU, as many as assigned) and exactly what the kubelet's Allocate was given, and the
    Allocate response points the container at those GPUs."""
    key = life.key
    assignment, ack = _handshake(p)
    assert set(ack.containers) == {c.name for c in assignment.containers}, f"{key}: {ack.containers}"
    for c in assignment.containers:
        acked, admitted = ack.containers[c.name], life.admitted[c.name]
        assert set(acked) == set(admitted.devices), f"{key}/{c.name}: ack {acked}, kubelet {admitted.devices}"
        for resource, ids in acked.items():
            assert sorted(ids) == sorted(admitted.devices[resource]), f"{key}/{c.name}: ack {ids}, kubelet " \
                                                                      f"{admitted.devices[resource]}"
            env = admitted.responses[resource].envs
            visible = set(env["NVIDIA_VISIBLE_DEVICES"].split(","))
            if resource == MEM:
                assert c.memory is not None, f"{key}/{c.name}: memory units without a memory assignment"
                gpus = {(split_memory_unit_id(u) or ("not a unit: " + u,))[0] for u in ids}
                assert gpus == {c.memory.gpu}, f"{key}/{c.name}: units on {gpus}, assigned {c.memory.gpu}"
                assert len(ids) == c.memory.units, f"{key}/{c.name}: {len(ids)} units, assigned {c.memory.units}"
                assert visible == {c.memory.gpu}, f"{key}/{c.name}: NVIDIA_VISIBLE_DEVICES {visible}"
                assert env["GPUPOOL_MEMORY_LIMIT_MIB"] == str(c.memory.units * c.memory.unit_mib)
            else:
                assert sorted(ids) == sorted(c.devices[resource]), f"{key}/{c.name}: got {ids}, " \
                                                                   f"assigned {c.devices[resource]}"
                assert visible == set(ids), f"{key}/{c.name}: NVIDIA_VISIBLE_DEVICES {visible}, allocated {ids}"


def assert_gate_held(pods: list[dict[str, Any]], pool: Pool) -> None:
    """docs/handshake.md rule 4 as the kubelets saw it: on a node, a pod sharing a shape with an earlier
    bound pod is bound only after that pod's ack."""
    by_node: dict[str, list[tuple[PodLife, set[tuple[str, int]]]]] = {}
    for p in pods:
        assignment, _ = _handshake(p)
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


def plugin_counter(plugin: PluginProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on the plugin's /metrics whose labels include `labels`."""
    _, text = plugin.http("/metrics")
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if line.startswith("#") or head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def preferred_sources(pool: Pool) -> dict[str, float]:
    """GetPreferredAllocation answers of every plugin of the pool, by source (assignment / topology)."""
    name = "gpupool_deviceplugin_preferred_allocations_total"
    return {src: sum(plugin_counter(n.plugin, name, source=src) for n in pool.nodes.values())
            for src in ("assignment", "topology")}


def stop_scheduler(proc: SchedulerProcess) -> None:
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


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
            _, ack = _handshake(p)
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
    assert _rv(created_a) < _rv(created_b)
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
        assert _rv(event_b) < _rv(event_a), "Scheduled events in the creation order, not B then A"
        assert _rv(event_a) > b_acked, "a's Scheduled event before b's ack"

        pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        gpus = {}
        for pod_name, life in (("a", life_a), ("b", life_b)):
            p = pods[pod_name]
            assert p["spec"]["nodeName"] == node
            assert_kubelet_got_the_assignment(p, life)
            assignment, ack = _handshake(p)
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
            assignment, ack = _handshake(p)
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
