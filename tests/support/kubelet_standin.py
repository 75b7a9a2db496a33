"""A kubelet stand-in for device plugin tests: the real Registration gRPC service on a unix socket
in a temporary directory, clients for the plugin's DevicePlugin services, a small device manager
that admits pods the way the kubelet does (pods one at a time, in the order their updates arrive, a batch
oldest first; per container reuse of init-container devices, GetPreferredAllocation, then Allocate), and
optionally the PodResources API (List, GetAllocatableResources) served from what it admitted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpupool_deviceplugin.api.podresources.v1 import api_pb2 as pr_pb2
from gpupool_deviceplugin.api.podresources.v1 import api_pb2_grpc as pr_grpc
from gpupool_deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc


@dataclass(frozen=True)
class Registration:
    resource: str
    endpoint: str
    version: str
    preferred_allocation: bool
    at: float  # time.monotonic()


class _Registrar(api_pb2_grpc.RegistrationServicer):
    def __init__(self, owner: KubeletStandin) -> None:
        self.owner = owner

    def Register(self, request, context):
        self.owner._record(Registration(request.resource_name, request.endpoint, request.version,
                                        request.options.get_preferred_allocation_available, time.monotonic()))
        return api_pb2.Empty()


class _PodResourcesLister(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources v1 service, answered from the stand-in's device manager."""

    def __init__(self, owner: KubeletStandin) -> None:
        self.owner = owner

    def List(self, request, context):
        dm = self.owner.device_manager
        return dm.pod_resources() if dm is not None else pr_pb2.ListPodResourcesResponse()

    def GetAllocatableResources(self, request, context):
        dm = self.owner.device_manager
        return dm.allocatable_resources() if dm is not None else pr_pb2.AllocatableResourcesResponse()

    def Get(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "PodResources API Get method disabled")  # feature gate off


class KubeletStandin:
    """Serves Registration on <directory>/kubelet.sock and, with `pod_resources`, the PodResources API on
    <directory>/../pod-resources/kubelet.sock (the kubelet's layout: /var/lib/kubelet/{device-plugins,
    pod-resources}), answered from the DeviceManager made for it."""

    def __init__(self, directory: Path, pod_resources: bool = False) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.pod_resources_socket = directory.parent / "pod-resources" / "kubelet.sock" if pod_resources else None
        self.registrations: list[Registration] = []
        self.device_manager: DeviceManager | None = None
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._channels: list[grpc.Channel] = []

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registrar(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        self.serve_pod_resources()

    def serve_pod_resources(self) -> None:
        if self.pod_resources_socket is None or self._pr_server is not None:
            return
        self.pod_resources_socket.parent.mkdir(exist_ok=True)
        self.pod_resources_socket.unlink(missing_ok=True)
        pr_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesLister(self), pr_server)
        pr_server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        pr_server.start()
        self._pr_server = pr_server

    def stop_pod_resources(self) -> None:
        """Only the PodResources socket goes away (not mounted into the plugin's pod, say)."""
        if self._pr_server is not None:
            self._pr_server.stop(grace=0).wait()
            self._pr_server = None
            assert self.pod_resources_socket is not None
            self.pod_resources_socket.unlink(missing_ok=True)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
        self.stop_pod_resources()
        self.socket.unlink(missing_ok=True)
        for channel in self._channels:
            channel.close()
        self._channels = []

    def restart(self) -> float:
        """What a restarting kubelet does: delete every socket in the directory, then serve a new
        kubelet.sock. Returns the time (monotonic) kubelet.sock was re-created."""
        self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink(missing_ok=True)
        time.sleep(0.05)  # a real kubelet takes a while to come back; the plugin must not care
        self.start()
        return time.monotonic()

    def _record(self, registration: Registration) -> None:
        with self._cond:
            self.registrations.append(registration)
            self._cond.notify_all()

    def wait_registered(self, resources: set[str], *, since: float = 0.0,
                        timeout: float = 15.0) -> dict[str, Registration]:
        """The first registration of each resource at or after `since`; fails after `timeout`."""
        def found() -> dict[str, Registration]:
            out: dict[str, Registration] = {}
            for reg in self.registrations:
                if reg.at >= since and reg.resource in resources and reg.resource not in out:
                    out[reg.resource] = reg
            return out

        with self._cond:
            self._cond.wait_for(lambda: set(found()) == resources, timeout)
            got = found()
        missing = resources - set(got)
        assert not missing, f"not registered within {timeout}s: {sorted(missing)}; got {self.registrations}"
        return got

    def plugin(self, resource: str) -> PluginClient:
        """A client for the resource's plugin, at the endpoint of its latest registration."""
        reg = next(r for r in reversed(self.registrations) if r.resource == resource)
        channel = grpc.insecure_channel(f"unix://{self.directory / reg.endpoint}")
        self._channels.append(channel)
        return PluginClient(resource, api_pb2_grpc.DevicePluginStub(channel))


