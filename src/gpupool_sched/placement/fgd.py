"""FGD: place each task where it increases the cluster's expected GPU fragmentation the least.

Score of placing the task on a node = floor(100 * sigmoid(-dF / 1000)) where dF is the change of
the node's fragmentation (milli-GPU) the placement causes. A share-of-one-GPU task tries every GPU
that fits and keeps the best one (ties: lowest index); whole-GPU tasks take the lowest-index free GPUs.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.fragmentation import (
    WorkloadProfile,
    cached_for_profile,
    fragmentation_model,
    node_fragmentation,
)
from gpupool_sched.placement.framework import CycleState, ScorePlugin

GPU_CHOICE = "fgd.gpu"


def sigmoid_score(delta_weighted: np.ndarray, weight_total: int) -> np.ndarray:
    """floor(100 * sigmoid(dF/1000)) with dF = delta_weighted / weight_total (decrease of F)."""
    x = delta_weighted / (1000.0 * weight_total)
    return np.floor((1.0 / (1.0 + np.exp(-x))) * 100.0)


def whole_gpu_after(state: CycleState, candidates: np.ndarray) -> np.ndarray:
    """GPU state of each candidate after the lowest-index eligible GPUs are taken whole."""
    elig = state.eligible[candidates]
    take = elig & (np.cumsum(elig, axis=1) <= state.request.gpu_count)
    return np.where(take, 0, state.snapshot.free_milli[candidates])


class ShapeMemo:
    """Per request shape: the node versions a result was computed at, and the results. Least recently
    used shapes are dropped beyond ``max_bytes`` (64 MiB: ~500 shapes at 1k nodes, ~25 at 20k)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: dict[object, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, key: object, nodes: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self.entries.pop(key, None)
        if entry is None:
            size = nodes * 8 * (1 + max(slots, 1))
            while self.entries and self.bytes + size > self.max_bytes:
                old_versions, old_values = self.entries.pop(next(iter(self.entries)))
                self.bytes -= old_versions.nbytes + old_values.nbytes
            self.bytes += size
            shape = (nodes, slots) if slots else (nodes,)
            entry = (np.full(nodes, -1, dtype=np.int64), np.zeros(shape, dtype=np.float64))
        self.entries[key] = entry  # most recently used last
        return entry


class FgdScore(ScorePlugin):
    name = "FGD"

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile

    def fragmentation_change(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        """Decrease of F (weighted) per candidate, or per candidate and GPU slot [C, G] for shares
        (-inf where the GPU cannot take the share).

        Results are remembered per request shape and node version: replicas of one workload and
        trace replays ask the same question again and again while only a few nodes changed."""
        snap, req = state.snapshot, state.request
        memo = cached_for_profile(snap, "fgd-delta", self.profile, ShapeMemo)
        key = (req.cpu_milli, req.gpu_count, req.gpu_milli, req.gpu_memory_mib, req.gpu_models)
        versions, values = memo.get(key, len(snap), snap.gpu_slots if req.is_shared else 0)
        stale = candidates[versions[candidates] != snap.version[candidates]]
        if stale.size:
            values[stale] = self._compute_change(state, stale)
            versions[stale] = snap.version[stale]
        return values[candidates]  # type: ignore[no-any-return]

    def _compute_change(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        model = fragmentation_model(snap, self.profile)
        before = node_fragmentation(snap, self.profile)[candidates]
        cpu_after = snap.cpu_free[candidates] - req.cpu_milli
        free = snap.free_milli[candidates]
        if not req.is_shared:
            after_free = whole_gpu_after(state, candidates) if req.wants_gpu else free
            return (  # type: ignore[no-any-return]
                (before - model.frag(after_free, cpu_after, candidates)).astype(np.float64)
            )
        rows, gpus = np.nonzero(state.eligible[candidates])
        out = np.full(free.shape, -np.inf)
        if req.gpu_memory_mib:  # a memory share takes a different milli share on each GPU model
            takes = state.gpu_take[0][candidates[rows], gpus]
            for t in np.unique(takes):
                sel = takes == t
                after = model.frag_after_share(free, cpu_after, candidates, int(t), rows[sel], gpus[sel])
                out[rows[sel], gpus[sel]] = before[rows[sel]] - after
        else:
            after = model.frag_after_share(free, cpu_after, candidates, req.gpu_milli, rows, gpus)
            out[rows, gpus] = before[rows] - after
        return out

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        delta = self.fragmentation_change(state, candidates)
        weight_total = fragmentation_model(state.snapshot, self.profile).weight_total
        scores = sigmoid_score(delta, weight_total)
        if delta.ndim == 1:
            return scores
        scores = np.where(np.isfinite(delta), scores, -1.0)
        best_gpu = np.argmax(scores, axis=1)  # first maximum: lowest index among equal scores
        state.scratch[GPU_CHOICE] = (candidates, best_gpu)
        return scores[np.arange(len(candidates)), best_gpu]  # type: ignore[no-any-return]
