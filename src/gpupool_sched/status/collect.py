"""Listed cluster objects -> the status report.

Nothing here reads a GPU's use a second way: the nodes and pods go through the scheduler's own
`ClusterState` (`apply_node`, `apply_pod`: the inventory annotation, the assignment and ack
annotations, the guess for pods of other schedulers), in the order the scheduler's start-up LIST
feeds them, so the snapshot is the one a scheduler started now would build. The fragmentation figure
is the core's `cluster_fragmentation_milli` on that snapshot, with the workload profile built the way
the scheduler builds it (a `RollingProfile`: the built-in prior until 50 pods were seen).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpupool_sched.cache.entries import TERMINAL_PHASES, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.kube.podspec import InvalidPod
from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.placement.workload import RollingProfile, typical_gpu_memory_mib
from gpupool_sched.status.model import (
    ClusterStatus,
    Fragmentation,
    GpuStatus,
    GpuUse,
    MigSliceStatus,
    NodeStatus,
    PendingGroup,
    Totals,
)

Obj = Mapping[str, Any]
GPU_RESOURCE_PREFIX = "nvidia.com/"


@dataclass(frozen=True, slots=True)
class Listing:
    """What one read of the API server returned."""

    nodes: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    priority_classes: list[dict[str, Any]]


def build_state(listing: Listing, scheduler_name: str, memory_unit_mib: int) -> ClusterState:
    """The scheduler's live state, fed as its start-up resync feeds it: classes, nodes, then pods."""
    state = ClusterState(scheduler_name, memory_unit_mib=memory_unit_mib)
    for obj in listing.priority_classes:
        name = (obj.get("metadata") or {}).get("name")
        try:
            value = int(obj.get("value", 0))
        except (TypeError, ValueError):
            continue
        if name:
            state.priority_classes[str(name)] = value
    for obj in listing.nodes:
        state.apply_node(obj)
    for obj in listing.pods:
        state.apply_pod(obj)
    return state


def collect(
    listing: Listing,
    *,
    scheduler_name: str = "gpupool",
    memory_unit_mib: int = 1024,
    server: str = "",
    selector: str | None = None,
    now: float | None = None,
) -> ClusterStatus:
    now = datetime.now(UTC).timestamp() if now is None else now
    state = build_state(listing, scheduler_name, memory_unit_mib)
    pending = [p for p in listing.pods if is_pending_gpu_pod(p, scheduler_name)]
    nodes = [_node_status(view, state) for _, view in sorted(state.nodes.items())]
    groups = _pending_groups(pending, state.priority_classes, now)
    return ClusterStatus(
        generated_at=datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        server=server,
        scheduler_name=scheduler_name,
        memory_unit_mib=memory_unit_mib,
        selector=selector,
        totals=_totals(nodes, len(pending), state.unknown_devices),
        fragmentation=_fragmentation(state, pending),
        pending=groups,
        nodes=nodes,
    )


