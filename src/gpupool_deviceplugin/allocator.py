"""GetPreferredAllocation and Allocate, resource by resource: the handshake when there is one,
topology otherwise, and the checks that keep the whole/shared pool truthful.

When several pending pods could be behind a call (same request shape), the kubelet's pod list
(PodResources) says which one it is admitting. When no pod the plugin knows explains a call, the pods are
re-listed at once (the kubelet may have seen a bind before the pod watch did), but only when that can
help: never for a call that a known pod of another scheduler explains, and with PodResources only when the
kubelet has a pod the watch has not shown yet. Either way the call is matched again whenever the pods have
changed since the miss (the watch may deliver the pod while the kubelet's pod list is being asked).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from gpupool_common.gpu_sets import best_gpu_set
from gpupool_common.handshake import AllocationAck
from gpupool_common.inventory import NodeInventory
from gpupool_deviceplugin.admission import AdmissionBook, AdmissionError, Claim, KubeletPod, Refusal
from gpupool_deviceplugin.api.v1beta1 import api_pb2
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import PodRecord
from gpupool_deviceplugin.resources import ResourceSpec, split_memory_unit_id
from gpupool_deviceplugin.responses import container_response

log = logging.getLogger(__name__)


class AckSink(Protocol):
    def submit(self, pod: PodRecord, ack: AllocationAck) -> None: ...


class KubeletPods(Protocol):
    def pods(self, purpose: str) -> list[KubeletPod] | None:
        """The kubelet's pods (PodResources List), reconciled into the book; None when unavailable."""
        ...


