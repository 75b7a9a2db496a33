"""The kubelet of one node, for nodes that run the real device plugin behind the kubelet stand-in
(tests.support.kubelet_standin): `NodeKubelet` watches the pods bound to its node (field selector
spec.nodeName, as the kubelet does), admits each in the order its bind arrives through the stand-in's
DeviceManager, and marks it Running once the plugin's ack is on it (standing in for container start-up, so
that the ack, not the phase, is what opens the scheduler's gate). Every moment is recorded as the
resourceVersion of the watch event that showed it (`PodLife`): one etcd revision counter (the dev cluster
has a single etcd) orders binds, acks and events exactly, with no clocks.

Also the checks of what such a kubelet got: the handshake on a bound pod, and per container exactly the
assigned devices in Allocate.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from gpupool_common.handshake import AllocationAck, Assignment, parse_ack, parse_assignment
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import discard, read_json
from gpupool_deviceplugin.resources import split_memory_unit_id
from tests.support.kubelet_standin import Admitted, ContainerRequest, DeviceManager, KubeletStandin, Pod

GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"


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


def resource_version(obj: dict[str, Any]) -> int:
    """An object's resourceVersion as a number (one etcd: they order every change of the cluster)."""
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
                    for obj in sorted(listing["items"], key=resource_version):
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
                life = self.pods[uid] = PodLife(key, uid, resource_version(obj))
                if self.hold_admission:
                    self._held.append((life, obj))
                else:
                    self.order.append(key)
                    self._admit(life, obj)
                self._cond.notify_all()
                return
            ack = parse_ack(meta.get("annotations"))
            if life.ack_rv is None and ack is not None and ack.complete and ack.pod_uid == uid:
                life.ack_rv = resource_version(obj)
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


# ---- checks of what a kubelet got -----------------------------------------------------------------
def handshake_of(p: dict[str, Any]) -> tuple[Assignment, AllocationAck]:
    """The bound pod's assignment and the plugin's complete ack, which must agree on node and pod."""
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
    assignment, ack = handshake_of(p)
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
