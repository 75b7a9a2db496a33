"""One scheduling cycle: filter, score, pick the node, pick its GPUs. Pure: data in, decision out."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Decision, Placement, Unschedulable
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.framework import CycleState, Policy

MAX_NODE_SCORE = 100

# Feasible node indices (ascending) -> the non-empty subset to score.
NodeSample = Callable[[np.ndarray], np.ndarray]


def feasible_nodes(state: CycleState, policy: Policy) -> tuple[np.ndarray, np.ndarray | None]:
    """Indices of nodes that pass every filter, and (when none does) each node's first failing filter."""
    n = len(state.snapshot)
    ok = np.ones(n, dtype=bool)
    first_fail = None
    for i, plugin in enumerate(policy.filters):
        if not plugin.applies(state.request):
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
    return np.floor_divide((scores - lo) * MAX_NODE_SCORE, hi - lo)


def decide(
    snapshot: ClusterSnapshot,
    request: PodRequest,
    policy: Policy,
    rng: np.random.Generator | None = None,
    *,
    sample: NodeSample | None = None,
) -> Decision:
    """Place ``request`` on ``snapshot`` according to ``policy``; the snapshot is not modified.

    ``sample`` (kube-scheduler's percentageOfNodesToScore) picks which feasible nodes are scored;
    by default all of them are."""
    state = CycleState(snapshot, request, rng)
    candidates, first_fail = feasible_nodes(state, policy)
    if candidates.size == 0:
        reasons = tuple(f.reason(request) for f in policy.filters)
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
        return Placement(
            node=snapshot.nodes[node].name,
            mig_devices=gpus_to_mig(snapshot, node, request),
            score=float(total[k]),
            breakdown={name: float(v[k]) for name, v in parts.items()},
        )
    g0 = gpus[0] if gpus else 0
    return Placement(
        node=snapshot.nodes[node].name,
        gpu_indices=gpus,
        gpu_milli=int(milli[node, g0]) if gpus else 0,
        gpu_memory_mib=int(mem[node, g0]) if gpus else 0,
        score=float(total[k]),
        breakdown={name: float(v[k]) for name, v in parts.items()},
    )


def gpus_to_mig(snapshot: ClusterSnapshot, node: int, request: PodRequest) -> tuple[str, ...]:
    """Free MIG devices of the wanted profile, packing onto GPUs that already have slices in use."""
    spec = snapshot.nodes[node]
    taken = snapshot.mig_taken[node]
    allowed = set(request.gpu_models)
    by_gpu: list[tuple[int, int, list[str]]] = []
    for gpu in spec.gpus:
        if allowed and gpu.model not in allowed:
            continue
        free = [s.uuid for s in gpu.mig_slices if s.profile == request.mig_profile and s.uuid not in taken]
        used = sum(1 for s in gpu.mig_slices if s.uuid in taken)
        if free:
            by_gpu.append((-used, gpu.index, free))
    by_gpu.sort()
    out: list[str] = []
    for _, _, free in by_gpu:
        out.extend(free[: request.mig_count - len(out)])
        if len(out) == request.mig_count:
            break
    return tuple(out)
