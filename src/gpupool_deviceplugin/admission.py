"""Which pod and container a kubelet request belongs to, and who holds each GPU whole or shared.

The kubelet's GetPreferredAllocation and Allocate carry no pod identity. `AdmissionBook` keeps the pods
bound to this node (from the pod watch), their scheduler assignments (handshake.py) and the allocations
made so far, and answers:
  preferred()  the devices the scheduler chose for the container the kubelet is admitting now;
  claim()      the one container a set of allocated device IDs belongs to, checked against the node;
  commit()     record it and return the ack to write on the pod;
  tenancy()    per GPU, the pods holding it whole and the pods sharing it (drives device health).

No I/O here; the caller feeds pod records and writes acks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from gpupool_deviceplugin.handshake import ASSIGNMENT_ANNOTATION, AllocationAck, MemoryShare
from gpupool_deviceplugin.pods import ContainerSpec, PodRecord
from gpupool_deviceplugin.resources import ResourceSpec, split_memory_unit_id


class Refusal(Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"        # the request itself is wrong (unknown IDs, ...)
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the request contradicts the node's state


class AdmissionError(Exception):
    def __init__(self, code: Refusal, message: str, reason: str, pod: PodRecord | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # short label for metrics
        self.pod = pod        # the pod the refused devices were meant for, when known


Want = tuple[str, ...] | MemoryShare | int  # exact IDs / a memory share / a device count (no assignment)


@dataclass(frozen=True)
class Claim:
    """Devices attributed to one container of one pod (or to nobody we know of)."""

    resource: str
    ids: tuple[str, ...]
    via: Literal["assignment", "foreign", "unattributed"]
    pod: PodRecord | None = None
    container: str | None = None
    ambiguous_with: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tenancy:
    """Per GPU UUID, the live pods (namespace/name) holding it whole and sharing it."""

    whole: dict[str, tuple[str, ...]] = field(default_factory=dict)
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class _Candidate:
    pod: PodRecord
    container: ContainerSpec
    want: Want
    answer: tuple[str, ...]


class AdmissionBook:
    def __init__(self, node: str, resources: Sequence[ResourceSpec], unit_mib: int | None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.node = node
        self.unit_mib = unit_mib
        self._resources = {r.name: r for r in resources}
        self._devices = {r.name: r.by_id() for r in resources}
        self._lock = threading.RLock()
        self._pods: dict[str, PodRecord] = {}
        # pod uid -> container -> resource -> device IDs the kubelet allocated
        self._alloc: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {}
        self._on_change = on_change
        self.synced = False

    # -- feeding -------------------------------------------------------------------------------
    def replace_all(self, records: Iterable[PodRecord]) -> None:
        with self._lock:
            fresh = {r.uid: r for r in records if r.node == self.node}
            for uid in list(self._alloc):
                if uid not in fresh or fresh[uid].terminal:
                    del self._alloc[uid]
            self._pods = {}
            for record in fresh.values():
                self._store(record)
            self.synced = True
        self._changed()

    def upsert(self, record: PodRecord) -> None:
        with self._lock:
            old = self._pods.get(record.uid)
            if old is not None and _older(record.resource_version, old.resource_version):
                return
            if record.node != self.node:
                self._drop(record.uid)
            else:
                self._store(record)
        self._changed()

    def remove(self, uid: str) -> None:
        with self._lock:
            self._drop(uid)
        self._changed()

    def _store(self, record: PodRecord) -> None:
        self._pods[record.uid] = record
        if record.terminal:
            self._alloc.pop(record.uid, None)
            return
        ack = record.ack
        if ack is not None and ack.pod_uid == record.uid and ack.node == self.node:
            mine = self._alloc.setdefault(record.uid, {})
            for container, by_resource in ack.containers.items():
                for resource, ids in by_resource.items():
                    mine.setdefault(container, {}).setdefault(resource, tuple(ids))

    def _drop(self, uid: str) -> None:
        self._pods.pop(uid, None)
        self._alloc.pop(uid, None)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def pods(self) -> list[PodRecord]:
        with self._lock:
            return list(self._pods.values())

    # -- GetPreferredAllocation ----------------------------------------------------------------
    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Claim | None:
        """The assigned devices of the container being admitted, or None when no assignment fits."""
        spec = self._resources[resource]
        avail = set(available) | set(must_include)
        must = set(must_include)
        with self._lock:
            cands = []
            for pod, container, want in self._pending(resource, assigned=True):
                answer = self._fit_preferred(spec, want, avail, must, size)
                if answer is not None:
                    cands.append(_Candidate(pod, container, want, answer))
            if not cands:
                return None
            best = self._pick(cands)
        others = tuple(sorted({c.pod.key for c in cands if c.pod.uid != best.pod.uid and c.answer != best.answer}))
        return Claim(resource, best.answer, "assignment", best.pod, best.container.name, others)

    def _fit_preferred(self, spec: ResourceSpec, want: Want, avail: set[str], must: set[str],
                       size: int) -> tuple[str, ...] | None:
        if isinstance(want, MemoryShare):
            if want.units != size:
                return None
            units = sorted((u for u in avail if u.startswith(want.gpu + "::")), key=_unit_number)
            if not must.issubset(units) or len(units) < size:
                return None
            rest = [u for u in units if u not in must]
            return tuple(sorted(must, key=_unit_number)) + tuple(rest[: size - len(must)])
        if isinstance(want, tuple):
            if len(want) != size or not set(want).issubset(avail) or not must.issubset(want):
                return None
            return want
        return None

    # -- Allocate ------------------------------------------------------------------------------
    def claim(self, resource: str, ids: Sequence[str]) -> Claim:
        """Attribute allocated IDs to exactly one pending container, or raise AdmissionError."""
        spec = self._resources.get(resource)
        if spec is None:
            raise AdmissionError(Refusal.INVALID_ARGUMENT, f"this plugin does not serve {resource}", "unknown_resource")
        known = self._devices[resource]
        unknown = [i for i in ids if i not in known]
        if unknown or not ids:
            raise AdmissionError(Refusal.INVALID_ARGUMENT,
                                 f"unknown {resource} device IDs {unknown or '(none given)'} on node {self.node}",
                                 "unknown_device")
        idset = tuple(ids)
        gpus = sorted({known[i].gpu_uuid for i in ids})
        if spec.kind == "memory" and len(gpus) != 1:
            raise AdmissionError(Refusal.INVALID_ARGUMENT,
                                 f"{resource} units {list(ids)} span GPUs {gpus}; a share lives on one GPU",
                                 "units_span_gpus")
        with self._lock:
            claim = self._claim_locked(spec, idset, gpus)
            self._check_state(spec, claim, gpus)
            return claim

    def _claim_locked(self, spec: ResourceSpec, ids: tuple[str, ...], gpus: list[str]) -> Claim:
        resource = spec.name
        cands = []
        for pod, container, want in self._pending(resource, assigned=True):
            if self._fit_allocation(spec, pod, want, ids, gpus):
                cands.append(_Candidate(pod, container, want, ids))
        if not cands:  # a container whose turn we missed (plugin restarted mid-pod): exact IDs only
            for pod, container, want in self._pending(resource, assigned=True, any_turn=True):
                if isinstance(want, tuple) and set(want) == set(ids):
                    cands.append(_Candidate(pod, container, want, ids))
        if cands:
            best = self._pick(cands)
            others = tuple(sorted({c.pod.key for c in cands if c.pod.uid != best.pod.uid}))
            return Claim(resource, ids, "assignment", best.pod, best.container.name, others)

        broken = [p for p in self._live() if p.assignment_error and p.requests(resource)]
        if broken:
            oldest = min(broken, key=lambda p: (p.created, p.uid))
            raise AdmissionError(Refusal.FAILED_PRECONDITION,
                                 f"pod {oldest.key} has an unusable {ASSIGNMENT_ANNOTATION}: {oldest.assignment_error}",
                                 "bad_assignment", oldest)
        if spec.kind == "memory":
            pending = [f"{p.key}/{c.name}: {w.units} units on {w.gpu}" for p, c, w in
                       self._pending(resource, assigned=True, any_turn=True) if isinstance(w, MemoryShare)]
            raise AdmissionError(
                Refusal.FAILED_PRECONDITION,
                f"no pending gpupool assignment on node {self.node} matches {len(ids)} {resource} units on "
                f"{gpus[0]} (pending: {pending or 'none'}); {resource} is only allocatable to pods scheduled "
                "by gpupool", "no_assignment")
        foreign = [(p, c, w) for p, c, w in self._pending(resource, assigned=False) if w == len(ids)]
        if foreign:
            cands = [_Candidate(p, c, w, ids) for p, c, w in foreign]
            best = self._pick(cands)
            return Claim(resource, ids, "foreign", best.pod, best.container.name)
        return Claim(resource, ids, "unattributed")

    def _fit_allocation(self, spec: ResourceSpec, pod: PodRecord, want: Want, ids: tuple[str, ...],
                        gpus: list[str]) -> bool:
        if isinstance(want, MemoryShare):
            return gpus == [want.gpu] and len(ids) == want.units
        if isinstance(want, tuple):
            if set(ids) == set(want):
                return True
            # the kubelet reuses devices of finished init containers first (devicemanager)
            reusable = self._reusable(pod, spec.name)
            return len(ids) == len(want) and set(ids) <= set(want) | reusable and bool(set(ids) & reusable)
        return False

    def _check_state(self, spec: ResourceSpec, claim: Claim, gpus: list[str]) -> None:
        """Refuse an allocation that contradicts the whole/shared state of the GPUs."""
        me = claim.pod.uid if claim.pod else None
        tenancy = self._tenancy_locked(exclude=me)
        if spec.kind == "gpu":
            for gpu in gpus:
                if tenancy.shared.get(gpu):
                    raise AdmissionError(
                        Refusal.FAILED_PRECONDITION,
                        f"GPU {gpu} cannot be allocated whole: it has shared tenants {list(tenancy.shared[gpu])}",
                        "gpu_is_shared", claim.pod)
        elif spec.kind == "memory":
            gpu = gpus[0]
            if tenancy.whole.get(gpu):
                raise AdmissionError(
                    Refusal.FAILED_PRECONDITION,
                    f"GPU {gpu} is held whole by {list(tenancy.whole[gpu])}; its memory cannot be shared",
                    "gpu_is_whole", claim.pod)
            if claim.pod is not None and claim.pod.assignment is not None:
                want = self._want(claim.pod, self._container(claim.pod, claim.container), spec.name)
                if isinstance(want, MemoryShare) and self.unit_mib and want.unit_mib != self.unit_mib:
                    raise AdmissionError(
                        Refusal.FAILED_PRECONDITION,
                        f"pod {claim.pod.key}: the scheduler assumed {want.unit_mib} MiB per {spec.name} unit, "
                        f"this node's plugin uses {self.unit_mib} MiB", "unit_size_mismatch", claim.pod)

    def commit(self, claim: Claim) -> AllocationAck | None:
        """Record an allocation; returns the ack to write on the pod (None when unattributed)."""
        if claim.pod is None or claim.container is None:
            return None
        with self._lock:
            pod = self._pods.get(claim.pod.uid, claim.pod)
            self._alloc.setdefault(pod.uid, {}).setdefault(claim.container, {})[claim.resource] = claim.ids
            ack = self._ack_locked(pod)
        self._changed()
        return ack

    def failure_ack(self, claim_pod: PodRecord, message: str) -> AllocationAck:
        with self._lock:
            return self._ack_locked(claim_pod).model_copy(update={"error": message})

    def _ack_locked(self, pod: PodRecord) -> AllocationAck:
        done = self._alloc.get(pod.uid, {})
        complete = all(resource in done.get(c.name, {})
                       for c in pod.containers for resource in self._wanted_resources(pod, c))
        return AllocationAck(node=self.node, pod_uid=pod.uid,
                             containers={c: dict(r) for c, r in done.items()}, complete=complete)

    # -- tenancy ---------------------------------------------------------------------------------
    def tenancy(self) -> Tenancy:
        with self._lock:
            return self._tenancy_locked()

    def _tenancy_locked(self, exclude: str | None = None) -> Tenancy:
        whole: dict[str, set[str]] = {}
        shared: dict[str, set[str]] = {}
        for pod in self._live():
            if pod.uid == exclude:
                continue
            held: list[tuple[str, str]] = []  # (resource, device id)
            if pod.assignment is not None:
                for ca in pod.assignment.containers:
                    if ca.memory is not None:
                        shared.setdefault(ca.memory.gpu, set()).add(pod.key)
                    held += [(r, i) for r, ids in ca.devices.items() for i in ids]
            for by_resource in self._alloc.get(pod.uid, {}).values():
                held += [(r, i) for r, ids in by_resource.items() for i in ids]
            for resource, device_id in held:
                spec = self._resources.get(resource)
                if spec is None:
                    continue
                if spec.kind == "memory":
                    unit = split_memory_unit_id(device_id)
                    if unit:
                        shared.setdefault(unit[0], set()).add(pod.key)
                elif spec.kind == "gpu" and device_id in self._devices[resource]:
                    whole.setdefault(self._devices[resource][device_id].gpu_uuid, set()).add(pod.key)
        return Tenancy({g: tuple(sorted(p)) for g, p in whole.items()},
                       {g: tuple(sorted(p)) for g, p in shared.items()})

    # -- helpers ---------------------------------------------------------------------------------
    def _live(self) -> list[PodRecord]:
        return [p for p in self._pods.values() if not p.terminal]

    def _container(self, pod: PodRecord, name: str | None) -> ContainerSpec:
        return next(c for c in pod.containers if c.name == name)

    def _want(self, pod: PodRecord, container: ContainerSpec, resource: str) -> Want | None:
        if pod.assignment is None:
            n = container.requests.get(resource, 0)
            return n if n > 0 else None
        ca = pod.assignment.container(container.name)
        if ca is None:
            return None
        if self._resources[resource].kind == "memory":
            return ca.memory
        ids = ca.devices.get(resource)
        return tuple(ids) if ids else None

    def _wanted_resources(self, pod: PodRecord, container: ContainerSpec) -> list[str]:
        return [r for r in self._resources if self._want(pod, container, r) is not None]

    def _pending(self, resource: str, *, assigned: bool, any_turn: bool = False):
        """(pod, container, want) of live pods; by default only each pod's next container for `resource`."""
        for pod in self._live():
            if (pod.assignment is not None) != assigned or (not assigned and pod.assignment_error):
                continue
            done = self._alloc.get(pod.uid, {})
            for container in pod.containers:
                want = self._want(pod, container, resource)
                if want is None:
                    continue
                if resource in done.get(container.name, {}):
                    continue
                yield pod, container, want
                if not any_turn:
                    break

    def _reusable(self, pod: PodRecord, resource: str) -> set[str]:
        done = self._alloc.get(pod.uid, {})
        return {i for c in pod.containers if c.init and not c.sidecar
                for i in done.get(c.name, {}).get(resource, ())}

    def _pick(self, cands: list[_Candidate]) -> _Candidate:
        """The pod being admitted: one the kubelet already started on, else the oldest (kubelet order)."""
        def in_progress(pod: PodRecord) -> bool:
            done = self._alloc.get(pod.uid)
            return bool(done) and not self._ack_locked(pod).complete

        return min(cands, key=lambda c: (not in_progress(c.pod), c.pod.created, c.pod.name, c.pod.uid))


def _unit_number(device_id: str) -> int:
    unit = split_memory_unit_id(device_id)
    return unit[1] if unit else -1


def _older(a: str, b: str) -> bool:
    """resourceVersion a is older than b (etcd revisions are integers; otherwise never older)."""
    try:
        return int(a) < int(b)
    except ValueError:
        return False

