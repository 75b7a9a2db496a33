"""What the kubelet says running containers hold: its PodResources API (v1 `List`,
`GetAllocatableResources` on <kubelet root>/pod-resources/kubelet.sock), and the reconciler that makes
the plugin's allocation records (AdmissionBook) agree with it, at start-up and periodically.

Allocate tells the plugin when devices are taken, never by whom for sure nor when they are freed; the
kubelet's own records are the truth. The same List also tells which pod the kubelet is admitting (the
pod it has but whose containers wait for devices), which the allocator asks for when several pending
pods have the same request shape.

After each Allocate the reconciler checks the kubelet's records within a bound: it lists them every
CHECK_INTERVAL_S while an allocation is not yet shown there, for CHECK_WINDOW_S after that Allocate. So an
ack written from a guess (several same-shape pods pending while PodResources did not answer, and the
kubelet admitting them in another order than the plugin assumed) is corrected by the first List that
answers after the kubelet recorded the allocation; past the window, by the periodic reconciliation.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import grpc

from gpupool_deviceplugin.admission import AdmissionBook, KubeletPod, Reconciliation
from gpupool_deviceplugin.allocator import AckSink
from gpupool_deviceplugin.api.podresources.v1 import api_pb2, api_pb2_grpc
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.resources import ResourceSpec

log = logging.getLogger(__name__)
SOCKET_ENV = "GPUPOOL_POD_RESOURCES_SOCKET"  # a path, or "" to not use the API
PERIOD_ENV = "GPUPOOL_RECONCILE_PERIOD_S"
DEFAULT_PERIOD_S = 30.0
CHECK_INTERVAL_S = 0.1  # the kubelet's List after an Allocate, every 100 ms (10/s; its rate limit is 100/s)...
CHECK_WINDOW_S = 10.0   # ...until the kubelet's records show the allocation, for at most 10 s after it


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources socket is absent or does not answer."""


def pod_resources_socket(kubelet_dir: Path) -> Path | None:
    """The PodResources socket: $GPUPOOL_POD_RESOURCES_SOCKET, else pod-resources/kubelet.sock beside the
    device-plugin directory (/var/lib/kubelet/device-plugins -> /var/lib/kubelet/pod-resources)."""
    env = os.environ.get(SOCKET_ENV)
    if env is not None:
        return Path(env) if env else None
    return kubelet_dir.parent / "pod-resources" / "kubelet.sock"


def reconcile_period_s() -> float:
    try:
        value = float(os.environ.get(PERIOD_ENV, DEFAULT_PERIOD_S))
    except ValueError:
        value = DEFAULT_PERIOD_S
    return value if value > 0 else DEFAULT_PERIOD_S


class PodResourcesClient:
    """A v1 PodResourcesLister client, limited to the resources this plugin serves."""

    def __init__(self, socket: Path, resources: Collection[str], timeout_s: float = 1.0) -> None:
        self.socket = socket
        self.resources = frozenset(resources)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def list(self) -> list[KubeletPod]:
        resp = self._call(self._stub.List, api_pb2.ListPodResourcesRequest())
        return [KubeletPod(p.namespace, p.name, {c.name: self._devices(c.devices) for c in p.containers})
                for p in resp.pod_resources]

    def allocatable(self) -> dict[str, frozenset[str]]:
        """Per resource of ours, the device IDs the kubelet can hand out (healthy devices it knows)."""
        resp = self._call(self._stub.GetAllocatableResources, api_pb2.AllocatableResourcesRequest())
        return {r: frozenset(ids) for r, ids in self._devices(resp.devices).items()}

    def _devices(self, devices: Sequence[api_pb2.ContainerDevices]) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for d in devices:
            if d.resource_name in self.resources:
                out.setdefault(d.resource_name, []).extend(d.device_ids)
        return {r: tuple(ids) for r, ids in out.items()}

    def _call(self, method, request):
        if not self.socket.exists():
            raise PodResourcesUnavailable(f"{self.socket} does not exist")
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise PodResourcesUnavailable(f"{self.socket}: {exc.code().name}: {exc.details()}") from None