@dataclass
class DeviceList:
    devices: dict[str, api_pb2.Device]
    at: float

    def healthy(self) -> set[str]:
        return {i for i, d in self.devices.items() if d.health == "Healthy"}

    def unhealthy(self) -> set[str]:
        return {i for i, d in self.devices.items() if d.health != "Healthy"}


class DeviceWatch:
    """Consumes a ListAndWatch stream on a thread, as the kubelet does."""

    def __init__(self, stub: api_pb2_grpc.DevicePluginStub) -> None:
        self.lists: list[DeviceList] = []
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._call = stub.ListAndWatch(api_pb2.Empty())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                with self._cond:
                    self.lists.append(DeviceList({d.ID: d for d in resp.devices}, time.monotonic()))
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def latest(self) -> DeviceList:
        return self.wait(lambda _lst: True)

    def wait(self, predicate: Callable[[DeviceList], bool], timeout: float = 10.0) -> DeviceList:
        with self._cond:
            ok = self._cond.wait_for(lambda: bool(self.lists) and predicate(self.lists[-1]), timeout)
            assert ok, f"device list never satisfied the condition within {timeout}s; last: " \
                       f"{sorted(self.lists[-1].unhealthy()) if self.lists else 'nothing received'}"
            return self.lists[-1]

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


@dataclass
class PluginClient:
    resource: str
    stub: api_pb2_grpc.DevicePluginStub

    def options(self) -> api_pb2.DevicePluginOptions:
        return self.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)

    def watch(self) -> DeviceWatch:
        return DeviceWatch(self.stub)

    def preferred(self, available: Sequence[str], size: int, must_include: Sequence[str] = ()) -> list[str]:
        req = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size)])
        return list(self.stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)

    def allocate(self, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(ids))])
        return self.stub.Allocate(req, timeout=10).container_responses[0]


@dataclass
class ContainerRequest:
    name: str
    requests: dict[str, int]
    init: bool = False
    sidecar: bool = False


@dataclass(frozen=True)
class Pod:
    """A pod as the kubelet's pod manager knows it: identity, creation time (admission order within a
    batch) and containers."""

    namespace: str
    name: str
    uid: str
    created: float
    containers: tuple[ContainerRequest, ...]
    anonymous: bool = False  # made by admit_pod(): not in PodResources answers (the plugin cannot know it)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Admitted:
    devices: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, api_pb2.ContainerAllocateResponse] = field(default_factory=dict)


_anonymous = itertools.count(1)


