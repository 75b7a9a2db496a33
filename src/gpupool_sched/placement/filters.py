"""Feasibility: can the pod run on the node at all? (kube-scheduler's Filter plugins)."""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.framework import CycleState, FilterPlugin
from gpupool_sched.placement.nodeaffinity import NodeAffinity, NodeUnschedulable, TaintToleration


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
            return allowed.any(axis=1)  # type: ignore[return-value]  # an array: numpy types any(axis=) as bool | array
        return (allowed & snap.gpu_usable).any(axis=1)  # type: ignore[no-any-return]

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
        return state.eligible.sum(axis=1) >= state.request.gpu_count  # type: ignore[no-any-return]

    def reason(self, request: PodRequest) -> str:
        if request.is_whole:
            return "Insufficient nvidia.com/gpu"
        if request.gpu_memory_mib:
            return f"no GPU with {request.gpu_memory_mib} MiB of GPU memory free"
        return f"no GPU with {request.gpu_milli}/{MILLI} of its compute free"


def mig_free_allowed(snapshot: ClusterSnapshot, profile: str, models: frozenset[str]) -> np.ndarray:
    """Free MIG devices of ``profile`` per node, counting only GPUs of ``models`` (all when empty)."""
    if not models:
        free = snapshot.mig_free.get(profile)
        return free if free is not None else np.zeros(len(snapshot), dtype=np.int64)
    out = np.zeros(len(snapshot), dtype=np.int64)
    for (p, model), free in snapshot.mig_free_by_model.items():
        if p == profile and model in models:
            out += free
    return out


class MigFit(FilterPlugin):
    """Enough free MIG devices of the profile, on GPUs of a model the pod accepts."""

    name = "MigFit"

    def applies(self, request: PodRequest) -> bool:
        return request.wants_mig

    def passes(self, state: CycleState) -> np.ndarray:
        req = state.request
        return mig_free_allowed(state.snapshot, req.mig_profile or "", req.gpu_models) >= req.mig_count

    def reason(self, request: PodRequest) -> str:
        return f"Insufficient nvidia.com/mig-{request.mig_profile}"


# Why a node passed every filter yet cannot take a multi-shape pod (decide() checks the shapes together).
JOINT_GPU_REASON = "no room for all GPU demands of the pod together"


def default_filters() -> tuple[FilterPlugin, ...]:
    """The filter chain every policy shares: node constraints first, in kube-scheduler's order (cordon,
    node affinity/selector, taints), then resources, cheapest and most common rejections first."""
    return (
        NodeUnschedulable(),
        NodeAffinity(),
        TaintToleration(),
        PodCountFit(),
        CpuFit(),
        MemoryFit(),
        GpuModelMatch(),
        GpuFit(),
        MigFit(),
    )


def shape_states(state: CycleState) -> list[CycleState]:
    """One CycleState per GPU shape of the pod (primary first: ``state`` itself), so each shape's
    eligibility and take per GPU come from the same code as single-shape pods'. Built once per cycle."""
    cached = state.scratch.get("shape_states")
    if cached is None:
        req = state.request
        cached = [state]
        for shape in req.extra:
            sub = PodRequest(
                name=req.name,
                gpu_count=shape.gpu_count,
                gpu_milli=shape.gpu_milli,
                gpu_memory_mib=shape.gpu_memory_mib,
                mig_profile=shape.mig_profile,
                mig_count=shape.mig_count,
                gpu_models=req.gpu_models,
            )
            cached.append(CycleState(state.snapshot, sub, state.rng))
        state.scratch["shape_states"] = cached
    return cached


class GpuShapesFit:
    """All GPU demands of a multi-shape pod fit on the node together, on disjoint GPUs.

    Not part of default_filters(): the chain checks the primary shape, and ``decide()`` runs this on
    the nodes that pass it, for multi-shape pods only, reporting rejections as JOINT_GPU_REASON.
    A pod has at most one whole-GPU shape and one share (PodRequest validates that); MIG devices
    never overlap GPUs that take whole or shared pods, and each MIG profile is its own devices."""

    name = "GpuShapesFit"

    def passes(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        """Boolean per candidate node index."""
        ok = np.ones(candidates.size, dtype=bool)
        whole = share = None
        for sub in shape_states(state):
            req = sub.request
            if req.wants_mig:
                free = mig_free_allowed(state.snapshot, req.mig_profile or "", req.gpu_models)
                ok &= free[candidates] >= req.mig_count
            elif req.is_whole:
                whole = sub
            else:
                share = sub
        if whole is not None:
            free_gpus = whole.eligible[candidates]
            count = free_gpus.sum(axis=1)
            ok &= count >= whole.request.gpu_count
            if share is not None:
                fits = share.eligible[candidates]
                on_used_gpu = (fits & ~free_gpus).any(axis=1)
                on_spare_free_gpu = (fits & free_gpus).any(axis=1) & (count > whole.request.gpu_count)
                ok &= on_used_gpu | on_spare_free_gpu
        elif share is not None:
            ok &= share.eligible[candidates].any(axis=1)
        return ok

    def reason(self, request: PodRequest) -> str:
        return JOINT_GPU_REASON