class Reconciler:
    """Keeps the AdmissionBook equal to the kubelet's records: once before the plugin serves (an ack lost
    in a restart must not leave an admitted pod looking pending), then every `period_s`, and whenever the
    allocator lists the kubelet's pods anyway. Each correction is logged, counted
    (`_reconcile_corrections_total{kind}`) and its corrected ack written."""

    def __init__(self, book: AdmissionBook, client: PodResourcesClient, acks: AckSink | None,
                 metrics: PluginMetrics, resources: Sequence[ResourceSpec], period_s: float,
                 on_availability: Callable[[bool], None] | None = None, *,
                 check_interval_s: float = CHECK_INTERVAL_S, check_window_s: float = CHECK_WINDOW_S) -> None:
        self.book = book
        self.client = client
        self.acks = acks
        self.metrics = metrics
        self.period_s = period_s
        self.check_interval_s = check_interval_s
        self.check_window_s = check_window_s
        self._served = {r.name: frozenset(r.by_id()) for r in resources}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)
        self._allocated = threading.Event()
        self._checker = threading.Thread(target=self._check_allocations, name="pod-resources-check", daemon=True)
        self._available: bool | None = None  # last state logged
        self.on_availability = on_availability  # called when the API starts or stops answering
        self._unknown_logged: set[tuple[str, frozenset[str]]] = set()

    def start(self) -> None:
        self.book.on_allocated(self._allocated.set)
        self._thread.start()
        self._checker.start()

    def stop(self) -> None:
        self.book.on_allocated(None)
        self._stop.set()
        self._allocated.set()
        self._thread.join(timeout=5)
        self._checker.join(timeout=5)
        self.client.close()

    def pods(self, purpose: str) -> list[KubeletPod] | None:
        """The kubelet's pods, already reconciled into the book; None when the API does not answer."""
        try:
            pods = self.client.list()
        except PodResourcesUnavailable as exc:
            self.metrics.pod_resources_calls.labels(purpose=purpose, result="unavailable").inc()
            self._note_availability(False, str(exc))
            return None
        self.metrics.pod_resources_calls.labels(purpose=purpose, result="ok").inc()
        self._note_availability(True, "")
        self.apply(self.book.reconcile(pods))
        return pods

    def run_once(self) -> bool:
        """One full reconciliation (List and GetAllocatableResources); False when the API is unavailable."""
        if self.pods("reconcile") is None:
            return False
        try:
            allocatable = self.client.allocatable()
        except PodResourcesUnavailable as exc:
            log.warning("PodResources GetAllocatableResources failed: %s", exc)
            return True
        self._check_allocatable(allocatable)
        return True

    def apply(self, result: Reconciliation) -> None:
        for key, after_s in result.confirmed:
            self.metrics.allocation_checks.labels(result="confirmed").inc()
            log.debug("PodResources: the kubelet's records show pod %s's allocations (%.3fs after Allocate)",
                      key, after_s)
        for c in result.corrections:
            self.metrics.reconcile_corrections.labels(kind=c.kind).inc()
            log.warning("PodResources: pod %s container %s holds %s %s per the kubelet, the plugin had %s "
                        "(%s); corrected", c.pod, c.container, c.resource, list(c.now) or "nothing",
                        list(c.was) or "nothing", c.kind)
        if result.unknown_pods:
            log.info("PodResources: the kubelet has pods the pod watch has not shown yet: %s",
                     ", ".join(result.unknown_pods))
        if self.acks is not None:
            for pod, ack in result.acks:
                self.acks.submit(pod, ack)

    def _check_allocatable(self, allocatable: Mapping[str, frozenset[str]]) -> None:
        """Device IDs the kubelet offers under our resource names that we do not serve come from an
        earlier registration (another node name, another MIG layout): they cannot be corrected from
        here, so they are logged once and counted."""
        for resource, ids in allocatable.items():
            stray = ids - self._served.get(resource, frozenset())
            if stray and (resource, stray) not in self._unknown_logged:
                self._unknown_logged.add((resource, stray))
                self.metrics.reconcile_corrections.labels(kind="unknown_device").inc()
                log.warning("PodResources: the kubelet offers %s devices this plugin does not serve: %s",
                            resource, sorted(stray)[:8])

    def _note_availability(self, ok: bool, why: str) -> None:
        if ok == self._available:
            return
        self._available = ok
        if self.on_availability is not None:
            self.on_availability(ok)
        if ok:
            log.info("PodResources API at %s answers: allocations are reconciled with the kubelet's records and "
                     "same-shape pods are told apart by the kubelet's pod list", self.client.socket)
        else:
            log.warning("PodResources API not available (%s): same-shape pods are told apart by the order of "
                        "their binds only, and allocations are not cross-checked (mount the kubelet's "
                        "pod-resources directory, see docs/deviceplugin.md)", why)

    def _check_allocations(self) -> None:
        """After each Allocate: list the kubelet's pods every `check_interval_s` while an allocation is not in
        its records yet (its Allocate may not have returned to the kubelet yet; PodResources may not answer),
        for at most `check_window_s` after that Allocate. Each List reconciles, which corrects the record and
        ack of a pod the kubelet allocated other devices than the plugin credited it with."""
        while not self._stop.is_set():
            self._allocated.wait()
            self._allocated.clear()
            while not self._stop.wait(self.check_interval_s):
                for what in self.book.expire_unconfirmed(self.check_window_s):
                    self.metrics.allocation_checks.labels(result="unconfirmed").inc()
                    log.warning("PodResources: the kubelet's records did not show %s within %.0fs of its Allocate; "
                                "left to the periodic reconciliation (every %.0fs)", what, self.check_window_s,
                                self.period_s)
                if not self.book.unconfirmed():
                    break
                try:
                    self.pods("check")
                except Exception as exc:  # never let the loop die
                    self.metrics.pod_resources_calls.labels(purpose="check", result="error").inc()
                    log.warning("PodResources check after Allocate failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.run_once()
            except Exception as exc:  # never let the loop die
                self.metrics.pod_resources_calls.labels(purpose="reconcile", result="error").inc()
                log.warning("PodResources reconciliation failed: %s", exc)
