"""The scheduler's live view of the cluster: nodes, and a ledger of every pod that holds resources.

kube-scheduler's cache is the model. Every pod that holds (or is about to hold) CPU, memory or GPUs
on a node has one ledger entry keyed by its UID:

    ASSUMED    decided by our cycle; its Binding is being sent
    BOUND      the API server accepted the Binding; the watch has not shown it yet
    CONFIRMED  seen bound on the watch (our pods and everybody else's)
    NOMINATED  a hold: what an evicted victim held, kept for its preemptor (docs/preemption.md)

An entry is *forgotten* (its resources released) only on a definite answer: its Binding was refused
(a 4xx other than 409, or never sent), the pod was read unbound, or it was deleted or ended. A Binding
whose outcome is unknown (a timeout, a 5xx, a lost answer, a 409) and a BOUND entry the watch has not
confirmed within `confirm_ttl_s` stay accounted, marked `uncertain`, until a read of the pod says
which (the binder's `verify`). A UID is never assumed twice.

The entries are accounted on one `ClusterSnapshot`, the placement core's data, which this class alone
writes. Nodes are added, replaced and removed in place (`ClusterSnapshot.upsert_node/remove_node`);
replacing a node re-applies only that node's entries. Everything runs on one thread (the scheduler's
event loop), so every cycle decides on a consistent view.

It also keeps the assignment handshake's per-(node, shape) gate (docs/handshake.md, rule 4): a pod
with an assignment holds the gate of its node for its container shapes from bind until the device
plugin's ack, the pod leaving Pending, its deletion, or `gate_timeout_s`; not on nodes whose plugin
tells same-shape pods apart by the kubelet's PodResources (`needs_gate`). `gate_busy` tells the
cycle which nodes are in that pipeline for a set of shapes (holding the gate, or assumed and about
to take it), so that it can prefer nodes where a bind goes out at once.

Preemption leaves two marks here: victims being evicted (`PodEntry.evicting_for`, never chosen again)
and nominations (`Nomination`): when a victim goes, its entry becomes a NOMINATED hold under a synthetic
UID, so that what it freed stays taken until the preemptor is placed (`release_holds`), is deleted or
bound elsewhere, or the nomination expires.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from gpupool_common.handshake import Assignment, HandshakeError, parse_ack, parse_assignment
from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.scheduler.assignment import placement_from_annotations
from gpupool_sched.scheduler.nodes import NodeView, node_view
from gpupool_sched.scheduler.podspec import ClusterFacts, InvalidPod, PodPlan, plan_pod
from gpupool_sched.scheduler.queue import ClusterEvent

log = logging.getLogger(__name__)

TERMINAL_PHASES = ("Succeeded", "Failed")
CHECKPOINT_GRACE = "gpupool.io/checkpoint-grace-seconds"
TERMINATING = "(terminating)"  # PodEntry.evicting_for of a pod deleted by someone else
Shape = tuple[str, int]


def plan_shapes(plan: PodPlan) -> frozenset[Shape]:
    """The handshake shapes (plugin resource, device count) of a pod's containers."""
    return frozenset((r, n) for c in plan.containers for r, n in c.counts().items())


class Phase(StrEnum):
    ASSUMED = "assumed"
    BOUND = "bound"
    CONFIRMED = "confirmed"
    NOMINATED = "nominated"


@dataclass(slots=True)
class PodEntry:
    uid: str
    key: str
    node: str
    request: PodRequest
    placement: Placement  # what is accounted on the node (GPU-less when the devices are unknown)
    phase: Phase
    ours: bool
    since: float
    resource_version: int = 0
    shapes: frozenset[Shape] = frozenset()  # handshake shapes while the pod holds its node's gate
    gate_since: float | None = None  # None: not holding the gate
    occupies: frozenset[Shape] = frozenset()  # shapes counted in ClusterState.gate_busy (assumed or holding)
    applied: bool = False  # accounted on the snapshot (False while its node is unknown)
    pending: bool = True  # pod phase Pending
    unresolved: Mapping[str, Any] | None = None  # the pod, while its node is unknown (devices told later)
    labels: Mapping[str, str] = field(default_factory=dict)  # for PodDisruptionBudget selectors
    started: float = 0.0  # status.startTime (else creation), seconds since the epoch: preemption's age
    grace_s: int | None = None  # gpupool.io/checkpoint-grace-seconds: the eviction's grace period
    pod_grace_s: int | None = None  # spec.terminationGracePeriodSeconds (the grace without the annotation)
    deletion_grace_s: int | None = None  # metadata.deletionGracePeriodSeconds: the grace it is terminating with
    evicting_for: str | None = None  # UID of the preemptor this pod is being evicted for
    uncertain: bool = False  # its Binding's outcome is unknown (answer lost, or never seen bound): being read


