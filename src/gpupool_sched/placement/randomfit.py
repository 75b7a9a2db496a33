"""Random-fit: any feasible node, uniformly at random (the baseline every heuristic must beat)."""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.framework import CycleState, ScorePlugin


class ConstantScore(ScorePlugin):
    """Scores every node alike, so the policy's random tie-break picks uniformly."""

    name = "Random"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        return np.zeros(candidates.size)
