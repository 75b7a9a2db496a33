"""The DevicePlugin gRPC service for one resource."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from gpupool_deviceplugin.admission import AdmissionError, Refusal
from gpupool_deviceplugin.allocator import Allocator
from gpupool_deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc
from gpupool_deviceplugin.board import HEALTHY, UNHEALTHY, DeviceBoard, DeviceView
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.resources import ResourceSpec

log = logging.getLogger(__name__)
_CODES = {Refusal.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
          Refusal.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION}
STREAM_POLL_S = 1.0  # an idle ListAndWatch stream re-checks that it should still run (also woken on cancel)


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, spec: ResourceSpec, board: DeviceBoard, allocator: Allocator, metrics: PluginMetrics,
                 stopping: threading.Event) -> None:
        self.spec = spec
        self.board = board
        self.allocator = allocator
        self.metrics = metrics
        self.stopping = stopping
        self._cache: tuple[int, api_pb2.ListAndWatchResponse] | None = None
        self._cache_lock = threading.Lock()

    def GetDevicePluginOptions(self, request, context):
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        name = self.spec.name
        context.add_callback(self.board.wake)  # a cancelled stream frees its worker thread at once
        seen, views = self.board.snapshot(name)
        log.info("ListAndWatch %s opened: %d devices", name, len(views))
        yield self._response(seen, views)
        while not self.stopping.is_set() and context.is_active():
            got = self.board.wait_for_change(name, seen, STREAM_POLL_S)
            if got is not None:
                seen, views = got
                bad = sum(not v.healthy for v in views)
                log.info("ListAndWatch %s: sending %d devices (%d unhealthy)", name, len(views), bad)
                yield self._response(seen, views)
        log.info("ListAndWatch %s closed", name)

    def _response(self, version: int, views: tuple[DeviceView, ...]) -> api_pb2.ListAndWatchResponse:
        with self._cache_lock:
            if self._cache is not None and self._cache[0] == version:
                return self._cache[1]
            resp = api_pb2.ListAndWatchResponse(devices=[_device(v) for v in views])
            self._cache = (version, resp)
            healthy = sum(v.healthy for v in views)
            self.metrics.devices.labels(resource=self.spec.name, health=HEALTHY).set(healthy)
            self.metrics.devices.labels(resource=self.spec.name, health=UNHEALTHY).set(len(views) - healthy)
            return resp

    def GetPreferredAllocation(self, request, context):
        out = api_pb2.PreferredAllocationResponse()
        for req in request.container_requests:
            ids = self.allocator.preferred(self.spec.name, list(req.available_deviceIDs),
                                           list(req.must_include_deviceIDs), req.allocation_size)
            out.container_responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return out

    def Allocate(self, request, context):
        out = api_pb2.AllocateResponse()
        for req in request.container_requests:
            start = time.perf_counter()
            try:
                out.container_responses.append(self.allocator.allocate(self.spec.name, list(req.devices_ids)))
            except AdmissionError as err:
                context.abort(_CODES[err.code], f"gpupool: {err}")
            finally:
                self.metrics.allocate_seconds.labels(resource=self.spec.name).observe(time.perf_counter() - start)
        return out

    def PreStartContainer(self, request, context):
        return api_pb2.PreStartContainerResponse()


def _device(view: DeviceView) -> api_pb2.Device:
    d = view.device
    dev = api_pb2.Device(ID=d.id, health=HEALTHY if view.healthy else UNHEALTHY)
    if d.numa_node is not None:
        dev.topology.nodes.append(api_pb2.NUMANode(ID=d.numa_node))
    return dev
