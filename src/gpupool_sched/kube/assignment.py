"""Placement <-> the handshake's per-container Assignment (docs/handshake.md).

The placement core decides per pod: which GPUs hold its whole shape, which GPU its memory share, which
MIG devices. The kubelet allocates per container, so `build_assignment` splits the pod's devices over
its containers the way the kubelet will ask for them (handshake rules 2 and 3), and
`placement_from_annotations` folds what a bound pod's containers hold back into one placement, for
rebuilding the scheduler's state after a restart and for pods of other schedulers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from gpupool_common.handshake import AllocationAck, Assignment, ContainerAssignment, MemoryShare
from gpupool_sched.kube.containers import MIG_PREFIX, RESOURCE_GPU, RESOURCE_MEMORY, ContainerDemand
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, GpuShape, PodRequest

_GPU_FIELDS = frozenset({"name", "gpu_count", "gpu_milli", "gpu_memory_mib", "mig_profile", "mig_count", "extra"})


def build_assignment(plan: PodPlan, placement: Placement, node: NodeSpec) -> Assignment:
    """The assignment to bind `plan` with: every container that requests a plugin resource, with
    exactly its own count of the placement's devices.

    Whole GPUs and MIG devices go to the app and sidecar containers in kubelet order, in consecutive
    chunks; a non-restartable init container gets the first devices of the next container that asks
    for the same resource (the kubelet reuses them for it). Every memory container gets its own units
    of the share's one GPU. A placement that does not match the plan raises ValueError (a bug)."""
    if placement.node != node.name:
        raise ValueError(f"pod {plan.key}: placement is on node {placement.node!r}, got the spec of {node.name!r}")
    shapes = plan.request.gpu_shapes()
    parts = (placement, *placement.extras)
    if not shapes and not (placement.extras or placement.gpu_indices or placement.mig_devices):
        parts = ()  # a pod without GPUs: the placement names the node only
    if len(parts) != len(shapes):
        raise ValueError(f"pod {plan.key}: {len(shapes)} GPU shape(s) but a placement of {len(parts)} part(s)")
    pools: dict[str, list[str]] = {}
    share_gpu: str | None = None
    for shape, part in zip(shapes, parts, strict=True):
        if shape.wants_mig:
            pools[MIG_PREFIX + str(shape.mig_profile)] = _mig_ids(plan, shape, part, node)
        elif shape.is_whole:
            if len(set(part.gpu_indices)) != shape.gpu_count or len(part.gpu_indices) != shape.gpu_count:
                raise ValueError(f"pod {plan.key}: {shape.gpu_count} whole GPU(s) placed on GPUs {part.gpu_indices}")
            pools[RESOURCE_GPU] = [_gpu(plan, node, i).uuid for i in part.gpu_indices]
        elif shape.gpu_memory_mib:
            if len(part.gpu_indices) != 1:
                raise ValueError(f"pod {plan.key}: a memory share placed on GPUs {part.gpu_indices}")
            wanted = plan.memory_units() * plan.memory_unit_mib
            if not shape.gpu_memory_mib == part.gpu_memory_mib == wanted:
                raise ValueError(f"pod {plan.key}: share of {part.gpu_memory_mib} MiB placed, but its containers "
                                 f"ask for {plan.memory_units()} units of {plan.memory_unit_mib} MiB")
            share_gpu = _gpu(plan, node, part.gpu_indices[0]).uuid
        else:
            raise ValueError(f"pod {plan.key}: {shape.describe()} has no device plugin resource")

    cursor = dict.fromkeys(pools, 0)
    containers: list[ContainerAssignment] = []
    for c in plan.containers:
        devices: dict[str, tuple[str, ...]] = {}
        for resource, n in c.counts().items():
            if resource == RESOURCE_MEMORY:
                continue
            pool = pools.get(resource)
            start = cursor.get(resource, 0)
            if pool is None or start + n > len(pool):
                have = 0 if pool is None else len(pool) - start
                raise ValueError(f"pod {plan.key}: container {c.name!r} asks for {n} {resource}, "
                                 f"the placement has {have} left for it")
            devices[resource] = tuple(pool[start:start + n])
            if not c.reuses_devices:  # an init container's devices are the next container's first ones
                cursor[resource] = start + n
        memory = None
        if c.memory_units:
            if share_gpu is None:
                raise ValueError(f"pod {plan.key}: container {c.name!r} asks for {RESOURCE_MEMORY}, "
                                 "the placement has no share")
            memory = MemoryShare(gpu=share_gpu, units=c.memory_units, unit_mib=plan.memory_unit_mib)
        if devices or memory is not None:
            containers.append(ContainerAssignment(name=c.name, devices=devices, memory=memory))
    for resource, pool in pools.items():
        if cursor[resource] != len(pool):
            raise ValueError(f"pod {plan.key}: the placement has {len(pool)} {resource} but the containers "
                             f"take {cursor[resource]}")
    if share_gpu is not None and not any(c.memory_units for c in plan.containers):
        raise ValueError(f"pod {plan.key}: the placement has a memory share no container asks for")
    return Assignment(node=node.name, pod_uid=plan.uid, containers=tuple(containers))


