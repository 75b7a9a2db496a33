"""All DevicePlugin servers of the node: serve each resource on its own socket, then register it;
re-serve and re-register everything when the kubelet restarts."""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc

from gpupool_deviceplugin.allocator import Allocator
from gpupool_deviceplugin.api.v1beta1 import api_pb2_grpc
from gpupool_deviceplugin.board import DeviceBoard
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.resources import ResourceSpec
from gpupool_deviceplugin.server.registration import KUBELET_SOCKET, KubeletRegistrar
from gpupool_deviceplugin.server.service import DevicePluginService

log = logging.getLogger(__name__)
SOCKET_PREFIX = "gpupool-"


def remove_stale_sockets(kubelet_dir: Path) -> list[str]:
    """Remove sockets a previous gpupool plugin left in the kubelet directory."""
    removed = []
    for path in kubelet_dir.glob(f"{SOCKET_PREFIX}*.sock"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


class _ResourceServer:
    def __init__(self, spec: ResourceSpec, kubelet_dir: Path, service_args: dict) -> None:
        self.spec = spec
        self.path = kubelet_dir / spec.endpoint
        self.stopping = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=spec.endpoint))
        api_pb2_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(spec, stopping=self.stopping, **service_args), self.server)
        if self.server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot listen on {self.path}")

    def start(self) -> None:
        self.server.start()

    def stop(self, board: DeviceBoard | None = None) -> None:
        self.stopping.set()
        if board is not None:
            board.wake()
        self.server.stop(grace=0.5).wait(2)
        self.path.unlink(missing_ok=True)


class PluginServers:
    """Owns the per-resource servers. `restart()` is safe to call from any thread."""

    def __init__(self, resources: list[ResourceSpec], kubelet_dir: Path, board: DeviceBoard,
                 allocator: Allocator, metrics: PluginMetrics) -> None:
        self.resources = resources
        self.kubelet_dir = kubelet_dir
        self.metrics = metrics
        self._board = board
        self._args = {"board": board, "allocator": allocator, "metrics": metrics}
        self._servers: list[_ResourceServer] = []
        self._lock = threading.Lock()
        self._registered: set[str] = set()
        self._registrar = KubeletRegistrar(kubelet_dir)
        self.kubelet_identity: tuple[int, int] | None = None  # (inode, mtime_ns) of the kubelet.sock we registered with
        self.publish_registration(kubelet_up=False)

    @property
    def socket_paths(self) -> list[Path]:
        return [self.kubelet_dir / r.endpoint for r in self.resources]

    def publish_registration(self, kubelet_up: bool) -> None:
        """Set gpupool_deviceplugin_registered per resource: registered, and the kubelet's socket is there."""
        for spec in self.resources:
            self.metrics.registered.labels(resource=spec.name).set(int(kubelet_up and spec.name in self._registered))

    def all_registered(self) -> bool:
        return self._registered == {r.name for r in self.resources}

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        for spec in self.resources:
            server = _ResourceServer(spec, self.kubelet_dir, self._args)
            server.start()
            self._servers.append(server)
            log.info("serving %s on %s (%d devices)", spec.name, server.path, len(spec.devices))

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        for server in self._servers:
            server.stop(self._board)
        self._servers = []
        self._registered = set()
        self._registrar.reset()
        self.publish_registration(kubelet_up=False)

    def restart(self) -> None:
        with self._lock:
            self._stop_locked()
            self._start_locked()

    def register_all(self) -> bool:
        """Register every served resource that is not registered yet; True when all are."""
        with self._lock:
            identity = kubelet_socket_identity(self.kubelet_dir)
            for spec in self.resources:
                if spec.name in self._registered:
                    continue
                try:
                    self._registrar.register(spec.name, spec.endpoint)
                except grpc.RpcError as exc:
                    self.metrics.registrations.labels(resource=spec.name, result="error").inc()
                    log.warning("registering %s with the kubelet failed: %s %s", spec.name, exc.code().name,
                                exc.details())
                    return False
                self._registered.add(spec.name)
                self.metrics.registrations.labels(resource=spec.name, result="ok").inc()
                self.metrics.registered.labels(resource=spec.name).set(1)
                log.info("registered %s with the kubelet (endpoint %s)", spec.name, spec.endpoint)
            self.kubelet_identity = identity
            return True

    def sockets_present(self) -> bool:
        return all(p.exists() for p in self.socket_paths)


def kubelet_socket_identity(kubelet_dir: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(kubelet_dir / KUBELET_SOCKET)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns
