"""The lower bound's input (simulate/bound.py): the GPU pods that have arrived when the report measures
(`measured_prefix`), grouped into classes of interchangeable pods, and the nodes into types of identical
nodes (`instance`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpupool_sched.model.cluster import NodeSpec
from gpupool_sched.model.request import MILLI, PodRequest


@dataclass(frozen=True, slots=True)
class PodClass:
    """Pods that are interchangeable for the bound."""

    cpu: int
    mem: int
    gpus: int  # 1 for a share
    milli: int  # per GPU: 1..999 for a share, 1000 for whole GPUs
    models: frozenset[str]  # empty: any model
    count: int

    @property
    def value(self) -> int:
        return self.gpus * self.milli

    @property
    def share(self) -> bool:
        return self.milli < MILLI


@dataclass(frozen=True, slots=True)
class NodeType:
    cpu: int
    mem: int
    gpus: int
    model: str
    count: int

    def admits(self, k: PodClass) -> bool:
        """Could one pod of ``k`` sit on an empty node of this type?"""
        return (
            k.cpu <= self.cpu
            and k.mem <= self.mem
            and k.gpus <= self.gpus
            and (not k.models or self.model in k.models)
        )


@dataclass(frozen=True, slots=True)
class Instance:
    classes: tuple[PodClass, ...]
    types: tuple[NodeType, ...]

    @property
    def capacity(self) -> int:
        return sum(t.count * t.gpus for t in self.types) * MILLI

    @property
    def requested(self) -> int:
        return sum(k.count * k.value for k in self.classes)


def instance(nodes: Sequence[NodeSpec], pods: Sequence[PodRequest]) -> Instance:
    """Group GPU pods into classes and nodes into types. CPU-only pods are left out: they add no GPU milli,
    and dropping pods from a subset keeps it feasible, so OPT never needs them."""
    classes = Counter(
        (p.cpu_milli, p.memory_mib, p.gpu_count, p.gpu_milli, p.gpu_models) for p in pods if p.gpu_milli_total
    )
    types = Counter(
        (n.cpu_milli, n.memory_mib, len(n.gpus), n.gpus[0].model if n.gpus else "") for n in nodes
    )
    return Instance(
        tuple(PodClass(*key, count=c) for key, c in sorted(classes.items(), key=lambda kv: _class_key(kv[0]))),
        tuple(NodeType(*key, count=c) for key, c in sorted(types.items()) if key[2]),
    )


def _class_key(key: tuple[int, int, int, int, frozenset[str]]) -> tuple[int, int, int, int, tuple[str, ...]]:
    return (*key[:4], tuple(sorted(key[4])))


def measured_prefix(arrivals: Sequence[PodRequest], total_gpus: int) -> int:
    """How many arrivals the report's numbers at 100% arrived cover: the last event the curve's 100% point
    averages over (report.final_point's event when the curve has no such point). Allocation only grows,
    so every event averaged is bounded by the state after this one."""
    arrived = np.concatenate(([0], np.cumsum([p.gpu_milli_total for p in arrivals], dtype=np.int64)))
    pct = np.array([round(v) for v in (arrived / total_gpus / 10).tolist()], dtype=np.int64)
    for sel in (pct == 100, (pct >= 99) & (pct <= 101)):
        if sel.any():
            return int(np.flatnonzero(sel)[-1])
    reached = np.flatnonzero(arrived >= total_gpus * MILLI)
    return int(reached[0]) if reached.size else len(arrivals)