class Allocator:
    def __init__(self, resources: Sequence[ResourceSpec], inventory: NodeInventory, config: PluginConfig,
                 metrics: PluginMetrics, book: AdmissionBook | None = None,
                 refresh: Callable[[], bool] | None = None, acks: AckSink | None = None,
                 kubelet: KubeletPods | None = None) -> None:
        self.resources = {r.name: r for r in resources}
        self._by_id = {r.name: r.by_id() for r in resources}
        self.topology = inventory.topology()
        self.config = config
        self.metrics = metrics
        self.book = book
        self.refresh = refresh  # re-list pods now; True if that worked
        self.acks = acks
        self.kubelet = kubelet

    # -- GetPreferredAllocation ----------------------------------------------------------------
    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> list[str]:
        spec = self.resources[resource]
        if self.book is not None:
            claim = self._preferred_claim(resource, available, must_include, size)
            if claim is not None:
                if claim.ambiguous_with:
                    self.metrics.handshake_ambiguous.labels(resource=resource, call="preferred").inc()
                    log.warning("%s preferred allocation of size %d fits %s and %s; chose %s (in progress, else "
                                "first bound). The scheduler should not bind same-shape pods before the first is "
                                "acknowledged", resource, size, claim.pod_key, list(claim.ambiguous_with),
                                claim.pod_key)
                self.metrics.preferred.labels(resource=resource, source="assignment").inc()
                return list(claim.ids)
        self.metrics.preferred.labels(resource=resource, source="topology").inc()
        return self._fallback(spec, available, must_include, size)

    def _preferred_claim(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                         size: int) -> Claim | None:
        assert self.book is not None
        seen = self.book.generation
        view = self._kubelet_view(resource, size, "preferred")
        claim = self.book.preferred(resource, available, must_include, size, kubelet=view)
        if claim is None and self._caught_up(resource, size, view, "preferred", seen):
            view = self._kubelet_view(resource, size, "preferred")
            claim = self.book.preferred(resource, available, must_include, size, kubelet=view)
        return claim

    def _fallback(self, spec: ResourceSpec, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> list[str]:
        devices = self._by_id[spec.name]
        avail = [i for i in dict.fromkeys([*must_include, *available]) if i in devices]
        if self.book is not None:  # keep pods without an assignment off devices assigned to pending pods,
            # and off GPUs in the other use (shared for whole GPUs, held whole for memory units) in case
            # the kubelet's ListAndWatch view is behind: Allocate would refuse them (gpu_is_shared/_whole)
            tenancy = self.book.tenancy()
            busy = tenancy.shared if spec.kind == "gpu" else tenancy.whole if spec.kind == "memory" else {}
            in_use = {i for i in avail if devices[i].gpu_uuid in busy}
            reserved = (self.book.reserved(spec.name) | in_use) - set(must_include)
            unreserved = [i for i in avail if i not in reserved]
            if len(unreserved) >= size:
                avail = unreserved
        if size >= len(avail):
            return avail
        if spec.kind == "gpu":
            index_to_id = {devices[i].gpu_index: i for i in avail}
            chosen = best_gpu_set(self.topology, list(index_to_id), size,
                                  [devices[i].gpu_index for i in must_include if i in devices])
            return [index_to_id[g] for g in chosen]
        if spec.kind == "memory":
            return _best_fit_units(avail, list(must_include), size)
        # MIG devices: stay on the GPUs already chosen, then the lowest GPU index
        must_gpus = {devices[i].gpu_index for i in must_include if i in devices}
        rest = sorted((i for i in avail if i not in must_include),
                      key=lambda i: (devices[i].gpu_index not in must_gpus, devices[i].gpu_index, i))
        return list(must_include) + rest[: size - len(must_include)]

    # -- Allocate ------------------------------------------------------------------------------
    def allocate(self, resource: str, ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        spec = self.resources.get(resource)
        if spec is None:
            raise AdmissionError(Refusal.INVALID_ARGUMENT, f"this plugin does not serve {resource}", "unknown_resource")
        try:
            claim = self._claim(spec, ids)
        except AdmissionError as err:
            self.metrics.allocations.labels(resource=resource, via="none", result="refused").inc()
            self.metrics.handshake_failures.labels(resource=resource, reason=err.reason).inc()
            log.error("Allocate %s %s refused: %s", resource, list(ids), err)
            if err.pod is not None and self.book is not None and self.acks is not None:
                self.acks.submit(err.pod, self.book.failure_ack(err.pod, str(err)))
            raise
        if claim.ambiguous_with:
            self.metrics.handshake_ambiguous.labels(resource=resource, call="allocate").inc()
            log.warning("Allocate %s matched %s and %s; chose %s", resource, claim.pod_key,
                        list(claim.ambiguous_with), claim.pod_key)
        if claim.displaced:
            log.warning("Allocate %s %s: the kubelet gave pod %s (no assignment) devices assigned to pending pod(s) "
                        "%s; their assignment can no longer be followed", resource, list(ids), claim.pod_key,
                        list(claim.displaced))
        if claim.via == "unattributed" and self.book is not None:
            self.metrics.handshake_failures.labels(resource=resource, reason="unattributed").inc()
            log.warning("Allocate %s %s matches no pod bound to this node; allowed, but the pool cannot "
                        "tell when these devices are freed", resource, list(ids))
        if self.book is not None:
            ack = self.book.commit(claim)
            if ack is not None and self.acks is not None and claim.pod is not None:
                self.acks.submit(claim.pod, ack)
        self.metrics.allocations.labels(resource=resource, via=claim.via, result="ok").inc()
        if claim.pod is not None:
            log.info("allocated %s %s to %s container %s (%s%s)", resource, list(ids), claim.pod.key,
                     claim.container, claim.via, ", told by the kubelet's pod list" if claim.identified else "")
        devices = [self._by_id[resource][i] for i in ids]
        return container_response(spec, devices, self.config)

    def _claim(self, spec: ResourceSpec, ids: Sequence[str]) -> Claim:
        if self.book is None:
            unknown = [i for i in ids if i not in self._by_id[spec.name]]
            if unknown or not ids:
                raise AdmissionError(Refusal.INVALID_ARGUMENT,
                                     f"unknown {spec.name} device IDs {unknown or '(none given)'}", "unknown_device")
            return Claim(spec.name, tuple(ids), "unattributed")
        seen = self.book.generation
        view = self._kubelet_view(spec.name, len(ids), "allocate")
        try:
            claim = self.book.claim(spec.name, ids, kubelet=view)
        except AdmissionError as err:
            if err.reason not in ("no_assignment", "bad_assignment") or \
                    not self._caught_up(spec.name, len(ids), view, "allocate", seen):
                raise
            return self.book.claim(spec.name, ids, kubelet=self._kubelet_view(spec.name, len(ids), "allocate"))
        if claim.via == "unattributed" and self._caught_up(spec.name, len(ids), view, "allocate", seen):
            view = self._kubelet_view(spec.name, len(ids), "allocate")
            claim = self.book.claim(spec.name, ids, kubelet=view)
        if claim.via == "unattributed" and view is None:
            # nobody's assignment: if the kubelet says it is admitting a pod of ours, that pod deviated
            view = self._kubelet_view(spec.name, len(ids), "allocate", force=True)
            if view is not None:
                claim = self.book.claim(spec.name, ids, kubelet=view)
        return claim

    # -- the kubelet's pods, re-lists --------------------------------------------------------------
    def _kubelet_view(self, resource: str, size: int, purpose: str, *, force: bool = False) -> frozenset[str] | None:
        """namespace/name of the kubelet's pods, asked only when it matters: several pending pods have this
        request shape (or `force`). None without PodResources."""
        if self.kubelet is None or self.book is None or not (force or self.book.contended(resource, size)):
            return None
        pods = self.kubelet.pods(purpose)
        return None if pods is None else frozenset(p.key for p in pods)

    def _caught_up(self, resource: str, size: int, view: frozenset[str] | None, purpose: str, seen: int) -> bool:
        """After a call that no pod explained (the book at generation `seen`): re-list the node's pods when
        that can help. True when the book has changed since: re-listed, or the pod watch delivered the pod
        meanwhile (while the kubelet's pod list was asked, say), so the call is worth matching again; a
        fallback answer now could steer the kubelet off the very pod's assignment."""
        if self.book is None:
            return False
        if self.refresh is not None and not self.book.explains(resource, size):
            # (explains: a known pod of another scheduler asks for this shape, the call is its own)
            if view is None:
                view = self._kubelet_view(resource, size, purpose, force=True)
            if view is None or self.book.unknown(view):  # else a re-list would find nothing new
                self.refresh()
        return self.book.generation != seen


def _best_fit_units(avail: list[str], must: list[str], size: int) -> list[str]:
    """Units of the one GPU with the fewest free units that still fit (must_include's GPU if given)."""
    by_gpu: dict[str, list[str]] = {}
    for i in avail:
        unit = split_memory_unit_id(i)
        if unit:
            by_gpu.setdefault(unit[0], []).append(i)
    if must:
        unit = split_memory_unit_id(must[0])
        gpus = [unit[0]] if unit else []
    else:
        fits = [g for g, units in by_gpu.items() if len(units) >= size]
        gpus = sorted(fits, key=lambda g: (len(by_gpu[g]), g))[:1]
    if not gpus:
        return avail[:size]
    units = sorted(by_gpu.get(gpus[0], []), key=lambda i: split_memory_unit_id(i)[1])  # type: ignore[index]
    chosen = list(must) + [u for u in units if u not in must]
    return chosen[:size]
