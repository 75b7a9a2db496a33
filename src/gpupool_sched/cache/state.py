"""The scheduler's live view of the cluster: nodes, and a ledger of every pod that holds resources.

kube-scheduler's cache is the model. Every pod that holds (or is about to hold) CPU, memory or GPUs
on a node has one ledger entry keyed by its UID:

    ASSUMED    decided by our cycle; its Binding is being sent
    BOUND      the API server accepted the Binding; the watch has not shown it yet
    CONFIRMED  seen bound on the watch (our pods and everybody else's)
    NOMINATED  a hold: what an evicted victim held, kept for its preemptor (docs/preemption.md)
    RESERVED   a migration's destination, held for a mover's replacement (docs/defragmentation.md)

An entry is *forgotten* (its resources released) only on a definite answer: its Binding was refused
(a 4xx other than 409, or never sent), the pod was read unbound, or it was deleted or ended. A Binding
whose outcome is unknown (a timeout, a 5xx, a lost answer, a 409) and a BOUND entry the watch has not
confirmed within `confirm_ttl_s` stay accounted, marked `uncertain`, until a read of the pod says
which (the binder's `verify`). A UID is never assumed twice.

The entries are accounted on one `ClusterSnapshot`, the placement core's data, which this class alone
writes. Nodes are added, replaced and removed in place (`ClusterSnapshot.upsert_node/remove_node`);
replacing a node re-applies only that node's entries. Everything runs on one thread (the scheduler's
event loop), so every cycle decides on a consistent view.

The ledger (`ledger.py`), the assignment handshake's gates (`gates.py`), preemption's victims,
nominations and holds (`nominator.py`) and migration's reservations (`reservations.py`) are layers of
this one object; this module adds what the watch
brings in (nodes, pods, PriorityClasses) and the cycle's assume / forget.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpupool_common.handshake import Assignment
from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, parse_idle_pods
from gpupool_sched.cache.entries import (
    TERMINAL_PHASES,
    TERMINATING,
    Phase,
    PodEntry,
    PodUpdate,
    Tombstone,
    describe,
    devices,
    handshake,
    plan_shapes,
    resource_version,
    without_gpus,
)
from gpupool_sched.cache.reservations import Reservations
from gpupool_sched.framework.queue import ClusterEvent
from gpupool_sched.kube.assignment import placement_from_annotations
from gpupool_sched.kube.nodes import NodeView, node_view
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import InvalidPod, PodPlan
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest

log = logging.getLogger(__name__)


class ClusterState(Reservations):
    # ---- nodes -----------------------------------------------------------------------------------
    def apply_priority_class(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        """A PriorityClass was listed, added, changed or deleted: its value and preemption policy."""
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        self.non_preempting_classes.discard(name)
        self.classes_generation += 1
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
        self._read_idle(name, (meta.get("annotations") or {}).get(IDLE_PODS_ANNOTATION))
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
            self._unaccount(self.pods[uid])  # the node's row is reset below
        self.snapshot.upsert_node(view.spec)
        self.nodes[view.name] = view
        self._facts = None
        for uid in sorted(self.by_node.get(view.name, ())):
            entry = self.pods[uid]
            if entry.unresolved is not None:
                info, entry.unresolved = entry.unresolved, None
                entry.request, entry.placement = self._holding(info, view.name, view, *handshake(info.obj, uid))
                self._tell(entry)
            self._apply(entry)
        if old is None:
            return ClusterEvent.NODE_ADDED
        return ClusterEvent.NODE_CHANGED

    def _read_idle(self, node: str, text: Any) -> None:
        """The node's idle pods, read when its annotation changes. Absent or malformed: nothing idle there
        (a malformed one is logged and told to `on_idle_invalid` once per value; never an exception)."""
        if self._idle_text.get(node, "") == text and node in self._idle_text:
            return
        self._idle_text[node] = text
        try:
            if text is not None and not isinstance(text, str):
                raise ValueError("not a string")
            parsed = {uid: t.timestamp() for uid, t in parse_idle_pods(text).items()}
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            log.warning("node %s: %s is malformed (%s); no pod there counts as idle", node, IDLE_PODS_ANNOTATION, exc)
            self.on_idle_invalid(node, str(exc))
            parsed = {}
        if parsed:
            self.idle_pods[node] = parsed
        else:
            self.idle_pods.pop(node, None)

    def idle_since(self, uid: str) -> float | None:
        """When the pod became idle, as its node's device plugin lists it (seconds since the epoch); None
        when it is not listed idle by the node it is on."""
        entry = self.pods.get(uid)
        if entry is None:
            return None
        return self.idle_pods.get(entry.node, {}).get(uid)

    def delete_node(self, name: str) -> None:
        self.idle_pods.pop(name, None)
        self._idle_text.pop(name, None)
        self._node_signature.pop(name, None)
        self._node_rv.pop(name, None)
        if self.nodes.pop(name, None) is None:
            return
        self.snapshot.remove_node(name)
        self._facts = None
        for uid in self.by_node.get(name, ()):
            self._unapply(self.pods[uid])  # kept: the pod may still exist, and so may the node again

    # ---- pods: the watch -------------------------------------------------------------------------
    def apply_pod(self, pod: PodInfo | Mapping[str, Any], deleted: bool = False) -> PodUpdate:
        info = pod if isinstance(pod, PodInfo) else PodInfo.of(pod)
        uid, rv, phase = info.uid, info.resource_version, info.phase
        if not uid:
            return PodUpdate()
        tomb = self._tombstones.get(uid)
        if tomb is not None:
            return PodUpdate(gone=True)  # deleted or ended for good: nothing can revive a UID
        if rv and rv < self._pod_rv.get(uid, 0):
            return PodUpdate()  # an older view (e.g. a re-list that started before a bind)
        self._pod_rv[uid] = rv
        if deleted or phase in TERMINAL_PHASES:
            self._tombstones[uid] = Tombstone(rv, self.clock())
            self._pod_rv.pop(uid, None)
            ended = self.end_nomination(uid)  # a preemptor gone: its holds go too
            ended |= self.abandon_migration(uid)  # and the destinations held for its movers
            self.replaced.pop(uid, None)
            self.marks.pop(uid, None)
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
        ours = info.scheduler_name == self.scheduler_name
        entry = self.pods.get(uid)
        if not info.node:
            if entry is not None:
                return PodUpdate()  # our own decision in flight
            return PodUpdate(pending_ours=ours)
        return self._observe_bound(info, info.node, ours)

    def _observe_bound(self, info: PodInfo, node: str, ours: bool) -> PodUpdate:
        uid, obj, rv = info.uid, info.obj, info.resource_version
        assignment, ack = handshake(obj, uid)
        entry = self.pods.get(uid)
        pending = info.phase == "Pending"
        acked = ack is not None
        released: str | None = None
        if entry is not None and entry.node == node:
            entry.phase = Phase.CONFIRMED
            entry.uncertain = False
            entry.resource_version = rv
            entry.pending = pending
            said = (entry.owner, entry.movable, entry.job)
            describe(entry, obj)
            if (entry.owner, entry.movable, entry.job) != said:
                self._tell(entry)  # who may move it is read from these (an assumed entry knew only its owner)
            if entry.evicting_for == TERMINATING:
                self._join_adopted(entry)
            if acked:
                # what the kubelet really allocated is the truth; re-account if it differs
                self._account_from(entry, info, node, None, ack)
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
        request, placement = self._holding(info, node, view, assignment, ack)
        key = f"{(obj.get('metadata') or {}).get('namespace', '')}/{(obj.get('metadata') or {}).get('name', '')}"
        entry = PodEntry(uid, key, node, request, placement, Phase.CONFIRMED, ours, self.clock(), rv, pending=pending)
        describe(entry, obj)
        if view is None:
            entry.unresolved = info
        elif acked:
            entry.accounted_from = self._source(ack, view)
        if assignment is not None and pending and not acked and assignment.pod_uid == uid and self.needs_gate(node):
            entry.shapes = frozenset(assignment.shapes())
            entry.gate_since = self.clock()  # e.g. after a restart: still waiting for the plugin
            self._occupy(entry, entry.shapes)
        self.pods[uid] = entry
        self._tell(entry)
        self.by_node[node].add(uid)
        self.replacement_seen(entry)  # a mirrored reservation it fills ends before it is accounted
        self._apply(entry)
        if entry.evicting_for == TERMINATING:
            self._join_adopted(entry)
        return PodUpdate(gone=True)

    def _holding(
        self, info: PodInfo, node: str, view: NodeView | None, assignment: Assignment | None, ack: Any
    ) -> tuple[PodRequest, Placement]:
        """What a bound pod holds: from its assignment or ack; else a guess on the node."""
        try:
            plan = self.plan(info, strict=False)
        except InvalidPod:
            return PodRequest(name=info.name or "?"), Placement(node=node)
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
        return without_gpus(request), Placement(node=node)

    def _source(self, ack: Any, view: NodeView) -> tuple[Any, ...]:
        """What a placement read from `ack` depends on: the same source gives the same placement."""
        return ack, view.spec, self.facts, self.classes_generation

    def _account_from(self, entry: PodEntry, info: PodInfo, node: str, assignment: Any, ack: Any) -> None:
        view = self.nodes.get(node)
        if view is None:
            return
        source = self._source(ack, view)
        if entry.accounted_from == source:
            return  # this ack was followed on this node already: nothing to re-read
        entry.accounted_from = source
        try:
            plan = self.plan(info, strict=False)
        except InvalidPod:
            return
        found = placement_from_annotations(plan, view.spec, assignment, ack)
        if found is None:
            return
        request, placement = found
        if devices(placement) == devices(entry.placement):
            return
        log.info("pod %s: the kubelet allocated %s, accounted %s; following the kubelet",
                 entry.key, devices(placement), devices(entry.placement))
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
        entry = PodEntry(plan.uid, plan.key, placement.node, plan.request, placement, Phase.ASSUMED, True, self.clock(),
                         owner=plan.owner)
        self.pods[plan.uid] = entry
        self._tell(entry)
        self.by_node[placement.node].add(plan.uid)
        self._apply(entry)
        if self.needs_gate(placement.node):
            self._occupy(entry, plan_shapes(plan))  # on its way to the gate
        return entry

    def forget(self, uid: str) -> PodEntry | None:
        entry = self._unlink(uid)
        if entry is not None:
            self._unapply(entry)
            nomination = self.nominations.get(entry.evicting_for or "")
            if nomination is not None:
                nomination.victims.discard(uid)
        return entry
