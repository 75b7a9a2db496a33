"""gpupool's default policy: FGD's fragmentation gradient, plus what FGD cannot see from one node.

FGD (fgd.py) scores how a placement changes the node's expected fragmentation for the workload's
task classes. Replaying the Alibaba trace shows two losses it does not see:

* **stranding** (stranding.py): CPU-only and CPU-heavy pods use up a GPU node's CPU, after which its
  idle GPUs stay idle for good. FGD only notices once a typical task no longer fits.
* **model scarcity** (scarcity.py): unconstrained pods take GPU models that constrained pods need,
  and the constrained pods fail later while other models sit idle.

Both are added to the FGD score with fixed weights (points per GPU stranded / per GPU of a fully
subscribed model); multi-GPU pods also score the NVLink/PCIe quality of the GPUs they would get and
receive the best-connected set. Measurements and the tuning behind the weights: docs/placement.md.
"""

from __future__ import annotations

import numpy as np

from gpupool_common.gpu_sets import NVLINK_SCORE, best_gpu_set, set_score
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fgd import GPU_CHOICE, FgdScore
from gpupool_sched.placement.filters import default_filters
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import CycleState, GpuSelector, Policy, ScorePlugin
from gpupool_sched.placement.gpu_selection import ScorerChoice, TightestFit, lowest_free
from gpupool_sched.placement.scarcity import ScarcityScore
from gpupool_sched.placement.stranding import StrandingScore

STRANDING_WEIGHT = 25.0  # FGD points per GPU a placement strands
SCARCITY_WEIGHT = 40.0  # FGD points per GPU taken from a model whose constrained demand equals its supply
TOPOLOGY_WEIGHT = 20.0  # at most this many points for the best-connected GPU set


class TopologyScore(ScorePlugin):
    """0..1 for multi-GPU pods: how well connected the best free GPU set on the node is, relative to
    every pair joined by one NVLink. Nodes without published topology, and other pods, score 0."""

    name = "Topology"

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        req = state.request
        out = np.zeros(candidates.size)
        if req.gpu_count < 2:
            return out
        pairs = req.gpu_count * (req.gpu_count - 1) // 2
        for pos, node in enumerate(candidates.tolist()):
            topology = state.snapshot.nodes[node].topology
            if topology is None:
                continue
            free = [int(j) for j in np.flatnonzero(state.eligible[node])]
            chosen = best_gpu_set(topology, free, req.gpu_count)
            out[pos] = min(1.0, set_score(topology, chosen) / (pairs * NVLINK_SCORE))
        return out


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
        free = [int(j) for j in np.flatnonzero(state.eligible[node])]
        return best_gpu_set(topology, free, req.gpu_count)


def gpupool_policy(profile: WorkloadProfile) -> Policy:
    return Policy(
        name="gpupool",
        filters=default_filters(),
        scorers=(
            (FgdScore(profile), 1.0),
            (StrandingScore(profile), STRANDING_WEIGHT),
            (ScarcityScore(profile), SCARCITY_WEIGHT),
            (TopologyScore(), TOPOLOGY_WEIGHT),
        ),
        gpu_selector=TopologyAwareGpus(),
        description=__doc__ or "",
    )
