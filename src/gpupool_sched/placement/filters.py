"""Feasibility: can the pod run on the node at all? (kube-scheduler's Filter plugins)."""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.framework import CycleState, FilterPlugin


class PodCountFit(FilterPlugin):
    name = "PodCount"

    def passes(self, state: CycleState) -> np.ndarray:
        return state.snapshot.pods_free >= 1

    def reason(self, request: PodRequest) -> str:
        return "Too many pods"


class CpuFit(FilterPlugin):
    name = "CpuFit"

    def applies(self, request: PodRequest) -> bool:
        return request.cpu_milli > 0

    def passes(self, state: CycleState) -> np.ndarray:
        return state.snapshot.cpu_free >= state.request.cpu_milli

    def reason(self, request: PodRequest) -> str:
        return "Insufficient cpu"


class MemoryFit(FilterPlugin):
    name = "MemoryFit"

    def applies(self, request: PodRequest) -> bool:
        return request.memory_mib > 0

    def passes(self, state: CycleState) -> np.ndarray:
        return state.snapshot.mem_free >= state.request.memory_mib

    def reason(self, request: PodRequest) -> str:
        return "Insufficient memory"


class GpuModelMatch(FilterPlugin):
    """The node has GPUs (or MIG slices) of a model the pod accepts."""

    name = "GpuModel"

    def applies(self, request: PodRequest) -> bool:
        return request.wants_gpu or request.wants_mig

    def passes(self, state: CycleState) -> np.ndarray:
        snap, req = state.snapshot, state.request
        allowed = snap.allowed_models(req.gpu_models)
        if req.wants_mig:
            return allowed.any(axis=1)
        return (allowed & snap.gpu_usable).any(axis=1)

    def reason(self, request: PodRequest) -> str:
        if request.gpu_models:
            return f"node(s) didn't have GPU model {'|'.join(sorted(request.gpu_models))}"
        return "node(s) had no usable GPU"


class GpuFit(FilterPlugin):
    """Enough GPUs with room: k fully free GPUs, or one GPU with the share free."""

    name = "GpuFit"

    def applies(self, request: PodRequest) -> bool:
        return request.wants_gpu

    def passes(self, state: CycleState) -> np.ndarray:
        return state.eligible.sum(axis=1) >= state.request.gpu_count

    def reason(self, request: PodRequest) -> str:
        if request.is_whole:
            return "Insufficient nvidia.com/gpu"
        if request.gpu_memory_mib:
            return f"no GPU with {request.gpu_memory_mib} MiB of GPU memory free"
        return f"no GPU with {request.gpu_milli}/{MILLI} of its compute free"


class MigFit(FilterPlugin):
    name = "MigFit"

    def applies(self, request: PodRequest) -> bool:
        return request.wants_mig

    def passes(self, state: CycleState) -> np.ndarray:
        snap, req = state.snapshot, state.request
        free = snap.mig_free.get(req.mig_profile or "")
        if free is None:
            return np.zeros(len(snap), dtype=bool)
        ok = free >= req.mig_count
        if req.gpu_models:
            ok &= snap.allowed_models(req.gpu_models).any(axis=1)
        return ok

    def reason(self, request: PodRequest) -> str:
        return f"Insufficient nvidia.com/mig-{request.mig_profile}"


def default_filters() -> tuple[FilterPlugin, ...]:
    """The filter chain every policy shares, cheapest and most common rejections first."""
    return (PodCountFit(), CpuFit(), MemoryFit(), GpuModelMatch(), GpuFit(), MigFit())
