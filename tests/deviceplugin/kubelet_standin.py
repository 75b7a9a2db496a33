"""A kubelet stand-in for device plugin tests: the real Registration gRPC service on a unix socket
in a temporary directory, clients for the plugin's DevicePlugin services, and a small device manager
that admits containers the way the kubelet's devicemanager does (reuse of init-container devices,
GetPreferredAllocation, then Allocate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

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


class KubeletStandin:
    """Serves Registration on <directory>/kubelet.sock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.registrations: list[Registration] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._channels: list[grpc.Channel] = []

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registrar(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
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


@dataclass
class Admitted:
    devices: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, api_pb2.ContainerAllocateResponse] = field(default_factory=dict)


class DeviceManager:
    """The kubelet devicemanager's allocation path for pods, against the plugin's real gRPC services:
    healthy devices come from ListAndWatch, devices in use are remembered, init-container devices are
    reused by later containers, then GetPreferredAllocation and Allocate are called per container."""

    def __init__(self, kubelet: KubeletStandin, resources: Sequence[str]) -> None:
        self.clients = {r: kubelet.plugin(r) for r in resources}
        self.watches = {r: c.watch() for r, c in self.clients.items()}
        self.in_use: dict[str, set[str]] = {r: set() for r in resources}

    def close(self) -> None:
        for w in self.watches.values():
            w.close()

    def release(self, admitted: dict[str, Admitted]) -> None:
        for adm in admitted.values():
            for resource, ids in adm.devices.items():
                self.in_use[resource] -= set(ids)

    def admit_pod(self, containers: Sequence[ContainerRequest]) -> dict[str, Admitted]:
        """Allocate every container in kubelet order (init containers first). Raises grpc.RpcError
        when the plugin refuses, like the kubelet's UnexpectedAdmissionError."""
        ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
        reusable: dict[str, set[str]] = {r: set() for r in self.clients}
        out: dict[str, Admitted] = {}
        for c in ordered:
            adm = out.setdefault(c.name, Admitted())
            for resource, size in c.requests.items():
                ids = self._devices_to_allocate(resource, size, reusable[resource])
                adm.devices[resource] = ids
                adm.responses[resource] = self.clients[resource].allocate(ids)
                if c.init and not c.sidecar:
                    reusable[resource] |= set(ids)
                else:
                    reusable[resource] -= set(ids)
        return out

    def _devices_to_allocate(self, resource: str, size: int, reusable: set[str]) -> list[str]:
        allocated: list[str] = sorted(reusable)[:size]
        if len(allocated) == size:
            return allocated
        healthy = self.watches[resource].latest().healthy()
        available = healthy - self.in_use[resource]
        assert len(available) >= size - len(allocated), f"kubelet: not enough {resource} available"
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
