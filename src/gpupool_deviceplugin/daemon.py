"""The device plugin process: start-up order, the running parts and an orderly shutdown.

Start-up: status endpoint -> NVML (retried with backoff) -> discovery -> API server (optional: pod watch,
acks, one reconciliation with the kubelet's PodResources, node publication) -> idle sampler -> health monitor ->
serve every resource -> register with the kubelet -> keep registered (and reconciled).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pynvml

from gpupool_common.idlepods import idle_pods_annotation
from gpupool_common.inventory import NodeInventory
from gpupool_deviceplugin.admission import AdmissionBook
from gpupool_deviceplugin.allocator import AckSink, Allocator
from gpupool_deviceplugin.board import DeviceBoard
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.discovery import discover
from gpupool_deviceplugin.health import HealthMonitor
from gpupool_deviceplugin.idle import IdlePolicy
from gpupool_deviceplugin.idle_sampler import IdleSampler, pod_uid_of_pid, tenants_from_book
from gpupool_deviceplugin.metrics import PluginMetrics, StatusServer
from gpupool_deviceplugin.nvml.session import NvmlSession
from gpupool_deviceplugin.publication import NodePublication, build_publication
from gpupool_deviceplugin.resources import ResourceSpec, StrategyError, build_resources
from gpupool_deviceplugin.server.kubelet_watch import Supervisor
from gpupool_deviceplugin.server.plugin_servers import PluginServers, remove_stale_sockets

if TYPE_CHECKING:
    from gpupool_deviceplugin.podresources import Reconciler

log = logging.getLogger(__name__)
LOCK_FILE = "gpupool-deviceplugin.lock"


class StartupError(RuntimeError):
    """The plugin cannot start; the message is one line for the operator (the command exits with 2)."""


class KubeletDirLock:
    """An exclusive lock on a file in the kubelet directory, held while the plugin runs.

    Without it a second plugin on the same directory would take the first one's live sockets for stale ones
    and delete them. flock() is released by the kernel when the process dies, however it dies, so a crashed
    plugin never blocks its successor; the kubelet deletes only sockets there, so the file outlives kubelet
    restarts. The file is never deleted (that would let two processes lock two different files)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: Path, owner: str) -> KubeletDirLock:
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
            os.close(fd)
            raise StartupError(
                f"another gpupool device plugin ({holder}) is serving the kubelet directory {directory} "
                f"(it holds {path}); stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, node {owner}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class DaemonOptions:
    node_name: str
    kubelet_dir: Path
    config: PluginConfig
    kubeconfig: str | None = None
    pod_resources_socket: Path | None = None  # default: $GPUPOOL_POD_RESOURCES_SOCKET or <kubelet dir>/../pod-resources
    nvml_backoff_initial_s: float = 1.0
    nvml_backoff_max_s: float = 300.0


@dataclass
class _Status:
    phase: str = "starting"
    detail: str = ""
    stopping: threading.Event = field(default_factory=threading.Event)


class Daemon:
    def __init__(self, options: DaemonOptions, session: NvmlSession) -> None:
        self.opts = options
        self.config = options.config
        self.session = session
        self.metrics = PluginMetrics()
        self.metrics.node_info.labels(node=options.node_name).set(1)
        self.status = _Status()
        self._parts: list = []  # things with stop(), stopped in reverse order
        self.servers: PluginServers | None = None
        self._tenancy_lock = threading.Lock()
        self._api_client = None
        self._api_checked = False
        self.status_server: StatusServer | None = None
        self._dir_lock: KubeletDirLock | None = None
        self.idle_sampler: IdleSampler | None = None

    # -- health endpoint -------------------------------------------------------------------------
    def healthz(self) -> tuple[bool, str]:
        if self.status.phase != "running":
            return False, f"{self.status.phase}: {self.status.detail}"
        if self.servers is not None and not self.servers.all_registered():
            return False, "not registered with the kubelet"
        return True, "ok"

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until stop(). Raises StartupError, before anything is served, when another plugin holds
        the kubelet directory or the metrics port cannot be bound."""
        self._dir_lock = KubeletDirLock.acquire(self.opts.kubelet_dir, self.opts.node_name)
        m = self.config.metrics
        try:
            if m.port:  # 0: off, as --metrics-port 0 of every gpupool command
                self.status_server = StatusServer(self.metrics, self.healthz, m.bind_address, m.port)
        except (OSError, OverflowError) as exc:
            self._dir_lock.release()
            self._dir_lock = None
            why = getattr(exc, "strerror", None) or exc
            raise StartupError(f"cannot serve metrics on {m.bind_address}:{m.port}: {why} (set metrics.port "
                               "in the config or --metrics-port; 0 turns them off)") from None
        try:
            if self.status_server is not None:
                self.status_server.start()
                log.info("metrics and healthz on http://%s:%d", m.bind_address, self.status_server.port)
            else:
                log.info("metrics and healthz off (metrics port 0)")
            inventory, resources = self._start_nvml()
            if inventory is None:
                return 0  # stopped while waiting for NVML
            self._start(inventory, resources)
            self.status.phase, self.status.detail = "running", ""
            log.info("gpupool device plugin running on node %s: %s", self.opts.node_name,
                     ", ".join(f"{r.name}={len(r.devices)}" for r in resources) or "no resources")
            self.status.stopping.wait()
            return 0
        finally:
            self.shutdown()

    def stop(self) -> None:
        self.status.stopping.set()

    def shutdown(self) -> None:
        log.info("shutting down")
        for part in reversed(self._parts):
            try:
                part.stop()
            except Exception as exc:
                log.warning("stopping %s failed: %s", type(part).__name__, exc)
        self._parts = []
        if self.status_server is not None:
            self.status_server.stop()
            self.status_server = None
        self.session.shutdown()
        if self._dir_lock is not None:  # last: our sockets are gone, a successor may start
            self._dir_lock.release()
            self._dir_lock = None

    def _start_nvml(self) -> tuple[NodeInventory | None, list[ResourceSpec]]:
        """Initialise NVML and discover, retrying with backoff; never a silent crash loop."""
        delay = self.opts.nvml_backoff_initial_s
        attempt = 0
        while not self.status.stopping.is_set():
            attempt += 1
            try:
                self.session.init()
            except pynvml.NVMLError as exc:
                self.metrics.nvml_init_failures.inc()
                self.status.phase, self.status.detail = "waiting for NVML", str(exc)
                log.error("NVML init failed (attempt %d): %s. Is the NVIDIA driver loaded and libnvidia-ml.so.1 "
                          "visible in this container (NVIDIA container runtime / driver root mount)? "
                          "Retrying in %.1fs", attempt, exc, delay)
                self.status.stopping.wait(delay)
                delay = min(delay * 2, self.opts.nvml_backoff_max_s)
                continue
            try:
                inventory = discover(self.session)
                resources = build_resources(inventory, self.config, memory_units=self._memory_units_possible())
                return inventory, resources
            except (pynvml.NVMLError, StrategyError) as exc:
                self.session.shutdown()
                self.status.phase, self.status.detail = "discovery failed", str(exc)
                log.error("GPU discovery failed (attempt %d): %s. Retrying in %.1fs", attempt, exc, delay)
                self.status.stopping.wait(delay)
                delay = min(delay * 2, self.opts.nvml_backoff_max_s)
        return None, []

    def _memory_units_possible(self) -> bool:
        return self.config.resources.gpu_memory and self._api() is not None

    def _api(self):
        """The API client (connected once), or None when the plugin runs without an API server."""
        if not self._api_checked:
            from gpupool_deviceplugin.kube.client import connect

            self._api_client = connect(self.config.kubernetes.mode, self.opts.kubeconfig)
            self._api_checked = True
            if self._api_client is None and self.config.resources.gpu_memory:
                why = ("kubernetes.mode=disabled" if self.config.kubernetes.mode == "disabled"
                       else "no in-cluster config, no kubeconfig")
                log.warning("no API server (%s): serving whole GPUs and MIG devices with topology-based "
                            "preferred allocation only; nvidia.com/gpu-memory sharing needs the pod watch and "
                            "is not offered", why)
        return self._api_client

    def _start(self, inventory: NodeInventory, resources: list[ResourceSpec]) -> None:
        self.status.phase, self.status.detail = "starting", "serving"
        api = self._api()
        memory = any(r.kind == "memory" for r in resources)
        publisher = None
        pod_identity = False  # PodResources answers (published: the scheduler's gate is not needed then)
        idle_pods: str | None = None  # the idle-pods annotation, once the sampler has measured

        def publication() -> NodePublication:
            failed = tuple(sorted(board.hardware_problems()))
            live = inventory.model_copy(update={"unhealthy": failed, "pod_identity": pod_identity})
            return build_publication(live, resources, self.config, idle_pods=idle_pods,
                                     idle_pending=self.config.idle.sample_interval_s > 0)

        def idle_changed(idle_since: dict[str, float]) -> None:
            nonlocal idle_pods
            idle_pods = idle_pods_annotation(idle_since)
            if publisher is not None:
                publisher.update(publication())

        def hardware_changed(uuid: str, ok: bool) -> None:
            self._gpu_metric(inventory, uuid, int(ok))
            if publisher is not None:  # the scheduler stops placing pods on a failed GPU
                publisher.update(publication())

        def identity_changed(ok: bool) -> None:
            nonlocal pod_identity
            pod_identity = ok
            if publisher is not None:
                publisher.update(publication())

        board = DeviceBoard(resources, pool_known=not memory, on_hardware=hardware_changed)
        self.board = board
        for gpu in inventory.gpus:
            self.metrics.gpu_healthy.labels(uuid=gpu.uuid, index=str(gpu.index)).set(1)

        book = refresh = acks = kubelet = None
        if api is not None:
            from gpupool_deviceplugin.kube.acks import AckWriter
            from gpupool_deviceplugin.kube.node_publisher import NodePublisher
            from gpupool_deviceplugin.kube.pod_watch import PodWatcher

            unit = self.config.gpu_memory.unit_mib if memory else None
            book = admission = AdmissionBook(self.opts.node_name, resources, unit,
                                             on_change=lambda: self._tenancy_changed(admission, board))
            watcher = PodWatcher(api, self.opts.node_name, [r.name for r in resources], book,
                                 metrics=self.metrics)
            watcher.start()
            self._parts.append(watcher)
            refresh = watcher.relist_now
            acks = AckWriter(api, self.metrics, alive=book.has)
            acks.start()
            self._parts.append(acks)
            if not watcher.synced.wait(10):
                log.warning("pods of node %s not listed yet; whole GPUs and memory units stay Unhealthy until "
                            "they are", self.opts.node_name)
            kubelet = self._start_reconciler(book, acks, resources, identity_changed)
            if self.config.kubernetes.publish_node:  # after the first reconciliation: pod_identity is known
                publisher = NodePublisher(api, self.opts.node_name, publication(), self.metrics,
                                          self.config.kubernetes.node_refresh_s)
                publisher.start()
                self._parts.append(publisher)
        self.book = book
        self.idle_sampler = self._start_idle_sampler(inventory, book, idle_changed)

        if self.config.health.enabled:
            monitor = HealthMonitor(self.session, inventory, board, self.config.health, self.metrics)
            monitor.start()
            monitor.ready.wait(5)
            self._parts.append(monitor)
        else:
            log.warning("health checks disabled by config: devices stay Healthy whatever NVML reports")

        allocator = Allocator(resources, inventory, self.config, self.metrics, book, refresh, acks, kubelet)
        removed = remove_stale_sockets(self.opts.kubelet_dir)
        if removed:
            log.info("removed stale sockets of a previous plugin: %s", ", ".join(removed))
        self.servers = PluginServers(resources, self.opts.kubelet_dir, board, allocator, self.metrics)
        self.servers.start()
        self._parts.append(self.servers)
        supervisor = Supervisor(self.servers, self.opts.kubelet_dir, self.metrics)
        supervisor.start()
        self._parts.append(supervisor)

    def _start_reconciler(self, book: AdmissionBook, acks: AckSink | None, resources: list[ResourceSpec],
                          on_availability: Callable[[bool], None]) -> Reconciler | None:
        """The kubelet's PodResources view: reconciled once now, before any resource is served (an admitted
        pod whose ack a previous instance never wrote must not look pending), then periodically."""
        from gpupool_deviceplugin.podresources import (
            PodResourcesClient,
            Reconciler,
            pod_resources_socket,
            reconcile_period_s,
        )

        socket = self.opts.pod_resources_socket or pod_resources_socket(self.opts.kubelet_dir)
        if socket is None:
            log.warning("PodResources disabled: same-shape pods are told apart by the order of their binds only")
            return None
        client = PodResourcesClient(socket, [r.name for r in resources])
        reconciler = Reconciler(book, client, acks, self.metrics, resources, reconcile_period_s(),
                                on_availability)
        reconciler.run_once()
        reconciler.start()
        self._parts.append(reconciler)
        return reconciler

    def _start_idle_sampler(self, inventory: NodeInventory, book: AdmissionBook | None,
                            on_idle_pods: Callable[[dict[str, float]], None]) -> IdleSampler | None:
        """Idleness per pod and GPU (docs/idle-and-elastic.md), on its own thread. Without the pod watch no
        pod is known: the GPUs' own activity is still measured."""
        idle = self.config.idle
        if idle.sample_interval_s <= 0:
            log.info("idle sampling off (idle.sampleIntervalSeconds 0)")
            return None
        policy = IdlePolicy(window_s=idle.window_s, threshold_pct=idle.threshold_percent,
                            memory_change_pct=idle.memory_change_percent, start_grace_s=idle.start_grace_s,
                            max_gap_s=3 * idle.sample_interval_s)
        proc_root = Path(idle.proc_root)
        sampler = IdleSampler(self.session, inventory, (lambda: tenants_from_book(book)) if book is not None else dict,
                              policy, idle.sample_interval_s, self.metrics,
                              uid_of_pid=lambda pid: pod_uid_of_pid(pid, proc_root),
                              on_idle_pods=on_idle_pods if self.config.kubernetes.publish_node else None,
                              publish_interval_s=idle.publish_interval_s)
        sampler.start()
        self._parts.append(sampler)
        return sampler

    def _tenancy_changed(self, book: AdmissionBook, board: DeviceBoard) -> None:
        # read and apply under one lock: the watch thread and gRPC threads both get here, and an older
        # tenancy must never overwrite a newer one
        with self._tenancy_lock:
            tenancy = book.tenancy()
            board.set_tenancy(tenancy, known=book.synced)
        for gpu_uuid in {d.gpu_uuid for spec in board.resources.values() for d in spec.devices}:
            mode = "whole" if tenancy.whole.get(gpu_uuid) else "shared" if tenancy.shared.get(gpu_uuid) else "idle"
            for m in ("whole", "shared", "idle"):
                self.metrics.gpu_mode.labels(uuid=gpu_uuid, mode=m).set(1 if m == mode else 0)

    def _gpu_metric(self, inventory: NodeInventory, uuid: str, value: int) -> None:
        gpu = inventory.gpu_by_uuid(uuid)
        if gpu is not None:
            self.metrics.gpu_healthy.labels(uuid=gpu.uuid, index=str(gpu.index)).set(value)

