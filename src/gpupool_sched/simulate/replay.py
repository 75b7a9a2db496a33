"""Replay a pod arrival sequence through a placement policy on a fresh cluster."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile, cluster_fragmentation_milli
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.sampling import NodeSampler
from gpupool_sched.placement.workload import RollingProfile, forget_profile

Progress = Callable[[int], None]


@dataclass(slots=True)
class ReplayResult:
    policy: str
    total_gpus: int
    arrived_milli: np.ndarray  # after each event (the first entry is the empty cluster)
    used_milli: np.ndarray
    failed: np.ndarray  # bool per pod
    fragmented_milli_at_full: float  # when arrivals first reach 100% of capacity
    failed_at_full: int
    seconds: float

    @property
    def pods(self) -> int:
        return int(self.failed.size)


def replay(
    nodes: Sequence[NodeSpec],
    arrivals: Sequence[PodRequest],
    policy: Policy,
    profile: WorkloadProfile,
    *,
    tie_order: Sequence[str] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    sample_percentage: int | None = None,
    sample_rotate: bool = False,
    rolling: RollingProfile | None = None,
    rebuild: Callable[[WorkloadProfile], Policy] | None = None,
) -> ReplayResult:
    """Place each pod in turn; pods never leave and failed pods are not retried.

    ``profile`` is the workload the fragmentation metric is measured for. ``sample_percentage``
    scores only a sample of the feasible nodes (sampling.py; 0 = kube-scheduler's adaptive share),
    scanned from the first node of the tie-break order, or with ``sample_rotate`` from where the
    previous scan stopped (kube-scheduler's rotation).
    With ``rolling``, each arriving pod is observed before it is placed and, when the rolling profile
    changes, ``rebuild`` makes the policy anew from it (the scheduler's view of the workload; the
    caller builds the first ``policy`` from ``rolling.profile()``)."""
    snapshot = ClusterSnapshot(nodes, tie_order=tie_order)
    sampler = None
    if sample_percentage is not None:
        sampler = NodeSampler.for_snapshot(snapshot, sample_percentage, rotate=sample_rotate)
    version = rolling.version if rolling is not None else 0
    rng = np.random.default_rng(seed)
    capacity = snapshot.total_gpu_milli
    arrived = np.zeros(len(arrivals) + 1, dtype=np.int64)
    used = np.zeros(len(arrivals) + 1, dtype=np.int64)
    failed = np.zeros(len(arrivals), dtype=bool)
    frag_at_full: float | None = None
    failed_at_full = 0
    a = u = 0
    start = time.perf_counter()
    for i, pod in enumerate(arrivals):
        a += pod.gpu_milli_total
        if rolling is not None and rebuild is not None:
            old = rolling.profile()
            rolling.observe(pod)
            if rolling.version != version:
                version = rolling.version
                policy = rebuild(rolling.profile())
                if old is not profile:
                    forget_profile(snapshot, old)
        decision = decide(snapshot, pod, policy, rng, sample=sampler)
        if isinstance(decision, Placement):
            snapshot.assume(pod, decision)
            u += decision.gpu_milli * len(decision.gpu_indices)
        else:
            failed[i] = True
        arrived[i + 1], used[i + 1] = a, u
        if frag_at_full is None and a >= capacity:
            frag_at_full = cluster_fragmentation_milli(snapshot, profile)
            failed_at_full = int(failed[: i + 1].sum())
        if progress is not None and (i + 1) % 256 == 0:
            progress(256)
    if progress is not None:
        progress(len(arrivals) % 256)
    if frag_at_full is None:
        frag_at_full = cluster_fragmentation_milli(snapshot, profile)
        failed_at_full = int(failed.sum())
    return ReplayResult(
        policy=policy.name,
        total_gpus=snapshot.total_gpu_milli // 1000,
        arrived_milli=arrived,
        used_milli=used,
        failed=failed,
        fragmented_milli_at_full=frag_at_full,
        failed_at_full=failed_at_full,
        seconds=time.perf_counter() - start,
    )
