"""The ledger's records: a pod entry and its phase, a preemptor's nomination, what one pod event changed,
and the helpers that read them off pod objects (handshake annotations, grace periods, timestamps)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from gpupool_common.handshake import Assignment, HandshakeError, parse_ack, parse_assignment
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import PodPlan, controller_of, controller_ref, controlling_job
from gpupool_sched.model.cluster import NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest

log = logging.getLogger(__name__)

TERMINAL_PHASES = ("Succeeded", "Failed")
CHECKPOINT_GRACE = "gpupool.io/checkpoint-grace-seconds"
IDLE_RECLAIM = "gpupool.io/idle-reclaim"  # "never": never reclaimed for being idle (docs/idle-and-elastic.md)
MOVABLE = "gpupool.io/movable"  # "true": may be moved to defragment; "false": never (docs/defragmentation.md)
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
    RESERVED = "reserved"  # a migration's destination, held for the mover's replacement


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
    unresolved: PodInfo | None = None  # the pod, while its node is unknown (devices told later)
    accounted_from: tuple[Any, ...] | None = None  # (ack, node spec, facts, classes) last read from
    labels: Mapping[str, str] = field(default_factory=dict)  # for PodDisruptionBudget selectors
    started: float = 0.0  # status.startTime (else creation), seconds since the epoch: preemption's age
    grace_s: int | None = None  # gpupool.io/checkpoint-grace-seconds: the eviction's grace period
    pod_grace_s: int | None = None  # spec.terminationGracePeriodSeconds (the grace without the annotation)
    deletion_grace_s: int | None = None  # metadata.deletionGracePeriodSeconds: the grace it is terminating with
    evicting_for: str | None = None  # UID of the preemptor this pod is being evicted for
    uncertain: bool = False  # its Binding's outcome is unknown (answer lost, or never seen bound): being read
    owner: str = ""  # its controller, "Kind/namespace/name" (kube/podspec.controller_of; "" for a bare pod)
    movable: bool | None = None  # gpupool.io/movable: True / False when the pod says so, else None
    job: str = ""  # UID of the batch/v1 Job that controls it ("" when none): its podFailurePolicy decides movable
    ready: bool = False  # condition Ready is True (a surge waits for its new replica's: writer/surge.py)
    idle_never: bool = False  # gpupool.io/idle-reclaim: "never" (never reclaimed for being idle)
    # victims.running_pods' memo: (the inputs it was built from, the RunningPod); rebuilt when any differs
    victim_memo: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)


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
class Tombstone:
    resource_version: int
    at: float


def resource_version(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


def describe(entry: PodEntry, obj: Mapping[str, Any]) -> None:
    """What preemption needs of a bound pod beyond its resources: labels, start, checkpoint grace."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels")
    entry.labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}
    started = timestamp((obj.get("status") or {}).get("startTime")) or timestamp(meta.get("creationTimestamp"))
    entry.started = started or entry.started or time.time()
    entry.grace_s = checkpoint_grace(meta.get("annotations"))
    entry.pod_grace_s = seconds((obj.get("spec") or {}).get("terminationGracePeriodSeconds"))
    entry.deletion_grace_s = seconds(meta.get("deletionGracePeriodSeconds"))
    ref = controller_ref(meta)
    entry.owner = controller_of(meta, ref) if ref is not None else ""
    entry.job = controlling_job(ref)
    said = (meta.get("annotations") or {}).get(MOVABLE) if isinstance(meta.get("annotations"), Mapping) else None
    entry.movable = True if said == "true" else False if said == "false" else None
    entry.idle_never = isinstance(meta.get("annotations"), Mapping) and \
        meta["annotations"].get(IDLE_RECLAIM) == "never"
    conditions = (obj.get("status") or {}).get("conditions")
    entry.ready = isinstance(conditions, list) and any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
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


def seconds(value: Any) -> int | None:
    """A non-negative integer field (a grace period), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def timestamp(text: Any) -> float:
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def handshake(obj: Mapping[str, Any], uid: str) -> tuple[Assignment | None, Any]:
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


def devices(p: Placement) -> tuple[Any, ...]:
    parts = (p, *p.extras)
    return tuple((q.gpu_indices, q.gpu_milli, q.gpu_memory_mib, q.mig_devices) for q in parts)


def without_gpus(request: PodRequest) -> PodRequest:
    return PodRequest(
        name=request.name, cpu_milli=request.cpu_milli, memory_mib=request.memory_mib,
        priority=request.priority, kind=request.kind, namespace=request.namespace,
    )


def fits_layout(placement: Placement, spec: NodeSpec) -> bool:
    mig = {s.uuid for g in spec.gpus for s in g.mig_slices}
    for part in (placement, *placement.extras):
        if any(j >= len(spec.gpus) for j in part.gpu_indices):
            return False
        if any(d not in mig for d in part.mig_devices):
            return False
    return True