class DeviceManager:
    """The kubelet's admission and devicemanager allocation path, against the plugin's real gRPC services:
    healthy devices come from ListAndWatch, devices in use are remembered, init-container devices are
    reused by later containers, then GetPreferredAllocation and Allocate are called per container.

    Pod identity and order as in the kubelet: `admit(pod)` is one pod arriving on its own (a watch event:
    pods bound a moment apart are admitted one by one in the order their binds arrive), `add_pods(pods)`
    one update with several pods (the kubelet's start, a re-list), admitted oldest first. A pod joins the
    pod manager just before its admission, so PodResources List shows it (without devices) while it is
    being admitted, and a container's devices once its Allocate returned."""

    def __init__(self, kubelet: KubeletStandin, resources: Sequence[str]) -> None:
        self.kubelet = kubelet
        self.resources = list(resources)
        self.clients = {r: kubelet.plugin(r) for r in resources}
        self.watches = {r: c.watch() for r, c in self.clients.items()}
        self.in_use: dict[str, set[str]] = {r: set() for r in resources}
        self.pods: dict[str, Pod] = {}  # the pod manager, in the order pods were added
        self.rejected: set[str] = set()
        self.allocated: dict[str, dict[str, dict[str, list[str]]]] = {}  # uid -> container -> resource -> IDs
        self._lock = threading.Lock()
        kubelet.device_manager = self

    def close(self) -> None:
        for w in self.watches.values():
            w.close()

    def reconnect(self) -> None:
        """After the plugin restarted (new registration): new clients and ListAndWatch streams; what was
        allocated stays, as the kubelet's checkpoint keeps it."""
        self.close()
        self.clients = {r: self.kubelet.plugin(r) for r in self.resources}
        self.watches = {r: c.watch() for r, c in self.clients.items()}

    def release(self, admitted: dict[str, Admitted]) -> None:
        for adm in admitted.values():
            for resource, ids in adm.devices.items():
                self.in_use[resource] -= set(ids)

    def remove(self, pod: Pod) -> None:
        """The pod was deleted: its devices are free and the pod manager forgets it."""
        with self._lock:
            self.pods.pop(pod.uid, None)
            self._free(pod.uid)

    def admit_pod(self, containers: Sequence[ContainerRequest]) -> dict[str, Admitted]:
        """Allocate every container of a pod the plugin cannot identify (not listed by PodResources)."""
        n = next(_anonymous)
        pod = Pod("", f"anonymous-{n}", f"anonymous-{n}", time.time(), tuple(containers), anonymous=True)
        return self.admit(pod)

    def admit(self, pod: Pod) -> dict[str, Admitted]:
        """One pod arriving on its own. Raises grpc.RpcError when the plugin refuses, like the kubelet's
        UnexpectedAdmissionError (the pod is rejected: it stays known, without devices)."""
        result = self.add_pods([pod])[pod.uid]
        if isinstance(result, grpc.RpcError):
            raise result
        return result

    def add_pods(self, pods: Sequence[Pod]) -> dict[str, dict[str, Admitted] | grpc.RpcError]:
        """One update with several pods (HandlePodAdditions): sorted by creation time, each added to the pod
        manager and admitted before the next. Returns per pod UID its containers or the refusal."""
        out: dict[str, dict[str, Admitted] | grpc.RpcError] = {}
        for pod in sorted(pods, key=lambda p: p.created):
            with self._lock:
                self.pods[pod.uid] = pod
            try:
                out[pod.uid] = self._admit(pod)
            except grpc.RpcError as err:
                with self._lock:
                    self.rejected.add(pod.uid)
                    self._free(pod.uid)
                out[pod.uid] = err
        return out

    def _admit(self, pod: Pod) -> dict[str, Admitted]:
        ordered = [c for c in pod.containers if c.init] + [c for c in pod.containers if not c.init]
        reusable: dict[str, set[str]] = {r: set() for r in self.clients}
        out: dict[str, Admitted] = {}
        for c in ordered:
            adm = out.setdefault(c.name, Admitted())
            for resource, size in c.requests.items():
                ids = self._devices_to_allocate(resource, size, reusable[resource])
                with self._lock:
                    self.allocated.setdefault(pod.uid, {}).setdefault(c.name, {})
                adm.devices[resource] = ids
                try:
                    adm.responses[resource] = self.clients[resource].allocate(ids)
                except grpc.RpcError:
                    with self._lock:
                        self.in_use[resource] -= set(ids)
                    raise
                with self._lock:  # podDevices.insert: only once Allocate returned
                    self.allocated[pod.uid][c.name][resource] = ids
                if c.init and not c.sidecar:
                    reusable[resource] |= set(ids)
                else:
                    reusable[resource] -= set(ids)
        return out

    def _free(self, uid: str) -> None:
        for by_resource in self.allocated.pop(uid, {}).values():
            for resource, ids in by_resource.items():
                self.in_use[resource] -= set(ids)

    def _devices_to_allocate(self, resource: str, size: int, reusable: set[str]) -> list[str]:
        allocated: list[str] = sorted(reusable)[:size]
        if len(allocated) == size:
            return allocated
        healthy = self.watches[resource].latest().healthy()
        available = healthy - self.in_use[resource]
        assert len(available) >= size - len(allocated), f"kubelet: not enough {resource} available"
        if size - len(allocated) < len(available):  # the kubelet asks only when it has a choice
            preferred = self.clients[resource].preferred(sorted(available | set(allocated)), size, allocated)
            for device in preferred:
                if len(allocated) == size:
                    break
                if device in available and device not in allocated:
                    allocated.append(device)
        for device in sorted(available):  # the kubelet fills up from whatever is left
            if len(allocated) == size:
                break
            if device not in allocated:
                allocated.append(device)
        self.in_use[resource] |= set(allocated)
        return allocated

    # -- PodResources --------------------------------------------------------------------------------
    def pod_resources(self) -> pr_pb2.ListPodResourcesResponse:
        """List: every pod of the pod manager, sidecars and app containers (not other init containers)
        with the devices their Allocate returned."""
        with self._lock:
            out = pr_pb2.ListPodResourcesResponse()
            for pod in self.pods.values():
                if pod.anonymous:
                    continue
                held = self.allocated.get(pod.uid, {})
                entry = out.pod_resources.add(name=pod.name, namespace=pod.namespace)
                for c in pod.containers:
                    if c.init and not c.sidecar:
                        continue
                    container = entry.containers.add(name=c.name)
                    for resource, ids in held.get(c.name, {}).items():
                        container.devices.add(resource_name=resource, device_ids=ids)
            return out

    def allocatable_resources(self) -> pr_pb2.AllocatableResourcesResponse:
        """GetAllocatableResources: the healthy devices of every resource, one entry per device."""
        out = pr_pb2.AllocatableResourcesResponse()
        for resource, watch in self.watches.items():
            if not watch.lists:
                continue
            for device in watch.lists[-1].devices.values():
                if device.health == "Healthy":
                    entry = out.devices.add(resource_name=resource, device_ids=[device.ID])
                    for node in device.topology.nodes:
                        entry.topology.nodes.add(ID=node.ID)
        return out