def _gpu(plan: PodPlan, node: NodeSpec, index: int) -> GpuSpec:
    if not 0 <= index < len(node.gpus):
        raise ValueError(f"pod {plan.key}: node {node.name} has no GPU {index}")
    gpu = node.gpus[index]
    if not gpu.uuid:
        raise ValueError(f"pod {plan.key}: GPU {index} of node {node.name} has no UUID")
    return gpu


def _mig_ids(plan: PodPlan, shape: GpuShape, part: Placement, node: NodeSpec) -> list[str]:
    profiles = {s.uuid: s.profile for g in node.gpus for s in g.mig_slices}
    ids = list(part.mig_devices)
    if len(set(ids)) != len(ids) or len(ids) != shape.mig_count:
        raise ValueError(f"pod {plan.key}: {shape.mig_count} MIG {shape.mig_profile} placed as {ids}")
    wrong = [u for u in ids if profiles.get(u) != shape.mig_profile]
    if wrong:
        raise ValueError(f"pod {plan.key}: {wrong} are not {shape.mig_profile} devices of node {node.name}")
    return ids


# ---- what a bound pod holds ----------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Held:
    """Devices of one pod on one node, by kind."""

    whole: set[int] = dataclasses.field(default_factory=set)  # GPU indices
    units: dict[int, int] = dataclasses.field(default_factory=dict)  # GPU index -> memory units
    unit_mib: int = 0
    mig: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # profile -> MIG UUIDs

    def empty(self) -> bool:
        return not (self.whole or self.units or self.mig)


def placement_from_annotations(
    plan: PodPlan, node: NodeSpec, assignment: Assignment | None, ack: AllocationAck | None
) -> tuple[PodRequest, Placement] | None:
    """What a pod bound to `node` holds, as the (request, placement) to account with
    `snapshot.assume(request, placement)`; None when nothing is known (the caller guesses).

    Sources, most truthful first (each only if its pod_uid and node match):
      1. a complete ack without error: what the kubelet allocated, container by container;
      2. the assignment: what the kubelet will allocate (or did, when the ack is still partial);
      3. a partial ack (pods of other schedulers, or a refused Allocate).
    Device IDs the node does not have are ignored. The devices decide over the pod's spec: the
    request returned is `plan.request` when they agree and otherwise `plan.request` with its GPU
    shapes replaced by what is held (e.g. an ack of 2 GPUs for a 1-GPU pod accounts 2). A pod without
    GPU demand and without known devices holds CPU and memory only: (plan.request, bare placement).
    Several containers' devices count once each (init containers hand theirs on to later ones); a
    memory share on more than one GPU, which the plugin refuses, counts only on the GPU with most units,
    and units on a GPU the pod also holds whole do not count (the whole GPU already covers them).
    """
    ack_ok = ack is not None and ack.pod_uid == plan.uid and ack.node == node.name
    assignment_ok = assignment is not None and assignment.pod_uid == plan.uid and assignment.node == node.name
    held: _Held | None = None
    if ack_ok and ack is not None and ack.complete and not ack.error:
        held = _from_ack(plan, ack, node)
    elif assignment_ok and assignment is not None:
        held = _from_assignment(plan, assignment, node)
    elif ack_ok and ack is not None:
        held = _from_ack(plan, ack, node)
    if held is None or held.empty():
        if plan.request.gpu_shapes():
            return None
        return plan.request, Placement(node=node.name)
    return _account(plan, held, node)


def _from_assignment(plan: PodPlan, assignment: Assignment, node: NodeSpec) -> _Held:
    by_uuid, mig_profile = _node_ids(node)
    order = {c.name: c for c in plan.containers}
    held = _Held(unit_mib=plan.memory_unit_mib)
    units: list[tuple[ContainerDemand | None, int, int]] = []  # (container, GPU, units)
    for ca in assignment.containers:
        for resource, ids in ca.devices.items():
            if resource == RESOURCE_GPU or resource.startswith(MIG_PREFIX):
                _add_devices(held, ids, by_uuid, mig_profile)
        if ca.memory is not None and ca.memory.gpu in by_uuid:
            held.unit_mib = ca.memory.unit_mib
            units.append((order.get(ca.name), by_uuid[ca.memory.gpu], ca.memory.units))
    for gpu in {g for _, g, _ in units}:
        held.units[gpu] = _pod_units([(c, n) for c, g, n in units if g == gpu], plan.containers)
    return held


