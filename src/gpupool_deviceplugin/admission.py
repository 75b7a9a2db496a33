"""Which pod and container a kubelet request belongs to, and who holds each GPU whole or shared.

The kubelet's GetPreferredAllocation and Allocate carry no pod identity. `AdmissionBook` keeps the pods
bound to this node (from the pod watch), their scheduler assignments (handshake.py) and the allocations
made so far, and answers:
  preferred()  the devices the scheduler chose for the container the kubelet is admitting now;
  claim()      the one container a set of allocated device IDs belongs to, checked against the node;
  commit()     record it and return the ack to write on the pod;
  tenancy()    per GPU, the pods holding it whole and the pods sharing it (drives device health);
  reconcile()  correct the allocations from what the kubelet says running containers hold (PodResources);
  unconfirmed() the allocations committed that the kubelet's records have not shown yet (checked after
               each Allocate, within a window, so that an ack the kubelet contradicts is corrected soon).

Which pod a kubelet call is for (same-shape pods, see docs/handshake.md): the kubelet admits pods one at a
time in the order their binds reach it, so the pod watch's order of binds (resourceVersion) is the
kubelet's order; when the caller passes the kubelet's own pod list (PodResources List, which holds the pod
being admitted and not the ones still queued) the pod is known exactly instead.

No I/O here; the caller feeds pod records and kubelet pod lists and writes acks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from gpupool_common.handshake import ASSIGNMENT_ANNOTATION, AllocationAck, MemoryShare
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
    ambiguous_with: tuple[str, ...] = ()  # other pods that fitted as well (guessed by bind order)
    identified: bool = False              # the kubelet's pod list said which pod this is
    displaced: tuple[str, ...] = ()       # pods whose pending assignment these devices were (foreign claims)

    @property
    def pod_key(self) -> str:
        """namespace/name of the claiming pod, for logs ("" when unattributed)."""
        return self.pod.key if self.pod is not None else ""


@dataclass(frozen=True)
class Tenancy:
    """Per GPU UUID, the live pods (namespace/name) holding it whole and sharing it."""

    whole: dict[str, tuple[str, ...]] = field(default_factory=dict)
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KubeletPod:
    """One pod as the kubelet's PodResources List shows it: device IDs per container and resource.
    The kubelet names pods, it gives no UID; non-restartable init containers are not listed."""

    namespace: str
    name: str
    containers: Mapping[str, Mapping[str, tuple[str, ...]]]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


CorrectionKind = Literal["missing", "differs", "held_by_other"]


@dataclass(frozen=True, slots=True)
class Correction:
    """One allocation record changed to match the kubelet: `missing` (the kubelet shows devices the book
    did not have, e.g. an ack lost in a plugin restart), `differs` (other devices than recorded),
    `held_by_other` (the kubelet shows these devices in another pod's container)."""

    pod: str
    container: str
    resource: str
    kind: CorrectionKind
    was: tuple[str, ...]
    now: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reconciliation:
    corrections: tuple[Correction, ...] = ()
    acks: tuple[tuple[PodRecord, AllocationAck], ...] = ()  # corrected acks to write
    unknown_pods: tuple[str, ...] = ()  # kubelet pods holding our devices that the pod watch has not shown
    confirmed: tuple[tuple[str, float], ...] = ()  # (pod, seconds since its Allocate): now in the kubelet's records


@dataclass
class _Candidate:
    pod: PodRecord
    container: ContainerSpec
    want: Want
    answer: tuple[str, ...]


class AdmissionBook:
    def __init__(self, node: str, resources: Sequence[ResourceSpec], unit_mib: int | None,
                 on_change: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.unit_mib = unit_mib
        self._resources = {r.name: r for r in resources}
        self._devices = {r.name: r.by_id() for r in resources}
        self._lock = threading.RLock()
        self._pods: dict[str, PodRecord] = {}
        # pod uid -> container -> resource -> device IDs the kubelet allocated
        self._alloc: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {}
        # pod uid -> resourceVersion at which the pod was first seen bound here: the kubelet's admission order
        self._arrival: dict[str, int] = {}
        # pod uid -> (resourceVersion of its deletion, namespace/name): a stale list must not bring it back
        self._tombstones: dict[str, tuple[int, str]] = {}
        self._listed_rv: int | None = None  # resourceVersion of the newest full list applied
        self._refused: set[str] = set()  # pods whose Allocate was refused: the kubelet rejects them
        # pod uid -> (container, resource) -> when its Allocate was committed: not yet in the kubelet's
        # records (PodResources lists a container's devices once its Allocate returned)
        self._unconfirmed: dict[str, dict[tuple[str, str], float]] = {}
        self._clock = clock
        self._on_allocated: Callable[[], None] | None = None
        self._on_change = on_change
        self._generation = 0  # counts changes: a caller can tell whether the book moved since it looked
        self.synced = False

    # -- feeding -------------------------------------------------------------------------------
    def replace_all(self, records: Iterable[PodRecord], list_rv: str | None = None) -> bool:
        """Apply a full list of the node's pods. With the list's resourceVersion, the list is merged with
        what the watch delivered meanwhile: a pod seen at a newer version than the list (bound after the
        list's snapshot) is kept, a pod deleted after the snapshot stays deleted, and a list older than
        one already applied is ignored. False when the list was ignored as stale."""
        snapshot = _rv(list_rv) if list_rv is not None else None
        with self._lock:
            if snapshot is not None and self._listed_rv is not None and snapshot < self._listed_rv:
                return False
            fresh: dict[str, PodRecord] = {}
            for record in records:
                if record.node != self.node:
                    continue
                tomb = self._tombstones.get(record.uid)
                if snapshot is not None and tomb is not None and _rv(record.resource_version) <= tomb[0]:
                    continue
                old = self._pods.get(record.uid)
                fresh[record.uid] = old if old is not None and _older(record.resource_version,
                                                                      old.resource_version) else record
            if snapshot is not None:
                for uid, old in self._pods.items():
                    if uid not in fresh and _rv(old.resource_version) > snapshot:
                        fresh[uid] = old  # the watch saw it after the list's snapshot was taken
            for uid in list(self._alloc):
                if uid not in fresh or fresh[uid].terminal:
                    del self._alloc[uid]
            for uid in set(self._pods) - set(fresh):
                self._forget(uid)
            self._pods = {}
            for record in fresh.values():
                self._store(record)
            if snapshot is not None:
                self._listed_rv = snapshot
                self._tombstones = {u: t for u, t in self._tombstones.items() if t[0] > snapshot}
            self.synced = True
        self._changed()
        return True

    def upsert(self, record: PodRecord) -> None:
        with self._lock:
            old = self._pods.get(record.uid)
            if old is not None and _older(record.resource_version, old.resource_version):
                return
            tomb = self._tombstones.get(record.uid)
            if tomb is not None and _rv(record.resource_version) <= tomb[0]:
                return
            if record.node != self.node:
                self._drop(record.uid)
            else:
                self._store(record)
        self._changed()

    def remove(self, uid: str, resource_version: str | None = None) -> None:
        with self._lock:
            old = self._pods.get(uid)
            if old is not None:
                rv = max(_rv(resource_version) if resource_version else 0, _rv(old.resource_version))
                self._tombstones[uid] = (rv, old.key)
            self._drop(uid)
        self._changed()

    def has(self, uid: str) -> bool:
        """The pod is bound to this node and not deleted (the ack writer gives up on pods that are gone)."""
        with self._lock:
            return uid in self._pods

    def _store(self, record: PodRecord) -> None:
        self._pods[record.uid] = record
        self._arrival.setdefault(record.uid, _rv(record.resource_version))
        if record.terminal:
            self._alloc.pop(record.uid, None)
            return
        ack = record.ack
        # only restore from our own ack when we hold nothing for the pod (plugin restart): what we hold is
        # newer than the annotation, which may still carry a record the kubelet has since corrected
        if ack is not None and ack.pod_uid == record.uid and ack.node == self.node and record.uid not in self._alloc:
            mine = self._alloc.setdefault(record.uid, {})
            for container, by_resource in ack.containers.items():
                for resource, ids in by_resource.items():
                    if resource in self._resources:
                        mine.setdefault(container, {})[resource] = tuple(ids)

    def _drop(self, uid: str) -> None:
        self._pods.pop(uid, None)
        self._alloc.pop(uid, None)
        self._forget(uid)

    def _forget(self, uid: str) -> None:
        self._arrival.pop(uid, None)
        self._refused.discard(uid)
        self._unconfirmed.pop(uid, None)

    @property
    def generation(self) -> int:
        """Changes so far (pods fed, allocations committed or corrected): equal values, same book."""
        with self._lock:
            return self._generation

    def _changed(self) -> None:
        with self._lock:
            self._generation += 1
        if self._on_change is not None:
            self._on_change()

    def pods(self) -> list[PodRecord]:
        with self._lock:
            return list(self._pods.values())

    # -- which pod a call is for -----------------------------------------------------------------
    def contended(self, resource: str, size: int) -> bool:
        """Several pending pods (gpupool's or others') ask next for `size` devices of `resource`: the call
        alone cannot say which one the kubelet is admitting."""
        with self._lock:
            return len({p.uid for p, _, _ in self._contenders(resource, size)}) > 1

    def explains(self, resource: str, size: int) -> bool:
        """A pending pod without a usable assignment (another scheduler's, or a broken annotation) asks next
        for this shape: a call that no assignment matches is that pod's, and re-listing could not tell more."""
        with self._lock:
            for pod in self._live():
                if pod.assignment is not None:
                    continue
                done = self._alloc.get(pod.uid, {})
                following = next((c for c in pod.containers if c.requests.get(resource, 0) > 0
                                  and resource not in done.get(c.name, {})), None)
                if following is not None and following.requests[resource] == size:
                    return True
            return False

    def unknown(self, kubelet_pods: Collection[str]) -> list[str]:
        """Pods (namespace/name) the kubelet has that the pod watch has not shown yet."""
        with self._lock:
            known = {p.key for p in self._pods.values()} | {key for _, key in self._tombstones.values()}
            return sorted(k for k in kubelet_pods if k not in known)

    def reserved(self, resource: str) -> set[str]:
        """Device IDs that pending assignments name for containers not allocated yet: a pod without an
        assignment should not be steered onto them."""
        with self._lock:
            return {i for _, _, want in self._pending(resource, assigned=True, any_turn=True)
                    if isinstance(want, tuple) for i in want}

    def _contenders(self, resource: str, size: int) -> list[tuple[PodRecord, ContainerSpec, Want]]:
        return [(p, c, w) for assigned in (True, False)
                for p, c, w in self._pending(resource, assigned=assigned) if _size(w) == size]

    def _admitting(self, resource: str, size: int, kubelet: Collection[str]) -> PodRecord | None:
        """The contender the kubelet is admitting, from its pod list: the kubelet adds a pod to that list
        just before admitting it, so of the pods still pending only the one in admission is there (and
        pods it rejected, which we refused or which will turn Failed: the latest arrival wins)."""
        pods = {p.uid: p for p, _, _ in self._contenders(resource, size)}.values()
        known = [p for p in pods if p.key in kubelet and p.uid not in self._refused]
        started = [p for p in known if self._in_progress(p)]
        pool = started or known
        if not pool:
            return None
        return max(pool, key=lambda p: (self._arrival.get(p.uid, 0), p.created, p.uid))

    # -- GetPreferredAllocation ----------------------------------------------------------------
    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int, kubelet: Collection[str] | None = None) -> Claim | None:
        """The assigned devices of the container being admitted, or None when no assignment fits.
        `kubelet`: the pods the kubelet has (PodResources), when known; then only the pod it is
        admitting can get an answer, never another pending pod's devices."""
        spec = self._resources[resource]
        avail = set(available) | set(must_include)
        must = set(must_include)
        with self._lock:
            cands = []
            for pod, container, want in self._pending(resource, assigned=True):
                answer = self._fit_preferred(spec, want, avail, must, size)
                if answer is not None:
                    cands.append(_Candidate(pod, container, want, answer))
            if kubelet is not None:
                admitting = self._admitting(resource, size, kubelet)
                best = next((c for c in cands if admitting is not None and c.pod.uid == admitting.uid), None)
                if best is None:
                    return None
                return Claim(resource, best.answer, "assignment", best.pod, best.container.name, identified=True)
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
    def claim(self, resource: str, ids: Sequence[str], kubelet: Collection[str] | None = None) -> Claim:
        """Attribute allocated IDs to exactly one pending container, or raise AdmissionError.
        `kubelet`: the pods the kubelet has (PodResources), when known (see preferred())."""
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
            claim = self._claim_identified(spec, idset, gpus, kubelet) if kubelet is not None else None
            if claim is None:
                claim = self._claim_locked(spec, idset, gpus)
            self._check_state(spec, claim, gpus)
            return claim

    def _claim_identified(self, spec: ResourceSpec, ids: tuple[str, ...], gpus: list[str],
                          kubelet: Collection[str]) -> Claim | None:
        """The claim when the kubelet's pod list says which pod is being admitted; None to match as usual.
        Devices assigned to another pending pod are refused for it: the two would swap GPUs."""
        resource = spec.name
        pod = self._admitting(resource, len(ids), kubelet)
        if pod is None:
            return None
        fits = [(p, c) for p, c, w in self._pending(resource, assigned=True)
                if self._fit_allocation(spec, p, w, ids, gpus)]
        if pod.assignment is None:
            if spec.kind == "memory":
                return None  # refused as usual: memory units are for gpupool's pods only
            container = next(c for p, c, _ in self._contenders(resource, len(ids)) if p.uid == pod.uid)
            return Claim(resource, ids, "foreign", pod, container.name, identified=True,
                         displaced=tuple(sorted({p.key for p, _ in fits})))
        mine = [c for p, c in fits if p.uid == pod.uid] or [  # a turn missed across a plugin restart
            c for p, c, w in self._pending(resource, assigned=True, any_turn=True)
            if p.uid == pod.uid and isinstance(w, tuple) and set(w) == set(ids)]
        if mine:
            return Claim(resource, ids, "assignment", pod, mine[0].name, identified=True)
        owners = sorted({p.key for p, _ in fits})
        if owners:
            raise AdmissionError(
                Refusal.FAILED_PRECONDITION,
                f"the kubelet is admitting pod {pod.key} but allocated it {list(ids)}, which gpupool assigned to "
                f"pod {owners[0]}: refused so that the two pods cannot swap GPUs", "swap", pod)
        wanted = [w for p, _, w in self._contenders(resource, len(ids)) if p.uid == pod.uid]
        raise AdmissionError(
            Refusal.FAILED_PRECONDITION,
            f"the kubelet is admitting pod {pod.key} but allocated it {list(ids)}, not what gpupool assigned "
            f"({_describe(wanted[0]) if wanted else 'nothing of ' + resource}); a Topology Manager policy the "
            "scheduler did not honour?", "not_assigned", pod)

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
            pod = self._pods.get(claim.pod.uid)
            if pod is None:  # deleted while its Allocate ran: nothing to hold, nobody to tell
                return None
            self._alloc.setdefault(pod.uid, {}).setdefault(claim.container, {})[claim.resource] = claim.ids
            spec = self._container(pod, claim.container)
            if self._on_allocated is not None and (not spec.init or spec.sidecar):  # someone checks them;
                # PodResources does not list non-restartable init containers
                self._unconfirmed.setdefault(pod.uid, {})[(claim.container, claim.resource)] = self._clock()
            ack = self._ack_locked(pod)
            notify = self._on_allocated
        self._changed()
        if notify is not None:
            notify()
        return ack

    # -- checking allocations against the kubelet's records --------------------------------------
    def on_allocated(self, callback: Callable[[], None] | None) -> None:
        """`callback()` after each committed allocation (outside the book's lock): time to check it."""
        with self._lock:
            self._on_allocated = callback

    def unconfirmed(self) -> int:
        """Allocations (container, resource) committed that no kubelet pod list has shown yet."""
        with self._lock:
            live = {p.uid for p in self._live()}
            return sum(len(v) for uid, v in self._unconfirmed.items() if uid in live)

    def expire_unconfirmed(self, window_s: float) -> list[str]:
        """Stop waiting for allocations committed more than `window_s` ago; returns them as
        "namespace/name container resource" (the periodic reconciliation still covers them)."""
        now = self._clock()
        expired: list[str] = []
        with self._lock:
            for uid in list(self._unconfirmed):
                pending = self._unconfirmed[uid]
                pod = self._pods.get(uid)
                for key, since in list(pending.items()):
                    if pod is None or pod.terminal or now - since > window_s:
                        del pending[key]
                        if pod is not None and not pod.terminal:
                            expired.append(f"{pod.key} {key[0]} {key[1]}")
                if not pending:
                    del self._unconfirmed[uid]
        return expired

    def failure_ack(self, claim_pod: PodRecord, message: str) -> AllocationAck:
        with self._lock:
            self._refused.add(claim_pod.uid)  # the kubelet rejects the pod: it is no longer being admitted
            return self._ack_locked(claim_pod).model_copy(update={"error": message})

    def _ack_locked(self, pod: PodRecord) -> AllocationAck:
        done = self._alloc.get(pod.uid, {})
        complete = all(resource in done.get(c.name, {})
                       for c in pod.containers for resource in self._wanted_resources(pod, c))
        return AllocationAck(node=self.node, pod_uid=pod.uid,
                             containers={c: dict(r) for c, r in done.items() if r}, complete=complete)

    # -- PodResources ----------------------------------------------------------------------------
    def reconcile(self, kubelet_pods: Iterable[KubeletPod]) -> Reconciliation:
        """Make the allocation records say what the kubelet says running containers hold: what it lists
        is the truth. A container the kubelet lists without devices is left alone (its Allocate may have
        returned a moment ago: the kubelet records it afterwards), and so are init containers, which it
        does not list. Returns the corrections and the acks to rewrite."""
        with self._lock:
            live: dict[str, PodRecord] = {}
            for rec in sorted(self._live(), key=lambda p: p.created):
                live[rec.key] = rec  # a re-created pod of the same name: the newest
            truth: dict[tuple[str, str, str], tuple[str, ...]] = {}  # (uid, container, resource) -> IDs
            owner: dict[tuple[str, str], str] = {}  # (resource, device ID) -> uid
            unknown: list[str] = []
            for kp in kubelet_pods:
                holds = {(c, r): tuple(i for i in ids if i in self._devices[r])
                         for c, by_resource in kp.containers.items() for r, ids in by_resource.items()
                         if r in self._devices}
                holds = {k: v for k, v in holds.items() if v}
                pod = live.get(kp.key)
                if pod is None:
                    if holds and kp.key not in {p.key for p in self._pods.values()}:
                        unknown.append(kp.key)
                    continue
                names = {c.name for c in pod.containers}
                for (container, resource), ids in holds.items():
                    if container in names:
                        truth[(pod.uid, container, resource)] = ids
                        owner.update({(resource, i): pod.uid for i in ids})
            corrections: list[Correction] = []
            touched: set[str] = set()
            for (uid, container, resource), ids in truth.items():
                mine = self._alloc.setdefault(uid, {}).setdefault(container, {})
                was = mine.get(resource)
                if was is None or set(was) != set(ids):
                    mine[resource] = ids
                    corrections.append(Correction(self._pods[uid].key, container, resource,
                                                  "missing" if was is None else "differs", was or (), ids))
                    touched.add(uid)
            for uid, by_container in self._alloc.items():
                if uid not in self._pods:
                    continue
                for container, by_resource in by_container.items():
                    for resource, ids in list(by_resource.items()):
                        if (uid, container, resource) in truth:
                            continue
                        if any(owner.get((resource, i), uid) != uid for i in ids):
                            del by_resource[resource]
                            corrections.append(Correction(self._pods[uid].key, container, resource,
                                                          "held_by_other", ids, ()))
                            touched.add(uid)
            acks = tuple((self._pods[uid], self._ack_locked(self._pods[uid])) for uid in sorted(touched))
            confirmed = self._confirm_locked(truth)
        if corrections:
            self._changed()
        return Reconciliation(tuple(corrections), acks, tuple(sorted(set(unknown))), confirmed)

    def _confirm_locked(self, truth: Mapping[tuple[str, str, str], tuple[str, ...]]) -> tuple[tuple[str, float], ...]:
        """Allocations the kubelet's records now show (and the book now equals): no longer unconfirmed."""
        now = self._clock()
        confirmed: list[tuple[str, float]] = []
        for uid in list(self._unconfirmed):
            pending = self._unconfirmed[uid]
            seen = [key for key in pending if (uid, *key) in truth]
            if seen:
                oldest = min(pending[key] for key in seen)
                for key in seen:
                    del pending[key]
                if not pending:
                    del self._unconfirmed[uid]
                    pod = self._pods.get(uid)
                    confirmed.append((pod.key if pod is not None else uid, now - oldest))
        return tuple(confirmed)

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

    def _pending(self, resource: str, *, assigned: bool,
                 any_turn: bool = False) -> Iterator[tuple[PodRecord, ContainerSpec, Want]]:
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

    def _in_progress(self, pod: PodRecord) -> bool:
        """The kubelet started on this pod: it finishes a pod's containers before the next pod."""
        return bool(self._alloc.get(pod.uid)) and not self._ack_locked(pod).complete

    def _pick(self, cands: list[_Candidate]) -> _Candidate:
        """The pod being admitted, without the kubelet's pod list: one the kubelet already started on, else
        the first whose bind arrived (the kubelet admits pods in the order their binds reach it; pods that
        reach it together, at its start or a re-list, oldest first), then the oldest."""
        return min(cands, key=lambda c: (not self._in_progress(c.pod), self._arrival.get(c.pod.uid, 0),
                                         c.pod.created, c.pod.name, c.pod.uid))


def _describe(want: Want) -> str:
    if isinstance(want, MemoryShare):
        return f"{want.units} units on {want.gpu}"
    return str(list(want)) if isinstance(want, tuple) else f"{want} devices"


def _size(want: Want) -> int:
    if isinstance(want, MemoryShare):
        return want.units
    return len(want) if isinstance(want, tuple) else want


def _unit_number(device_id: str) -> int:
    unit = split_memory_unit_id(device_id)
    return unit[1] if unit else -1


def _rv(resource_version: str | None) -> int:
    """An etcd revision as an integer (0 when absent or not a number: then it orders first)."""
    try:
        return int(resource_version or 0)
    except ValueError:
        return 0


def _older(a: str, b: str) -> bool:
    """resourceVersion a is older than b (etcd revisions are integers; otherwise never older)."""
    try:
        return int(a) < int(b)
    except ValueError:
        return False