@dataclass(slots=True)
class Nomination:
    """A preemptor waiting on `node` for its victims to go; `holds` keep what the gone ones freed."""

    uid: str
    key: str
    node: str
    priority: int
    victims: set[str]  # UIDs still terminating
    deadline: float  # state clock
    holds: set[str] = field(default_factory=set)  # synthetic UIDs of NOMINATED entries
    adopted: bool = False  # rebuilt from status.nominatedNodeName, not decided by this instance
    hold_for: Callable[[set[str]], float] | None = None  # adopted: how long victims joining later extend it
    # adopted: terminating pods it may have evicted whatever their priority (a GpuQuota reclaim's victims)
    reclaims: Callable[[PodEntry], bool] | None = None


@dataclass(frozen=True, slots=True)
class PodUpdate:
    """What one pod event changed, for the queue and the binder."""

    pending_ours: bool = False  # a pod for our queue (not bound, not ended, not assumed)
    gone: bool = False  # deleted, ended, or bound elsewhere: drop it from the queue
    freed: bool = False  # resources on a node were released
    gate_released: str | None = None  # node whose gate opened


@dataclass(slots=True)
class _Tombstone:
    resource_version: int
    at: float


def resource_version(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class ClusterState:
    def __init__(
        self,
        scheduler_name: str,
        *,
        memory_unit_mib: int = 1024,
        gate_timeout_s: float = 30.0,
        confirm_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler_name = scheduler_name
        self.memory_unit_mib = memory_unit_mib
        self.gate_timeout_s = gate_timeout_s
        self.confirm_ttl_s = confirm_ttl_s
        self.clock = clock
        self.snapshot = ClusterSnapshot([])
        self.nodes: dict[str, NodeView] = {}
        self._node_signature: dict[str, tuple[Any, ...]] = {}
        self._node_rv: dict[str, int] = {}
        self.pods: dict[str, PodEntry] = {}
        self.by_node: dict[str, set[str]] = defaultdict(set)
        self._tombstones: dict[str, _Tombstone] = {}
        self._pod_rv: dict[str, int] = {}
        self.priority_classes: dict[str, int] = {}
        self._facts: ClusterFacts | None = None
        self.on_gate_release: Callable[[str], None] = lambda node: None
        self._applied_priorities: Counter[int] = Counter()  # priority -> accounted entries
        self._gate_load: dict[Shape, dict[str, int]] = defaultdict(dict)  # shape -> node -> pods in its gate
        self.gate_timeouts = 0
        self.unknown_devices = 0  # bound pods whose GPUs could not be told (accounted by a guess)
        self.nominations: dict[str, Nomination] = {}  # preemptor UID -> its nomination
        self.non_preempting_classes: set[str] = set()  # PriorityClasses with preemptionPolicy: Never
        self.preemptions: dict[str, int] = {}  # pending pod UID -> preemptions it started (a storm bound)
        self._nominated_on: dict[str, str] = {}  # preemptor UID -> node of its latest nomination, ours or adopted
        # called with an entry whenever it joins or leaves `pods` or what it holds changes (QuotaBook's usage)
        self.watchers: list[Callable[[PodEntry], None]] = []

    # ---- facts for planning pods ----------------------------------------------------------------
    @property
    def facts(self) -> ClusterFacts:
        if self._facts is None:
            models: set[str] = set()
            profiles: set[str] = set()
            units = 0
            for view in self.nodes.values():
                for gpu in view.spec.gpus:
                    models.add(gpu.model)
                    profiles.update(s.profile for s in gpu.mig_slices)
                    if view.memory_shares and not gpu.mig_enabled:
                        units = max(units, gpu.memory_mib // self.memory_unit_mib)
            self._facts = ClusterFacts(self.memory_unit_mib, frozenset(models), frozenset(profiles), units)
        return self._facts

    def plan(self, obj: Mapping[str, Any]) -> PodPlan:
        """A pending pod of ours as placement sees it (raises InvalidPod with the user-facing reason)."""
        return plan_pod(obj, self.facts, self.priority_classes)

    # ---- nodes -----------------------------------------------------------------------------------
    def apply_priority_class(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        """A PriorityClass was listed, added, changed or deleted: its value and preemption policy."""
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        self.non_preempting_classes.discard(name)
        if kind == "DELETED":
            self.priority_classes.pop(name, None)
            return
        if obj.get("preemptionPolicy") == "Never":
            self.non_preempting_classes.add(name)
        try:
            self.priority_classes[name] = int(obj.get("value", 0))
        except (TypeError, ValueError):
            log.warning("PriorityClass %s has a non-integer value", name)

    def apply_node(self, obj: Mapping[str, Any]) -> ClusterEvent | None:
        """A node was listed, added or changed; returns the queue event it amounts to, if any."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        rv = resource_version(obj)
        if not name or rv < self._node_rv.get(name, 0):
            return None
        self._node_rv[name] = rv
        status = obj.get("status") or {}
        spec = obj.get("spec") or {}
        signature = (
            repr(status.get("allocatable") or status.get("capacity")),
            repr(sorted((meta.get("labels") or {}).items())),
            repr(spec.get("taints")),
            bool(spec.get("unschedulable")),
            (meta.get("annotations") or {}).get("gpupool.io/gpu-inventory"),
        )
        if self._node_signature.get(name) == signature:
            return None  # a heartbeat: nothing placement cares about changed
        self._node_signature[name] = signature
        view = node_view(obj, self.memory_unit_mib)
        if view.problem:
            log.warning("node %s: %s; it is scheduled as a node without GPUs", name, view.problem)
        return self.upsert_node(view)

    def upsert_node(self, view: NodeView) -> ClusterEvent | None:
        old = self.nodes.get(view.name)
        if old is not None and old.spec == view.spec:
            self.nodes[view.name] = view
            return None
        for uid in self.by_node.get(view.name, ()):
            self.pods[uid].applied = False  # the node's row is reset below
        self.snapshot.upsert_node(view.spec)
        self.nodes[view.name] = view
        self._facts = None
        for uid in sorted(self.by_node.get(view.name, ())):
            entry = self.pods[uid]
            if entry.unresolved is not None:
                obj, entry.unresolved = entry.unresolved, None
                entry.request, entry.placement = self._holding(obj, view.name, view, *_handshake(obj, uid))
                self._tell(entry)
            self._apply(entry)
        if old is None:
            return ClusterEvent.NODE_ADDED
        return ClusterEvent.NODE_CHANGED

    def delete_node(self, name: str) -> None:
        self._node_signature.pop(name, None)
        self._node_rv.pop(name, None)
        if self.nodes.pop(name, None) is None:
            return
        self.snapshot.remove_node(name)
        self._facts = None
        for uid in self.by_node.get(name, ()):
            self._unapply(self.pods[uid])  # kept: the pod may still exist, and so may the node again

    # ---- pods: the watch -------------------------------------------------------------------------
    def apply_pod(self, obj: Mapping[str, Any], deleted: bool = False) -> PodUpdate:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not uid:
            return PodUpdate()
        rv = resource_version(obj)
        tomb = self._tombstones.get(uid)
        if tomb is not None:
            return PodUpdate(gone=True)  # deleted or ended for good: nothing can revive a UID
        if rv and rv < self._pod_rv.get(uid, 0):
            return PodUpdate()  # an older view (e.g. a re-list that started before a bind)
        self._pod_rv[uid] = rv
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        phase = status.get("phase") or "Pending"
        if deleted or phase in TERMINAL_PHASES:
            self._tombstones[uid] = _Tombstone(rv, self.clock())
            self._pod_rv.pop(uid, None)
            ended = self.end_nomination(uid)  # a preemptor gone: its holds go too
            self.preemptions.pop(uid, None)
            self._nominated_on.pop(uid, None)
            entry = self.pods.get(uid)
            if entry is not None and entry.evicting_for in (None, TERMINATING):
                self._join_adopted(entry)
            if entry is not None and self._to_hold(entry):
                return PodUpdate(gone=True, freed=True)  # its preemptor is woken; others find it taken
            node = entry.node if entry else None
            released = entry is not None and entry.gate_since is not None
            self.forget(uid)
            return PodUpdate(gone=True, freed=entry is not None or ended, gate_released=node if released else None)
        node = spec.get("nodeName")
        ours = spec.get("schedulerName") == self.scheduler_name
        entry = self.pods.get(uid)
        if not node:
            if entry is not None:
                return PodUpdate()  # our own decision in flight
            return PodUpdate(pending_ours=ours)
        return self._observe_bound(uid, obj, str(node), ours, phase, rv)

    def _observe_bound(self, uid: str, obj: Mapping[str, Any], node: str, ours: bool, phase: str, rv: int) -> PodUpdate:
        assignment, ack = _handshake(obj, uid)
        entry = self.pods.get(uid)
        pending = phase == "Pending"
        acked = ack is not None
        released: str | None = None
        if entry is not None and entry.node == node:
            entry.phase = Phase.CONFIRMED
            entry.uncertain = False
            entry.resource_version = rv
            entry.pending = pending
            _describe(entry, obj)
            if entry.evicting_for == TERMINATING:
                self._join_adopted(entry)
            if acked:
                # what the kubelet really allocated is the truth; re-account if it differs
                self._account_from(entry, obj, node, None, ack)
            if entry.gate_since is not None and (acked or not pending):
                entry.gate_since = None
                self._occupy(entry, frozenset())
                released = node
            return PodUpdate(gone=True, gate_released=released)
        if entry is not None:  # bound to another node than we assumed: trust the API server
            self.forget(uid)
        self.end_nomination(uid)  # bound by someone else while nominated
        self.preemptions.pop(uid, None)
        view = self.nodes.get(node)
        request, placement = self._holding(obj, node, view, assignment, ack)
        key = f"{(obj.get('metadata') or {}).get('namespace', '')}/{(obj.get('metadata') or {}).get('name', '')}"
        entry = PodEntry(uid, key, node, request, placement, Phase.CONFIRMED, ours, self.clock(), rv, pending=pending)
        _describe(entry, obj)
        if view is None:
            entry.unresolved = obj
        if assignment is not None and pending and not acked and assignment.pod_uid == uid and self.needs_gate(node):
            entry.shapes = frozenset(assignment.shapes())
            entry.gate_since = self.clock()  # e.g. after a restart: still waiting for the plugin
            self._occupy(entry, entry.shapes)
        self.pods[uid] = entry
        self._tell(entry)
        self.by_node[node].add(uid)
        self._apply(entry)
        if entry.evicting_for == TERMINATING:
            self._join_adopted(entry)
        return PodUpdate(gone=True)

    def _holding(
        self, obj: Mapping[str, Any], node: str, view: NodeView | None, assignment: Assignment | None, ack: Any
    ) -> tuple[PodRequest, Placement]:
        """What a bound pod holds: from its assignment or ack; else a guess on the node."""
        try:
            plan = plan_pod(obj, self.facts, self.priority_classes, strict=False)
        except InvalidPod:
            return PodRequest(name=str(obj.get("metadata", {}).get("name", "?"))), Placement(node=node)
        request = plan.request
        if view is None:
            return request, Placement(node=node)  # accounted when the node shows up
        found = placement_from_annotations(plan, view.spec, assignment, ack)
        if found is not None:
            return found
        if not (request.wants_gpu or request.wants_mig or request.extra):
            return request, Placement(node=node)
        return self._guess(request, node)

    def _guess(self, request: PodRequest, node: str) -> tuple[PodRequest, Placement]:
        """A GPU pod of another scheduler without an ack yet: reserve devices the way best-fit would,
        so that nothing double-books them; the ack corrects the guess when it arrives."""
        from gpupool_sched.model.constraints import NodeConstraints, Requirement
        from gpupool_sched.placement.decide import decide
        from gpupool_sched.placement.registry import build_policy

        pinned = NodeConstraints(affinity_terms=((Requirement("metadata.name", "In", (node,)),),))
        probe = PodRequest.of_shapes(
            request.name, request.gpu_shapes(), gpu_models=request.gpu_models, constraints=pinned
        )
        decision = decide(self.snapshot, probe, build_policy("best-fit"))
        self.unknown_devices += 1
        if isinstance(decision, Placement):
            return request, decision
        log.warning("pod %s on %s holds GPUs that do not fit the node's free GPUs", request.name, node)
        return _without_gpus(request), Placement(node=node)

    def _account_from(self, entry: PodEntry, obj: Mapping[str, Any], node: str, assignment: Any, ack: Any) -> None:
        view = self.nodes.get(node)
        if view is None:
            return
        try:
            plan = plan_pod(obj, self.facts, self.priority_classes, strict=False)
        except InvalidPod:
            return
        found = placement_from_annotations(plan, view.spec, assignment, ack)
        if found is None:
            return
        request, placement = found
        if _devices(placement) == _devices(entry.placement):
            return
        log.info("pod %s: the kubelet allocated %s, accounted %s; following the kubelet",
                 entry.key, _devices(placement), _devices(entry.placement))
        self._unapply(entry)
        entry.request, entry.placement = request, placement
        self._tell(entry)
        self._apply(entry)

    # ---- pods: the cycle --------------------------------------------------------------------------
    def assume(self, plan: PodPlan, placement: Placement) -> PodEntry:
        if plan.uid in self.pods:
            raise ValueError(f"pod {plan.key} ({plan.uid}) is already in the ledger")
        if plan.uid in self._tombstones:
            raise ValueError(f"pod {plan.key} ({plan.uid}) is gone")
        self.end_nomination(plan.uid)  # its holds were released for this decision (`release_holds`)
        self.preemptions.pop(plan.uid, None)
        entry = PodEntry(plan.uid, plan.key, placement.node, plan.request, placement, Phase.ASSUMED, True, self.clock())
        self.pods[plan.uid] = entry
        self._tell(entry)
        self.by_node[placement.node].add(plan.uid)
        self._apply(entry)
        if self.needs_gate(placement.node):
            self._occupy(entry, plan_shapes(plan))  # on its way to the gate
        return entry

    def needs_gate(self, node: str) -> bool:
        """False when the node's device plugin tells same-shape pods apart by the kubelet's PodResources
        (its inventory says `pod_identity`): several may then be pending there at once."""
        view = self.nodes.get(node)
        return not (view is not None and view.inventory is not None and view.inventory.pod_identity)

    def hold_gate(self, uid: str, shapes: Iterable[Shape]) -> None:
        entry = self.pods[uid]
        entry.shapes = frozenset(shapes)
        entry.gate_since = self.clock()
        self._occupy(entry, entry.shapes)

    def gate_busy(self, shapes: Iterable[Shape]) -> set[str]:
        """Nodes where a pod sharing one of `shapes` holds the gate or is assumed on its way to it: a
        pod placed there now would wait for that pod's ack before its Binding goes out."""
        out: set[str] = set()
        for shape in shapes:
            load = self._gate_load.get(shape)
            if load:
                out.update(load)
        return out

    def _occupy(self, entry: PodEntry, shapes: frozenset[Shape]) -> None:
        """Move `entry`'s count in the gate load from its current shapes to `shapes`."""
        for shape in entry.occupies:
            load = self._gate_load[shape]
            left = load.get(entry.node, 0) - 1
            if left > 0:
                load[entry.node] = left
            else:
                load.pop(entry.node, None)
        for shape in shapes:
            load = self._gate_load[shape]
            load[entry.node] = load.get(entry.node, 0) + 1
        entry.occupies = shapes

    def gate_blocker(self, uid: str, node: str, shapes: frozenset[Shape]) -> PodEntry | None:
        """An unacknowledged pod on `node` sharing a shape with `shapes` (then `uid` must wait)."""
        now = self.clock()
        for other_uid in self.by_node.get(node, ()):
            if other_uid == uid:
                continue
            other = self.pods[other_uid]
            if other.gate_since is None or not (other.shapes & shapes):
                continue
            if now - other.gate_since >= self.gate_timeout_s:
                log.warning("pod %s: no ack from the device plugin on %s after %.0fs; opening its gate",
                            other.key, node, now - other.gate_since)
                other.gate_since = None
                self._occupy(other, frozenset())
                self.gate_timeouts += 1
                continue
            return other
        return None

    def gate_deadline(self, blocker: PodEntry) -> float:
        return (blocker.gate_since or self.clock()) + self.gate_timeout_s - self.clock()

    def mark_bound(self, uid: str) -> None:
        entry = self.pods.get(uid)
        if entry is not None and entry.phase is Phase.ASSUMED:
            entry.phase = Phase.BOUND
            entry.since = self.clock()

    def forget(self, uid: str) -> PodEntry | None:
        entry = self._unlink(uid)
        if entry is not None:
            self._unapply(entry)
            nomination = self.nominations.get(entry.evicting_for or "")
            if nomination is not None:
                nomination.victims.discard(uid)
        return entry

    def _tell(self, entry: PodEntry) -> None:
        """`entry` joined or left `pods`, or what it holds changed: the watchers recount it."""
        for watcher in self.watchers:
            watcher(entry)

    def _unlink(self, uid: str) -> PodEntry | None:
        """Take the entry out of the ledger, its gate and the gate load; its accounting is the caller's."""
        entry = self.pods.pop(uid, None)
        if entry is None:
            return None
        self._tell(entry)
        self._occupy(entry, frozenset())
        uids = self.by_node.get(entry.node)
        if uids is not None:
            uids.discard(uid)
            if not uids:
                del self.by_node[entry.node]
        if entry.gate_since is not None:
            entry.gate_since = None
            self.on_gate_release(entry.node)
        return entry

    # ---- preemption: victims, nominations, holds ---------------------------------------------------
    def running(self) -> Iterator[PodEntry]:
        """Entries preemption may choose victims from: bound or confirmed, accounted, not being evicted."""
        for entry in self.pods.values():
            if entry.phase in (Phase.BOUND, Phase.CONFIRMED) and entry.applied and entry.evicting_for is None:
                yield entry

    def nominate(self, uid: str, key: str, node: str, priority: int, victims: Iterable[str],
                 timeout_s: float) -> Nomination:
        """Mark `victims` as evicted for `uid` (never chosen again) and record where it waits."""
        self.end_nomination(uid)
        self.preemptions[uid] = self.preemptions.get(uid, 0) + 1
        nomination = Nomination(uid, key, node, priority, set(), self.clock() + timeout_s)
        self._nominated_on[uid] = node
        for victim in victims:
            entry = self.pods[victim]
            if entry.evicting_for is not None:
                raise ValueError(f"pod {entry.key} is already being evicted for {entry.evicting_for}")
            entry.evicting_for = uid
            nomination.victims.add(victim)
        self.nominations[uid] = nomination
        return nomination

    def adopt_nomination(self, uid: str, key: str, node: str, priority: int,
                         timeout_s: Callable[[set[str]], float], *,
                         reclaims: Callable[[PodEntry], bool] | None = None) -> Nomination | None:
        """A pending pod shows `status.nominatedNodeName: node` that this instance did not decide: another
        leader preempted for it before a failover, or this one before a restart. Hold for it as that
        leader did (kube-scheduler rebuilds its nominator from the same field): the node's pods of lower
        priority that are already terminating become its victims, and those that go later join as they
        go. `timeout_s(victims)`: how long it holds. `reclaims(entry)`: True for a terminating pod a quota
        reclaim for this pod may have evicted, whatever its priority (QuotaBook.reclaimable_by). None when
        there is nothing to adopt (the node is unknown, or this nomination was seen)."""
        if self._nominated_on.get(uid) == node or node not in self.nodes or uid in self.pods:
            return None
        self.end_nomination(uid)
        self._nominated_on[uid] = node
        nomination = Nomination(uid, key, node, priority, set(), 0.0, adopted=True, hold_for=timeout_s,
                                reclaims=reclaims)
        self.nominations[uid] = nomination
        for victim in sorted(self.by_node.get(node, ())):
            entry = self.pods[victim]
            if entry.evicting_for == TERMINATING and (entry.request.priority < priority
                                                      or (reclaims is not None and reclaims(entry))):
                entry.evicting_for = uid
                nomination.victims.add(victim)
        nomination.deadline = self.clock() + timeout_s(nomination.victims)
        log.info("pod %s: adopted its nomination on %s (%d victim(s) terminating)", key, node,
                 len(nomination.victims))
        return nomination

    def drop_adopted(self, uid: str) -> bool:
        """The pod's nominatedNodeName was cleared by whoever set it: an adopted nomination ends."""
        nomination = self.nominations.get(uid)
        if nomination is None or not nomination.adopted:
            return False
        self._nominated_on.pop(uid, None)
        return self.end_nomination(uid)

    def _join_adopted(self, entry: PodEntry) -> None:
        """A pod started terminating (or went) on a node where an adopted nomination of higher priority
        waits: what it frees is held for that nomination's pod, the highest priority first."""
        best: Nomination | None = None
        for nomination in self.nominations.values():
            if (nomination.adopted and nomination.node == entry.node
                    and (nomination.priority > entry.request.priority
                         or (nomination.reclaims is not None and nomination.reclaims(entry)))
                    and (best is None or nomination.priority > best.priority)):
                best = nomination
        if best is not None:
            entry.evicting_for = best.uid
            best.victims.add(entry.uid)
            if best.hold_for is not None:  # it holds as long as this victim's grace needs too
                best.deadline = max(best.deadline, self.clock() + best.hold_for({entry.uid}))

    def nomination_live(self, uid: str) -> bool:
        """kube-scheduler's PodEligibleToPreemptOthers, inverted: the pod's victims are still terminating."""
        nomination = self.nominations.get(uid)
        return nomination is not None and nomination.deadline > self.clock() and bool(nomination.victims)

    def spare(self, uid: str, victims: Iterable[str]) -> None:
        """`victims` will not be evicted for `uid` after all (an eviction failed): they run on."""
        nomination = self.nominations.get(uid)
        for victim in victims:
            entry = self.pods.get(victim)
            if entry is not None and entry.evicting_for == uid:
                entry.evicting_for = None
            if nomination is not None:
                nomination.victims.discard(victim)

    def end_nomination(self, uid: str) -> bool:
        """Drop `uid`'s nomination and release its holds (True when that freed resources). Victims
        still terminating stay marked: their evictions are out (`spare` un-marks unsent ones)."""
        nomination = self.nominations.pop(uid, None)
        if nomination is None:
            return False
        freed = False
        for hold in nomination.holds:
            entry = self._unlink(hold)
            if entry is not None:
                freed |= entry.applied
                self._unapply(entry)
        return freed

    def release_holds(self, uid: str) -> list[PodEntry]:
        """Un-account `uid`'s holds for its own decision; `assume` then drops them, `restore_holds`
        takes them back when it still fits nowhere."""
        nomination = self.nominations.get(uid)
        if nomination is None:
            return []
        released = [self.pods[h] for h in sorted(nomination.holds) if h in self.pods]
        for entry in released:
            self._unapply(entry)
        return released

    def release_lower_holds(self, priority: int, own: Collection[str]) -> list[str]:
        """Un-account the holds of every nomination of lower priority than `priority` (but `own`'s),
        for one decision: kube-scheduler counts a nominated pod against pods of its priority or lower only,
        so a more important pod may take the room. Returns the nominations released."""
        released = []
        for nomination in self.nominations.values():
            if nomination.priority < priority and nomination.uid not in own and nomination.holds:
                self.release_holds(nomination.uid)
                released.append(nomination.uid)
        return released

    def drop_holds(self, uid: str) -> None:
        """`uid`'s released holds are gone for good (a more important pod took that room): the nomination
        stays (its victims may still be terminating), holding nothing; its pod may preempt again later."""
        nomination = self.nominations.get(uid)
        if nomination is None:
            return
        for hold in list(nomination.holds):
            self._unlink(hold)  # un-accounted already (`release_holds`)
        nomination.holds.clear()

    def restore_holds(self, uid: str) -> None:
        nomination = self.nominations.get(uid)
        for hold in sorted(nomination.holds) if nomination else ():
            entry = self.pods.get(hold)
            if entry is not None:
                self._apply(entry)

    def expire_nominations(self) -> list[Nomination]:
        """Nominations past their deadline, ended (their holds released)."""
        now = self.clock()
        stale = [n for n in self.nominations.values() if n.deadline <= now]
        for nomination in stale:
            log.info("pod %s: nomination on %s expired", nomination.key, nomination.node)
            self.end_nomination(nomination.uid)
        return stale

    def _to_hold(self, entry: PodEntry) -> bool:
        """A victim went: keep what it held for its preemptor, under a synthetic UID."""
        nomination = self.nominations.get(entry.evicting_for or "")
        if nomination is None or entry.phase is Phase.NOMINATED:
            return False
        victim = entry.uid
        self._unlink(victim)
        nomination.victims.discard(victim)
        entry.uid = f"hold/{nomination.uid}/{victim}"
        entry.key = f"hold for {nomination.key} (was {entry.key})"
        entry.phase, entry.since, entry.ours = Phase.NOMINATED, self.clock(), True
        self.pods[entry.uid] = entry
        self.by_node[entry.node].add(entry.uid)
        nomination.holds.add(entry.uid)
        self._tell(entry)
        return True

    def expire(self) -> list[PodEntry]:
        """BOUND entries the watch has not confirmed within `confirm_ttl_s`: marked `uncertain` and
        returned for a read of the pod (kube-scheduler forgets them; a watch gap would then free GPUs
        in use). Old tombstones go."""
        now = self.clock()
        stale = [e for e in self.pods.values()
                 if e.phase is Phase.BOUND and not e.uncertain and now - e.since > self.confirm_ttl_s]
        for entry in stale:
            log.warning("pod %s: bound %.0fs ago but never seen bound; reading it", entry.key, now - entry.since)
            entry.uncertain = True
        cutoff = now - 600.0
        for uid in [u for u, t in self._tombstones.items() if t.at < cutoff]:
            del self._tombstones[uid]
        return stale

    def mark_uncertain(self, uid: str) -> PodEntry | None:
        """The Binding of `uid` may or may not have landed: keep what it holds until a read says."""
        entry = self.pods.get(uid)
        if entry is not None and entry.phase is not Phase.CONFIRMED:
            entry.uncertain = True
        return entry

    # ---- accounting ------------------------------------------------------------------------------
    def _apply(self, entry: PodEntry) -> None:
        if entry.applied or entry.node not in self.nodes:
            return
        spec = self.nodes[entry.node].spec
        if not _fits_layout(entry.placement, spec):
            log.warning("pod %s holds devices node %s no longer has; accounting it without GPUs", entry.key, spec.name)
            entry.request, entry.placement = _without_gpus(entry.request), Placement(node=entry.node)
            self._tell(entry)
        self.snapshot.assume(entry.request, entry.placement)
        entry.applied = True
        self._applied_priorities[entry.request.priority] += 1

    def has_lower_priority(self, priority: int) -> bool:
        """Whether any accounted pod has a priority below `priority` (cheap: no victim search without)."""
        return any(p < priority and n > 0 for p, n in self._applied_priorities.items())

    def _unapply(self, entry: PodEntry) -> None:
        if entry.applied:
            self._applied_priorities[entry.request.priority] -= 1
            if entry.node in self.nodes:
                self.snapshot.release(entry.request, entry.placement)
        entry.applied = False

    # ---- views -----------------------------------------------------------------------------------
    def entries(self, node: str | None = None) -> Iterator[PodEntry]:
        if node is None:
            yield from self.pods.values()
        else:
            for uid in self.by_node.get(node, ()):
                yield self.pods[uid]

    def node_spec(self, name: str) -> NodeSpec | None:
        view = self.nodes.get(name)
        return view.spec if view else None

    def is_gone(self, uid: str) -> bool:
        return uid in self._tombstones


def _describe(entry: PodEntry, obj: Mapping[str, Any]) -> None:
    """What preemption needs of a bound pod beyond its resources: labels, start, checkpoint grace."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels")
    entry.labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}
    started = _timestamp((obj.get("status") or {}).get("startTime")) or _timestamp(meta.get("creationTimestamp"))
    entry.started = started or entry.started or time.time()
    entry.grace_s = checkpoint_grace(meta.get("annotations"))
    entry.pod_grace_s = _seconds((obj.get("spec") or {}).get("terminationGracePeriodSeconds"))
    entry.deletion_grace_s = _seconds(meta.get("deletionGracePeriodSeconds"))
    if meta.get("deletionTimestamp") and entry.evicting_for is None:
        entry.evicting_for = TERMINATING  # on its way out already (e.g. evicted before a restart): no victim


def checkpoint_grace(annotations: Any) -> int | None:
    """`gpupool.io/checkpoint-grace-seconds` when it is a non-negative integer, else None."""
    if not isinstance(annotations, Mapping):
        return None
    text = annotations.get(CHECKPOINT_GRACE)
    if not isinstance(text, str) or not text.strip().isdigit():
        return None
    return int(text.strip())


def _seconds(value: Any) -> int | None:
    """A non-negative integer field (a grace period), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _timestamp(text: Any) -> float:
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _handshake(obj: Mapping[str, Any], uid: str) -> tuple[Assignment | None, Any]:
    """(assignment, complete ack) of a bound pod; the ack, when complete, is what the kubelet allocated
    and wins over the assignment."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    try:
        ack = parse_ack(annotations)
    except HandshakeError:
        ack = None
    try:
        assignment = parse_assignment(annotations)
    except HandshakeError:
        assignment = None
    if ack is not None and ack.complete and ack.pod_uid == uid and not ack.error:
        return None, ack
    return (assignment if assignment is not None and assignment.pod_uid == uid else None), None


def _devices(p: Placement) -> tuple[Any, ...]:
    parts = (p, *p.extras)
    return tuple((q.gpu_indices, q.gpu_milli, q.gpu_memory_mib, q.mig_devices) for q in parts)


def _without_gpus(request: PodRequest) -> PodRequest:
    return PodRequest(
        name=request.name, cpu_milli=request.cpu_milli, memory_mib=request.memory_mib,
        priority=request.priority, kind=request.kind, namespace=request.namespace,
    )


def _fits_layout(placement: Placement, spec: NodeSpec) -> bool:
    mig = {s.uuid for g in spec.gpus for s in g.mig_slices}
    for part in (placement, *placement.extras):
        if any(j >= len(spec.gpus) for j in part.gpu_indices):
            return False
        if any(d not in mig for d in part.mig_devices):
            return False
    return True