def _pod_units(entries: list[tuple[ContainerDemand | None, int]], order: tuple[ContainerDemand, ...]) -> int:
    """Units the pod holds on one GPU: kube's max(init containers, app + sidecar containers), where an
    init container runs beside the sidecars started before it."""
    rank = {c.name: i for i, c in enumerate(order)}
    entries = sorted(entries, key=lambda e: len(order) if e[0] is None else rank.get(e[0].name, len(order)))
    total = sidecars = peak = 0
    for c, n in entries:
        if c is not None and c.reuses_devices:
            peak = max(peak, sidecars + n)
        else:
            total += n
            if c is not None and c.sidecar:
                sidecars += n
    return max(total, peak)


def _from_ack(plan: PodPlan, ack: AllocationAck, node: NodeSpec) -> _Held:
    by_uuid, mig_profile = _node_ids(node)
    held = _Held(unit_mib=plan.memory_unit_mib)
    unit_ids: dict[int, set[str]] = {}
    for resources in ack.containers.values():
        for resource, ids in resources.items():
            if resource == RESOURCE_MEMORY:
                for unit in ids:
                    gpu = by_uuid.get(unit.rsplit("::", 1)[0]) if "::" in unit else None
                    if gpu is not None:
                        unit_ids.setdefault(gpu, set()).add(unit)
            elif resource == RESOURCE_GPU or resource.startswith(MIG_PREFIX):
                _add_devices(held, ids, by_uuid, mig_profile)
    held.units = {gpu: len(ids) for gpu, ids in unit_ids.items()}
    return held


def _node_ids(node: NodeSpec) -> tuple[dict[str, int], dict[str, str]]:
    """GPU UUID -> index (GPUs that can be held whole or shared), MIG UUID -> profile."""
    by_uuid = {g.uuid: g.index for g in node.gpus if g.uuid and not g.mig_enabled}
    mig_profile = {s.uuid: s.profile for g in node.gpus for s in g.mig_slices}
    return by_uuid, mig_profile


def _add_devices(held: _Held, ids: Iterable[str], by_uuid: Mapping[str, int], mig_profile: Mapping[str, str]) -> None:
    # by ID, not by resource name: under migStrategy=single nvidia.com/gpu lists MIG devices
    for device in ids:
        if device in by_uuid:
            held.whole.add(by_uuid[device])
        elif device in mig_profile:
            held.mig.setdefault(mig_profile[device], set()).add(device)


def _account(plan: PodPlan, held: _Held, node: NodeSpec) -> tuple[PodRequest, Placement]:
    parts: list[tuple[GpuShape, Placement]] = []
    if held.whole:
        indices = tuple(sorted(held.whole))
        first = node.gpus[indices[0]]
        parts.append((GpuShape(gpu_count=len(indices), gpu_milli=MILLI),
                      Placement(node.name, indices, MILLI, first.memory_mib)))
    shared = {g: n for g, n in held.units.items() if g not in held.whole and n > 0}
    if shared:
        gpu = min(shared, key=lambda g: (-shared[g], g))
        mib = shared[gpu] * held.unit_mib
        parts.append((GpuShape(gpu_count=1, gpu_memory_mib=mib),
                      Placement(node.name, (gpu,), share_milli(mib, node.gpus[gpu]), mib)))
    for profile, uuids in sorted(held.mig.items()):
        parts.append((GpuShape(mig_profile=profile, mig_count=len(uuids)),
                      Placement(node.name, mig_devices=tuple(sorted(uuids)))))
    parts.sort(key=lambda p: p[0].order_key())
    shapes = tuple(s for s, _ in parts)
    request = plan.request
    if shapes != request.gpu_shapes():
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(PodRequest) if f.name not in _GPU_FIELDS}
        request = PodRequest.of_shapes(request.name, shapes, **fields)
    primary = dataclasses.replace(parts[0][1], extras=tuple(p for _, p in parts[1:]))
    return request, primary


def share_milli(mib: int, gpu: GpuSpec) -> int:
    """Milli-GPU a memory share of `mib` takes on `gpu`, as the placement core computes it; capped at a
    whole GPU, and a whole GPU when the GPU's memory is unknown (a held share must never look free)."""
    if gpu.memory_mib <= 0:
        return MILLI
    return min(MILLI, max(1, mib * MILLI // gpu.memory_mib))
