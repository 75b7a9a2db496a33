"""Named policies. Every caller (scheduler, extender, simulator) builds policies here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpupool_sched.placement.bestfit import BestFitScore
from gpupool_sched.placement.clustering import GpuClusteringScore
from gpupool_sched.placement.dotproduct import DotProductScore
from gpupool_sched.placement.fgd import GPU_CHOICE, FgdScore
from gpupool_sched.placement.filters import default_filters
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gpu_selection import RandomGpu, ScorerChoice, TightestFit
from gpupool_sched.placement.packing import GpuPackingScore
from gpupool_sched.placement.randomfit import ConstantScore


class UnknownPolicy(KeyError):
    pass


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    name: str
    label: str  # as the FGD paper's figures name it
    summary: str
    needs_profile: bool
    build: Callable[[WorkloadProfile | None], Policy]


def _random(_: WorkloadProfile | None) -> Policy:
    return Policy("random", default_filters(), ((ConstantScore(), 1.0),), RandomGpu(), random_tie_break=True)


def _best_fit(_: WorkloadProfile | None) -> Policy:
    return Policy("best-fit", default_filters(), ((BestFitScore(), 1.0),), TightestFit())


def _dot_product(_: WorkloadProfile | None) -> Policy:
    return Policy("dot-product", default_filters(), ((DotProductScore(), 1.0),), TightestFit())


def _packing(_: WorkloadProfile | None) -> Policy:
    return Policy("gpu-packing", default_filters(), ((GpuPackingScore(), 1.0),), TightestFit())


def _clustering(_: WorkloadProfile | None) -> Policy:
    return Policy("gpu-clustering", default_filters(), ((GpuClusteringScore(), 1.0),), TightestFit())


def _fgd(profile: WorkloadProfile | None) -> Policy:
    if profile is None:
        raise ValueError("fgd needs a workload profile (the task classes it defragments for)")
    return Policy("fgd", default_filters(), ((FgdScore(profile), 1.0),), ScorerChoice(GPU_CHOICE, TightestFit()))


def _gpupool(profile: WorkloadProfile | None) -> Policy:
    from gpupool_sched.placement.gpupool import gpupool_policy

    if profile is None:
        raise ValueError("gpupool needs a workload profile (the task classes it defragments for)")
    return gpupool_policy(profile)


POLICIES: dict[str, PolicyInfo] = {
    p.name: p
    for p in (
        PolicyInfo("random", "Random", "a uniformly random feasible node", False, _random),
        PolicyInfo("best-fit", "BestFit", "least CPU and GPU left over", False, _best_fit),
        PolicyInfo("dot-product", "DotProd", "smallest free/request dot product (Tetris)", False, _dot_product),
        PolicyInfo("gpu-packing", "Packing", "partly used GPUs, then busy nodes, then idle ones", False, _packing),
        PolicyInfo("gpu-clustering", "Clustering", "same GPU request kind together", False, _clustering),
        PolicyInfo("fgd", "FGD", "least growth of expected GPU fragmentation (ATC'23)", True, _fgd),
        PolicyInfo("gpupool", "gpupool", "gpupool's default: FGD refined (see docs/placement.md)", True, _gpupool),
    )
}


def build_policy(name: str, profile: WorkloadProfile | None = None) -> Policy:
    try:
        info = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return info.build(profile)
