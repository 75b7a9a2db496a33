"""One scheduling cycle: filter, score, pick the node, pick its GPUs. Pure: data in, decision out.

Multi-shape pods (whole GPUs and a share and/or MIG devices on one node, see ``PodRequest.extra``)
go through the same cycle for their primary shape; the nodes that pass the filter chain must also
fit every shape together (``GpuShapesFit``), and the extra shapes are placed on the chosen node
after the policy chose the primary's GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypedDict

import numpy as np

from gpupool_common.gpu_sets import best_gpu_set
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Decision, Placement, Unschedulable
from gpupool_sched.model.request import GpuShape, PodRequest
from gpupool_sched.placement.filters import GpuShapesFit, shape_states
from gpupool_sched.placement.framework import CycleState, FilterPlugin, Policy

MAX_NODE_SCORE = 100

# Feasible node indices (ascending) -> the non-empty subset to score.
NodeSample = Callable[[np.ndarray], np.ndarray]

_SHAPES_FIT = GpuShapesFit()


def _applies(plugin: FilterPlugin, state: CycleState) -> bool:
    """``applies_to(state)`` when the plugin has it (filters whose relevance depends on the cluster,
    e.g. no node is tainted), else ``applies(request)``."""
    hook = getattr(plugin, "applies_to", None)
    return bool(hook(state)) if hook is not None else plugin.applies(state.request)


def feasible_nodes(state: CycleState, policy: Policy) -> tuple[np.ndarray, np.ndarray | None]:
    """Indices of nodes that pass every filter, and (when none does) each node's first failing filter."""
    n = len(state.snapshot)
    ok = np.ones(n, dtype=bool)
    first_fail = None
    for i, plugin in enumerate(policy.filters):
        if not _applies(plugin, state):
            continue
        passed = plugin.passes(state)
        newly_failed = ok & ~passed
        if newly_failed.any():
            if first_fail is None:
                first_fail = np.full(n, -1, dtype=np.int64)
            first_fail[newly_failed] = i
            ok &= passed
    return np.flatnonzero(ok), first_fail


def normalize_scores(scores: np.ndarray) -> np.ndarray:
    """Min-max scale to 0..MAX_NODE_SCORE with integer truncation, as kube-scheduler plugins do."""
    lo, hi = scores.min(), scores.max()
    if hi == lo:
        return np.zeros_like(scores)
    return np.floor_divide((scores - lo) * MAX_NODE_SCORE, hi - lo)  # type: ignore[no-any-return]


def decide(
    snapshot: ClusterSnapshot,
    request: PodRequest,
    policy: Policy,
    rng: np.random.Generator | None = None,
    *,
    sample: NodeSample | None = None,
) -> Decision:
    """Place ``request`` on ``snapshot`` according to ``policy``. Nodes and allocations are not
    modified; derived data may be cached in ``snapshot.caches`` (see ClusterSnapshot on threads).

    ``sample`` (kube-scheduler's percentageOfNodesToScore) picks which feasible nodes are scored;
    by default all of them are."""
    state = CycleState(snapshot, request, rng)
    candidates, first_fail = feasible_nodes(state, policy)
    if request.extra and candidates.size:
        together = _SHAPES_FIT.passes(state, candidates)
        if not together.all():
            if first_fail is None:
                first_fail = np.full(len(snapshot), -1, dtype=np.int64)
            first_fail[candidates[~together]] = len(policy.filters)
            candidates = candidates[together]
    if candidates.size == 0:
        reasons = tuple(f.reason(request) for f in policy.filters)
        if request.extra:
            reasons += (_SHAPES_FIT.reason(request),)
        return Unschedulable(snapshot.node_names, reasons, first_fail if first_fail is not None else np.zeros(0, int))
    if sample is not None:
        candidates = sample(candidates)

    total = np.zeros(candidates.size, dtype=np.float64)
    parts: dict[str, np.ndarray] = {}
    for plugin, weight in policy.scorers:
        s = plugin.score(state, candidates).astype(np.float64)
        if plugin.normalize:
            s = normalize_scores(s)
        parts[plugin.name] = s * weight
        total += parts[plugin.name]

    best = np.flatnonzero(total == total.max())
    if best.size > 1:
        if policy.random_tie_break:
            best = best[[int(state.rng.integers(best.size))]]
        else:
            best = best[[int(np.argmin(snapshot.tie_rank[candidates[best]]))]]
    k = int(best[0])
    node = int(candidates[k])
    gpus = policy.gpu_selector.select(state, node) if request.wants_gpu else ()
    milli, mem = state.gpu_take
    if request.wants_mig:
        placement = Placement(
            node=snapshot.nodes[node].name,
            mig_devices=gpus_to_mig(snapshot, node, request),
            score=float(total[k]),
            breakdown={name: float(v[k]) for name, v in parts.items()},
        )
    else:
        g0 = gpus[0] if gpus else 0
        placement = Placement(
            node=snapshot.nodes[node].name,
            gpu_indices=gpus,
            gpu_milli=int(milli[node, g0]) if gpus else 0,
            gpu_memory_mib=int(mem[node, g0]) if gpus else 0,
            score=float(total[k]),
            breakdown={name: float(v[k]) for name, v in parts.items()},
        )
    if request.extra:
        placement = place_extras(state, node, placement)
    return placement


