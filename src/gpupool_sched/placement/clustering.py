"""GPU clustering: keep pods of the same GPU request kind (share, 1-GPU, 2-GPU, ...) together.

A node running only this kind scores in (75, 100], one running it among others in (50, 75], an idle
node in (25, 50], a node running only other kinds in (0, 25]; inside a band, fuller nodes score higher.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.capacity import gpu_milli_free, max_node_capacity
from gpupool_sched.placement.framework import CycleState, ScorePlugin


class GpuClusteringScore(ScorePlugin):
    name = "GpuClustering"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        if not req.wants_gpu:
            return np.zeros(candidates.size)
        _, max_gpu = max_node_capacity(snap)
        fill = 25 * (int(max_gpu) - gpu_milli_free(snap, candidates)) // int(max_gpu)
        tag = req.gpu_tag()
        band = np.empty(candidates.size, dtype=np.int64)
        for pos, node in enumerate(candidates.tolist()):
            tags = snap.gpu_tags[node]
            if tags.get(tag, 0) > 0:
                band[pos] = 75 if len(tags) == 1 else 50
            else:
                band[pos] = 25 if not tags else 0
        return (fill + band).astype(np.float64)
