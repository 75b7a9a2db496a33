"""Which GPUs of the chosen node a pod gets."""

from __future__ import annotations

import numpy as np

from gpupool_sched.placement.framework import CycleState, GpuSelector


def lowest_free(state: CycleState, node: int) -> tuple[int, ...]:
    """The lowest-index eligible GPUs (whole-GPU pods in every published policy)."""
    idx = np.flatnonzero(state.eligible[node])
    return tuple(int(j) for j in idx[: state.request.gpu_count])


class TightestFit(GpuSelector):
    """A share goes to the GPU with the least room that still fits it (ties: lowest index)."""

    name = "tightest"

    def select(self, state: CycleState, node: int) -> tuple[int, ...]:
        if not state.request.is_shared:
            return lowest_free(state, node)
        idx = np.flatnonzero(state.eligible[node])
        free = state.snapshot.free_milli[node, idx]
        return (int(idx[int(np.argmin(free))]),)


class RandomGpu(GpuSelector):
    """A share goes to a uniformly random GPU that fits it."""

    name = "random"

    def select(self, state: CycleState, node: int) -> tuple[int, ...]:
        if not state.request.is_shared:
            return lowest_free(state, node)
        idx = np.flatnonzero(state.eligible[node])
        return (int(idx[int(state.rng.integers(idx.size))]),)


class ScorerChoice(GpuSelector):
    """The GPU a scorer already chose while scoring the node (FGD scores node and GPU together)."""

    name = "scorer"

    def __init__(self, key: str, fallback: GpuSelector) -> None:
        self.key = key
        self.fallback = fallback

    def select(self, state: CycleState, node: int) -> tuple[int, ...]:
        choice = state.scratch.get(self.key)
        if choice is not None:
            nodes, gpus = choice
            pos = np.flatnonzero(nodes == node)
            if pos.size:
                return (int(gpus[pos[0]]),)
        return self.fallback.select(state, node)