def gpus_to_mig(
    snapshot: ClusterSnapshot,
    node: int,
    request: PodRequest,
    *,
    shape: GpuShape | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> tuple[str, ...]:
    """Free MIG devices of the wanted profile, packing onto GPUs that already have slices in use.

    ``shape`` overrides the request's primary MIG demand (profile and count); devices in ``exclude``
    (taken by another shape of the same pod) are neither offered nor counted as free, but count as
    in use for packing."""
    profile = shape.mig_profile if shape is not None else request.mig_profile
    count = shape.mig_count if shape is not None else request.mig_count
    spec = snapshot.nodes[node]
    taken = snapshot.mig_taken[node] | exclude if exclude else snapshot.mig_taken[node]
    allowed = set(request.gpu_models)
    by_gpu: list[tuple[int, int, list[str]]] = []
    for gpu in spec.gpus:
        if (allowed and gpu.model not in allowed) or not gpu.healthy:
            continue
        free = [s.uuid for s in gpu.mig_slices if s.profile == profile and s.uuid not in taken]
        used = sum(1 for s in gpu.mig_slices if s.uuid in taken)
        if free:
            by_gpu.append((-used, gpu.index, free))
    by_gpu.sort()
    out: list[str] = []
    for _, _, free in by_gpu:
        out.extend(free[: count - len(out)])
        if len(out) == count:
            break
    return tuple(out)


# ---- multi-shape pods ---------------------------------------------------------------------------
Choice = tuple[tuple[int, ...], tuple[str, ...]]  # GPU indices, MIG devices


class _PartFields(TypedDict):
    """The Placement fields of one GPU shape's part."""

    gpu_indices: tuple[int, ...]
    gpu_milli: int
    gpu_memory_mib: int
    mig_devices: tuple[str, ...]


def place_extras(state: CycleState, node: int, primary: Placement) -> Placement:
    """``primary`` with the request's extra shapes placed on the same node, on GPUs and devices the
    primary does not use. Should the policy's GPUs for the primary leave no room for them (e.g. it took
    the one free GPU a memory share fits on), every shape is re-chosen together instead."""
    choices = _assign(state, node, (primary.gpu_indices, primary.mig_devices))
    if choices is None:
        choices = _assign(state, node, None)
        if choices is None:  # GpuShapesFit passed this node, so some assignment exists
            raise AssertionError(f"pod {state.request.name}: no joint GPU assignment on a node that fits it")
        primary = replace(primary, **_part_fields(state, 0, node, choices[0]))
    name = primary.node
    extras = tuple(Placement(node=name, **_part_fields(state, k, node, c)) for k, c in enumerate(choices) if k)
    return replace(primary, extras=extras)


def _part_fields(state: CycleState, k: int, node: int, choice: Choice) -> _PartFields:
    gpus, devices = choice
    if devices:
        return {"gpu_indices": (), "gpu_milli": 0, "gpu_memory_mib": 0, "mig_devices": devices}
    milli, mem = shape_states(state)[k].gpu_take
    g0 = gpus[0] if gpus else 0
    return {
        "gpu_indices": gpus,
        "gpu_milli": int(milli[node, g0]) if gpus else 0,
        "gpu_memory_mib": int(mem[node, g0]) if gpus else 0,
        "mig_devices": (),
    }


def _assign(state: CycleState, node: int, first: Choice | None) -> list[Choice] | None:
    """GPUs/devices for every shape on ``node``, disjoint; ``first`` fixes the primary's. Without it,
    shapes are placed whole > share > MIG, whole GPUs leaving a GPU for a share that needs one."""
    subs = shape_states(state)
    shapes = state.request.gpu_shapes()
    chosen: list[Choice | None] = [None] * len(shapes)
    taken: set[int] = set()
    devices: set[str] = set()
    if first is not None:
        chosen[0] = first
        taken.update(first[0])
        devices.update(first[1])
        todo = list(range(1, len(shapes)))
    else:
        todo = sorted(range(len(shapes)), key=lambda k: shapes[k].order_key())
    for pos, k in enumerate(todo):
        shape, sub = shapes[k], subs[k]
        if shape.wants_mig:
            picked = gpus_to_mig(state.snapshot, node, state.request, shape=shape, exclude=devices)
            if len(picked) < shape.mig_count:
                return None
            devices.update(picked)
            chosen[k] = ((), picked)
            continue
        if shape.is_whole:
            later_share = next((subs[m] for m in todo[pos + 1 :] if shapes[m].is_shared), None)
            gpus = _whole_gpus(sub, node, taken, later_share)
        else:
            gpu = _tightest(sub, node, taken)
            gpus = None if gpu is None else (gpu,)
        if gpus is None:
            return None
        taken.update(gpus)
        chosen[k] = (gpus, ())
    return chosen  # type: ignore[return-value]


def _whole_gpus(sub: CycleState, node: int, taken: set[int], later_share: CycleState | None) -> tuple[int, ...] | None:
    """Best-connected free GPUs not taken (lowest indices without topology); when a share is still to
    be placed and these would leave it no GPU, the GPU the share would take is kept out of the set."""
    pool = [int(j) for j in np.flatnonzero(sub.eligible[node]) if int(j) not in taken]
    gpus = _gpu_set(sub, node, pool)
    if gpus is None or later_share is None or _tightest(later_share, node, taken | set(gpus)) is not None:
        return gpus
    spare = _tightest(later_share, node, taken)
    if spare is None:
        return None
    return _gpu_set(sub, node, [j for j in pool if j != spare])


def _gpu_set(sub: CycleState, node: int, pool: Sequence[int]) -> tuple[int, ...] | None:
    count = sub.request.gpu_count
    if len(pool) < count:
        return None
    topology = sub.snapshot.nodes[node].topology
    if topology is not None:
        return best_gpu_set(topology, pool, count)
    return tuple(pool[:count])


def _tightest(sub: CycleState, node: int, taken: set[int]) -> int | None:
    """The GPU a share fits on with the least room left (memory shares: least memory; ties: lowest index)."""
    snap = sub.snapshot
    fits = [int(j) for j in np.flatnonzero(sub.eligible[node]) if int(j) not in taken]
    if not fits:
        return None
    milli, mem = snap.free_milli[node], snap.gpu_mem_free[node]
    if sub.request.gpu_memory_mib:
        return min(fits, key=lambda j: (int(mem[j]), int(milli[j]), j))
    return min(fits, key=lambda j: (int(milli[j]), int(mem[j]), j))
