"""Dot-product (Tetris, SIGCOMM'14): prefer the node whose free resources align least with the pod's
request, i.e. the smallest dot product of the two vectors (CPU, GPU) normalised by the largest node."""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.capacity import gpu_milli_free, max_node_capacity
from gpupool_sched.placement.framework import CycleState, ScorePlugin


class DotProductScore(ScorePlugin):
    name = "DotProduct"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        max_cpu, max_gpu = max_node_capacity(snap)
        product = (snap.cpu_free[candidates] / max_cpu) * (req.cpu_milli / max_cpu) + (
            gpu_milli_free(snap, candidates) / max_gpu
        ) * (req.gpu_milli_total / max_gpu)
        return np.trunc((1.0 - product / 2.0) * 100.0)  # type: ignore[no-any-return]
