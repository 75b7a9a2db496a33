"""Best-fit: the node whose CPU and GPU would be left the least free (weights 0.5 each)."""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.capacity import gpu_milli_free, max_node_capacity
from gpupool_sched.placement.framework import CycleState, ScorePlugin


class BestFitScore(ScorePlugin):
    name = "BestFit"
    normalize = True

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        max_cpu, max_gpu = max_node_capacity(snap)
        left_cpu = (snap.cpu_free[candidates] - req.cpu_milli) / max_cpu * 0.5
        left_gpu = (gpu_milli_free(snap, candidates) - req.gpu_milli_total) / max_gpu * 0.5
        return np.trunc((1.0 - (left_cpu + left_gpu)) * 100.0)  # type: ignore[no-any-return]
