"""Small hand-made clusters for the placement core's tests: nodes (whole GPUs, MIG), a snapshot with the
pods running on it for preemption (`Cluster`, priority `HIGH` for the preemptor, the policies it is planned
with), and the snapshot's free capacity, to compare before and after a plan that must change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, MigSlice, NodeSpec
from gpupool_sched.model.constraints import NodeConstraints
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.preemption import Preemption, RunningPod, plan_preemption
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.workload import default_prior

HIGH = 10  # the preemptor's priority
BEST_FIT = build_policy("best-fit")


def gpu_node(
    name: str, gpus: int, model: str = "A100", *, cpu: int = 64_000, mem: int = 256_000, gpu_mem: int = 40_960
) -> NodeSpec:
    return NodeSpec(
        name=name,
        cpu_milli=cpu,
        memory_mib=mem,
        gpus=tuple(GpuSpec(index=i, model=model, memory_mib=gpu_mem, uuid=f"GPU-{name}-{i}") for i in range(gpus)),
    )


def mig_node(name: str) -> NodeSpec:
    """GPU 0 split into 1g.10gb x4 + 3g.40gb... (A100-80GB style), GPU 1 whole."""
    slices = (
        MigSlice(f"MIG-{name}-0-a", "3g.40gb", 0),
        MigSlice(f"MIG-{name}-0-b", "1g.10gb", 0),
        MigSlice(f"MIG-{name}-0-c", "1g.10gb", 0),
    )
    return NodeSpec(
        name=name,
        cpu_milli=64_000,
        memory_mib=256_000,
        gpus=(
            GpuSpec(
                index=0, model="A100-80GB", memory_mib=81_920, uuid=f"GPU-{name}-0", mig_enabled=True, mig_slices=slices
            ),
            GpuSpec(index=1, model="A100-80GB", memory_mib=81_920, uuid=f"GPU-{name}-1"),
        ),
    )


# ---- preemption: a snapshot and the pods running on it ------------------------------------------
def policies() -> list[Policy]:
    return [BEST_FIT, build_policy("gpupool", default_prior()), build_policy("fgd", default_prior())]


class Cluster:
    """A snapshot plus the pods running on it, built pod by pod."""

    def __init__(self, nodes: Sequence[NodeSpec]) -> None:
        self.snap = ClusterSnapshot(nodes)
        self.pods: list[RunningPod] = []

    def hold(
        self, uid: str, request: PodRequest, placement: Placement, priority: int, start: float, pdb: bool
    ) -> RunningPod:
        self.snap.assume(request, placement)
        pod = RunningPod(uid, placement.node, priority, request, placement, start, pdb)
        self.pods.append(pod)
        return pod

    def whole(
        self, uid: str, node: str, gpus: Sequence[int], priority: int, start: float = 0.0, *, pdb: bool = False
    ) -> RunningPod:
        req = PodRequest(name=uid, cpu_milli=1000, gpu_count=len(gpus), gpu_milli=1000, priority=priority)
        mem = self.snap.nodes[self.snap.row_of(node)].gpus[gpus[0]].memory_mib
        return self.hold(uid, req, Placement(node, tuple(gpus), 1000, mem), priority, start, pdb)

    def share(
        self, uid: str, node: str, gpu: int, mem_mib: int, priority: int, start: float = 0.0, *, pdb: bool = False
    ) -> RunningPod:
        req = PodRequest(name=uid, cpu_milli=500, gpu_count=1, gpu_memory_mib=mem_mib, priority=priority)
        total = self.snap.nodes[self.snap.row_of(node)].gpus[gpu].memory_mib
        placement = Placement(node, (gpu,), max(1, mem_mib * 1000 // total), mem_mib)
        return self.hold(uid, req, placement, priority, start, pdb)

    def plan(self, request: PodRequest, policy: Policy = BEST_FIT, priority: int = HIGH) -> Preemption | None:
        return plan_preemption(self.snap, request, priority, self.pods, policy, np.random.default_rng(0))


def gpus(n: int, *, cpu: int = 1000, constraints: NodeConstraints | None = None) -> PodRequest:
    return PodRequest(name="pre", cpu_milli=cpu, gpu_count=n, gpu_milli=1000, priority=HIGH, constraints=constraints)


def budgeted(c: Cluster, uid: str, node: str, gpu: int, priority: int, budgets: dict[str, int],
             start: float = 0.0) -> RunningPod:
    """A whole-GPU pod that the PodDisruptionBudgets `budgets` (name -> disruptions allowed) select."""
    pod = c.whole(uid, node, [gpu], priority, start)
    c.pods[-1] = replace(pod, budgets=tuple(sorted(budgets.items())))
    return c.pods[-1]


# ---- the snapshot's free capacity ---------------------------------------------------------------------
def free_capacity(snap: ClusterSnapshot) -> tuple[np.ndarray, ...]:
    """Copies of what is free per GPU (milli, memory) and per node (CPU, pods)."""
    return (snap.free_milli.copy(), snap.gpu_mem_free.copy(), snap.cpu_free.copy(), snap.pods_free.copy())


def assert_same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
