"""FGD: place each task where it increases the cluster's expected GPU fragmentation the least.

Score of placing the task on a node = floor(100 * sigmoid(-dF / 1000)) where dF is the change of
the node's fragmentation (milli-GPU) the placement causes. A share-of-one-GPU task tries every GPU
that fits and keeps the best one (ties: lowest index); whole-GPU tasks take the lowest-index free GPUs.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.fragmentation import (
    FragmentationModel,
    WorkloadProfile,
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


class FgdScore(ScorePlugin):
    name = "FGD"

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile

    def fragmentation_change(self, state: CycleState, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Decrease of F (weighted) per candidate and, for shares, per GPU slot [C, G]."""
        snap, req = state.snapshot, state.request
        model = fragmentation_model(snap, self.profile)
        before = node_fragmentation(snap, self.profile)[candidates]
        cpu_after = snap.cpu_free[candidates] - req.cpu_milli
        free = snap.free_milli[candidates]
        if req.is_shared:
            milli, _ = state.gpu_take
            if req.gpu_memory_mib:  # memory shares take a different milli share on each GPU model
                after = self._after_memory_share(model, free, cpu_after, candidates, milli[candidates])
            else:
                after = model.frag_after_share(free, cpu_after, candidates, req.gpu_milli)
            return before[:, None] - after, None
        if req.wants_gpu:
            after_free = whole_gpu_after(state, candidates)
        else:
            after_free = free
        return before - model.frag(after_free, cpu_after, candidates), None

    @staticmethod
    def _after_memory_share(
        model: FragmentationModel, free: np.ndarray, cpu_after: np.ndarray, nodes: np.ndarray, per_slot: np.ndarray
    ) -> np.ndarray:
        out = np.empty(free.shape, dtype=np.int64)
        for j in range(free.shape[1]):
            takes = per_slot[:, j]
            for t in np.unique(takes):
                rows = np.flatnonzero(takes == t)
                out[rows, j] = model.frag_after_share(free[rows], cpu_after[rows], nodes[rows], int(min(t, MILLI)))[:, j]
        return out

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        delta, _ = self.fragmentation_change(state, candidates)
        weight_total = fragmentation_model(state.snapshot, self.profile).weight_total
        scores = sigmoid_score(delta, weight_total)
        if delta.ndim == 1:
            return scores
        elig = state.eligible[candidates]
        scores = np.where(elig, scores, -1.0)
        best_gpu = np.argmax(scores, axis=1)  # first maximum: lowest index among equal scores
        state.scratch[GPU_CHOICE] = (candidates, best_gpu)
        return scores[np.arange(len(candidates)), best_gpu]