# ---- pending pods --------------------------------------------------------------------------------
def is_pending_gpu_pod(obj: Obj, scheduler_name: str) -> bool:
    """Not bound, not ended, not being deleted; and either ours or asking for a GPU resource (pods of
    kube-scheduler with the gpupool extender)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    phase = (obj.get("status") or {}).get("phase") or "Pending"
    if spec.get("nodeName") or phase in TERMINAL_PHASES or phase != "Pending" or meta.get("deletionTimestamp"):
        return False
    return spec.get("schedulerName") == scheduler_name or _asks_gpu(spec)


def _asks_gpu(spec: Obj) -> bool:
    for container in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        resources = container.get("resources") if isinstance(container, Mapping) else None
        if not isinstance(resources, Mapping):
            continue
        for kind in ("requests", "limits"):
            amounts = resources.get(kind)
            if isinstance(amounts, Mapping) and any(str(r).startswith(GPU_RESOURCE_PREFIX) for r in amounts):
                return True
    return False


def pod_priority(obj: Obj, classes: Mapping[str, int]) -> int:
    """spec.priority (the API server's Priority admission sets it), else the class's value, else 0:
    as the scheduler queues a pod."""
    spec = obj.get("spec") or {}
    priority = spec.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):
        return priority
    return classes.get(str(spec.get("priorityClassName") or ""), 0)


def _created(obj: Obj) -> float | None:
    text = (obj.get("metadata") or {}).get("creationTimestamp")
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _pending_groups(pods: Iterable[Obj], classes: Mapping[str, int], now: float) -> list[PendingGroup]:
    groups: dict[tuple[int, str | None], list[tuple[float, str]]] = defaultdict(list)
    for obj in pods:
        pcn = (obj.get("spec") or {}).get("priorityClassName") or None
        created = _created(obj)
        groups[(pod_priority(obj, classes), pcn)].append((now if created is None else created, _key(obj)))
    out = []
    for (priority, pcn), members in groups.items():
        created, key = min(members)
        out.append(PendingGroup(priority=priority, priority_class=pcn, pods=len(members),
                                oldest_age_seconds=max(0.0, now - created), oldest_pod=key))
    out.sort(key=lambda g: (-g.priority, g.priority_class or ""))
    return out


# ---- nodes and GPUs ------------------------------------------------------------------------------
@dataclass
class _Held:
    whole: list[str]
    units: dict[str, int]  # pod -> units


def _holders(entries: Iterable[PodEntry], unit_mib: int) -> tuple[dict[int, _Held], dict[str, str]]:
    """Per GPU index who holds it whole or shares it, per MIG UUID the pod holding it: from the
    placements the state accounts on the snapshot."""
    gpus: dict[int, _Held] = defaultdict(lambda: _Held([], {}))
    migs: dict[str, str] = {}
    for entry in sorted(entries, key=lambda e: e.key):
        if not entry.applied:
            continue
        for part in entry.placement.parts():
            for index in part.gpu_indices:
                held = gpus[index]
                if part.gpu_milli >= MILLI:
                    held.whole.append(entry.key)
                else:
                    held.units[entry.key] = held.units.get(entry.key, 0) + part.gpu_memory_mib // unit_mib
            for uuid in part.mig_devices:
                migs[uuid] = entry.key
    return gpus, migs


def _node_status(view: NodeView, state: ClusterState) -> NodeStatus:
    inventory = view.inventory
    held, migs = _holders(state.entries(view.name), state.memory_unit_mib)
    bad = set(inventory.unhealthy) if inventory is not None else set()
    gpus: list[GpuStatus] = []
    for gpu in inventory.gpus if inventory is not None else ():
        h = held.get(gpu.index) or _Held([], {})
        slices = [
            MigSliceStatus(uuid=d.uuid, profile=d.profile, health="unhealthy" if d.uuid in bad else "healthy",
                           pod=migs.get(d.uuid))
            for d in (gpu.mig_devices if gpu.mig_enabled else ())
        ]
        units_total = gpu.memory_mib // view.unit_mib if view.memory_shares and view.unit_mib else 0
        use: GpuUse = "mig" if gpu.mig_enabled else "whole" if h.whole else "shared" if h.units else "free"
        gpus.append(GpuStatus(
            index=gpu.index, uuid=gpu.uuid, model=gpu.product, memory_mib=gpu.memory_mib,
            health="unhealthy" if gpu.uuid in bad else "healthy", use=use,
            memory_units_used=sum(h.units.values()), memory_units_total=0 if gpu.mig_enabled else units_total,
            pods=[*h.whole, *sorted(h.units)], mig=slices,
        ))
    uses = Counter(g.use for g in gpus)
    models = Counter(g.model for g in gpus)
    return NodeStatus(
        name=view.name,
        model=models.most_common(1)[0][0] if models else "",
        schedulable=not view.spec.unschedulable,
        inventory_problem=view.problem,
        memory_unit_mib=view.unit_mib,
        gpus=len(gpus),
        whole=uses["whole"],
        shared=uses["shared"],
        free=sum(1 for g in gpus if g.use == "free" and g.health == "healthy"),
        mig=uses["mig"],
        unhealthy=sum(1 for g in gpus if g.health == "unhealthy"),
        memory_units_used=sum(g.memory_units_used for g in gpus),
        memory_units_total=sum(g.memory_units_total for g in gpus),
        mig_slices_used=sum(1 for g in gpus for s in g.mig if s.pod is not None),
        mig_slices_total=sum(len(g.mig) for g in gpus),
        gpu_list=gpus,
    )


def _totals(nodes: list[NodeStatus], pending: int, unknown: int) -> Totals:
    def total(field: str) -> int:
        return sum(int(getattr(n, field)) for n in nodes)

    return Totals(
        nodes=len(nodes), gpus=total("gpus"), whole=total("whole"), shared=total("shared"), free=total("free"),
        mig=total("mig"), unhealthy=total("unhealthy"), memory_units_used=total("memory_units_used"),
        memory_units_total=total("memory_units_total"), mig_slices_used=total("mig_slices_used"),
        mig_slices_total=total("mig_slices_total"), pending_pods=pending, unknown_device_pods=unknown,
    )


# ---- fragmentation -------------------------------------------------------------------------------
def observed_profile(state: ClusterState, pending: Iterable[Obj]) -> RollingProfile:
    """The workload profile as a scheduler started now would learn it: every pod accounted on a node
    (oldest first), then its own pending pods in queue order (highest priority, then oldest, first)."""
    profile = RollingProfile(typical_gpu_memory_mib=typical_gpu_memory_mib(v.spec for v in state.nodes.values()))
    for entry in sorted((e for e in state.pods.values() if e.applied), key=lambda e: (e.started, e.key)):
        profile.observe(entry.request)
    ours = [p for p in pending if (p.get("spec") or {}).get("schedulerName") == state.scheduler_name]
    ours.sort(key=lambda p: (-pod_priority(p, state.priority_classes), _created(p) or 0.0, _key(p)))
    for obj in ours:
        try:
            profile.observe(state.plan(obj).request)
        except InvalidPod:
            continue  # the scheduler never learns from a pod it cannot plan
    return profile


def _fragmentation(state: ClusterState, pending: Iterable[Obj]) -> Fragmentation:
    rolling = observed_profile(state, pending)
    snap = state.snapshot
    total = snap.total_gpu_milli
    frag = cluster_fragmentation_milli(snap, rolling.profile()) if total else 0.0
    return Fragmentation(
        percent=100.0 * frag / total if total else 0.0,
        gpus=frag / MILLI,
        allocated_percent=100.0 * snap.used_gpu_milli() / total if total else 0.0,
        profile="observed" if rolling.version > 0 else "prior",
        pods_observed=rolling.seen,
    )
