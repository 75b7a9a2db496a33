"""Per-node answers of the placement core for one pod: which nodes pass the filter chain (and why the
others fail), and each feasible node's score. The same filters, scorers and tie-break as `decide()`,
but kept for every node, because kube-scheduler's filter and prioritize verbs ask about node lists."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import feasible_nodes, normalize_scores
from gpupool_sched.placement.filters import GpuShapesFit
from gpupool_sched.placement.framework import CycleState, Policy

from .protocol import MAX_EXTENDER_PRIORITY

_SHAPES_FIT = GpuShapesFit()


@dataclass(frozen=True, slots=True)
class Verdicts:
    state: CycleState
    feasible: np.ndarray  # ascending snapshot rows that pass every filter
    reasons: dict[int, str]  # failing row -> the first filter's reason


def verdicts(snapshot: ClusterSnapshot, request: PodRequest, policy: Policy,
             rng: np.random.Generator | None = None) -> Verdicts:
    """The filter chain on every node, as `decide()` runs it (multi-shape pods: all shapes together)."""
    state = CycleState(snapshot, request, rng)
    candidates, first_fail = feasible_nodes(state, policy)
    reasons: dict[int, str] = {}
    if first_fail is not None:
        texts = [f.reason(request) for f in policy.filters]
        for row in np.flatnonzero(first_fail >= 0):
            reasons[int(row)] = texts[int(first_fail[row])]
    if request.extra and candidates.size:
        together = _SHAPES_FIT.passes(state, candidates)
        for row in candidates[~together]:
            reasons[int(row)] = _SHAPES_FIT.reason(request)
        candidates = candidates[together]
    return Verdicts(state, candidates, reasons)


def extender_scores(v: Verdicts, policy: Policy, rows: np.ndarray) -> dict[int, int]:
    """Scores 0..MAX_EXTENDER_PRIORITY for `rows` (feasible, ascending): the node `decide()` would pick
    among them gets the maximum alone, the others the policy's total scaled to 0..max-1, so that
    kube-scheduler, adding weight × 10 × score to its own plugins' scores, follows the core's choice
    when the extender's weight dominates (docs/extender.md)."""
    if rows.size == 0:
        return {}
    total = np.zeros(rows.size, dtype=np.float64)
    for plugin, weight in policy.scorers:
        s = plugin.score(v.state, rows).astype(np.float64)
        if plugin.normalize:
            s = normalize_scores(s)
        total += s * weight
    best = np.flatnonzero(total == total.max())
    if best.size > 1:
        if policy.random_tie_break:
            best = best[[int(v.state.rng.integers(best.size))]]
        else:
            best = best[[int(np.argmin(v.state.snapshot.tie_rank[rows[best]]))]]
    winner = int(best[0])
    top = MAX_EXTENDER_PRIORITY - 1
    lo, hi = float(total.min()), float(total.max())
    out: dict[int, int] = {}
    for k, row in enumerate(rows):
        scaled = 0 if hi == lo else int((float(total[k]) - lo) * top // (hi - lo))
        out[int(row)] = MAX_EXTENDER_PRIORITY if k == winner else min(scaled, top)
    return out
