"""gpupool's default policy: FGD's fragmentation gradient, with consolidation breaking its ties and
NVLink/NUMA topology choosing the GPUs of multi-GPU pods.

FGD scores a placement by floor(100 * sigmoid(-dF/1000)): placements whose fragmentation changes
differ by less than ~40 milli-GPU score the same, and the published artifact breaks those ties by a
random node order. Replays of the Alibaba trace show that *which* tie wins matters: spreading (the
emptiest node) loses about twice as many GPUs as FGD, and finer fragmentation deltas alone lose too,
while sending ties to the node that would be left fullest (best-fit on CPU and GPU) keeps idle nodes
whole for the multi-GPU jobs still to come. See docs/placement.md for the measurements.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.capacity import gpu_milli_free, max_node_capacity
from gpupool_sched.placement.fgd import GPU_CHOICE, FgdScore
from gpupool_sched.placement.filters import default_filters
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import CycleState, GpuSelector, Policy, ScorePlugin
from gpupool_sched.placement.gpu_selection import ScorerChoice, TightestFit, lowest_free

CONSOLIDATION_WEIGHT = 0.005  # below one FGD point: consolidation only breaks FGD's ties


class ConsolidationScore(ScorePlugin):
    """0..100: how little CPU and GPU the node would have left (best-fit without normalisation)."""

    name = "Consolidation"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        max_cpu, max_gpu = max_node_capacity(snap)
        left = (
            0.5 * (snap.cpu_free[candidates] - req.cpu_milli) / max_cpu
            + 0.5 * (gpu_milli_free(snap, candidates) - req.gpu_milli_total) / max_gpu
        )
        return 100.0 * (1.0 - left)


class TopologyAwareGpus(GpuSelector):
    """Multi-GPU pods get the best-connected free GPUs (NVLink, then PCIe switch, then NUMA);
    shares take the GPU the fragmentation scorer chose."""

    name = "topology"

    def __init__(self) -> None:
        self.shares = ScorerChoice(GPU_CHOICE, TightestFit())

    def select(self, state: CycleState, node: int) -> tuple[int, ...]:
        req: PodRequest = state.request
        if req.is_shared:
            return self.shares.select(state, node)
        topology = state.snapshot.nodes[node].topology
        if req.gpu_count < 2 or topology is None:
            return lowest_free(state, node)
        from gpupool_sched.placement.topology import best_gpu_set

        free = [int(j) for j in np.flatnonzero(state.eligible[node])]
        return tuple(best_gpu_set(topology, free, req.gpu_count))


def gpupool_policy(profile: WorkloadProfile) -> Policy:
    return Policy(
        name="gpupool",
        filters=default_filters(),
        scorers=((FgdScore(profile), 1.0), (ConsolidationScore(), CONSOLIDATION_WEIGHT)),
        gpu_selector=TopologyAwareGpus(),
        description=__doc__ or "",
    )
