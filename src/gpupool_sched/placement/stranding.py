"""Stranded GPUs: idle GPU capacity that a node's remaining CPU or memory can no longer feed.

GPU tasks bring CPU and memory with them (in the openb trace about 12 cores per GPU). A node whose
CPU is used up by CPU-only or CPU-heavy pods keeps its idle GPUs idle for good. FGD only notices
when a single typical task stops fitting; this measures it continuously: with ``r_cpu`` milli-CPU
and ``r_mem`` MiB per milli-GPU (the workload's averages), a node can still feed
``min(cpu_free / r_cpu, mem_free / r_mem)`` milli-GPU, and the rest of its idle GPU is stranded.

The score is minus the stranding a placement adds, in GPUs: CPU-only pods go where they strand
nothing (nodes with few idle GPUs and spare CPU), GPU pods go where they use GPUs that CPU alone
would otherwise leave stranded.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.capacity import gpu_milli_free
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import CycleState, ScorePlugin


def stranded_milli(
    idle: np.ndarray, cpu_free: np.ndarray, mem_free: np.ndarray, profile: WorkloadProfile
) -> np.ndarray:
    """Idle milli-GPU that the free CPU and memory cannot feed (per node)."""
    feedable = np.full(idle.shape, np.inf)
    if profile.cpu_per_gpu_milli > 0:
        feedable = np.minimum(feedable, cpu_free / profile.cpu_per_gpu_milli)
    if profile.mem_per_gpu_milli > 0:
        feedable = np.minimum(feedable, mem_free / profile.mem_per_gpu_milli)
    return np.maximum(0.0, idle - feedable)  # type: ignore[no-any-return]


class StrandingScore(ScorePlugin):
    name = "Stranding"

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        idle = gpu_milli_free(snap, candidates)
        cpu, mem = snap.cpu_free[candidates], snap.mem_free[candidates]
        before = stranded_milli(idle, cpu, mem, self.profile)
        taken = state.milli_taken(candidates)
        after = stranded_milli(idle - taken, cpu - req.cpu_milli, mem - req.memory_mib, self.profile)
        return -(after - before) / MILLI  # type: ignore[no-any-return]
