"""GPU packing: fill partly used GPUs first, then free GPUs on busy nodes, and idle nodes last.

Scores (higher wins): a share landing on a partly used GPU scores 100 minus a tenth of that GPU's
free percentage (floor 50); a pod that must take fully free GPUs on a node already in use scores
50 minus the number of free GPUs it takes (floor 33); an idle node scores 33 minus its GPU count.
GPUs are considered from the least free up. CPU-only pods score 0 everywhere.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.framework import CycleState, ScorePlugin


class GpuPackingScore(ScorePlugin):
    name = "GpuPacking"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        if not req.wants_gpu:
            return np.zeros(candidates.size)
        free = snap.free_milli[candidates]
        usable = snap.gpu_usable[candidates]
        fully_free = ((free == MILLI) & usable).sum(axis=1)
        idle_node = fully_free == snap.gpu_count[candidates]
        idle_score = np.maximum(33 - fully_free, fully_free)
        if req.is_shared:
            elig = state.eligible[candidates]
            tight = np.where(elig, free, MILLI + 1).min(axis=1)
            takes_free = tight == MILLI
            pct = tight * 100 // MILLI
            used = np.where(takes_free, np.maximum(50 - 1, 33), np.maximum(100 - pct // 10, 50))
        else:
            used = np.full(candidates.size, max(50 - req.gpu_count, 33))
        return np.where(idle_node, idle_score, used).astype(np.float64)  # type: ignore[no-any-return]
