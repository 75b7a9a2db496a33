"""The cluster as placement sees it: static node specs plus what is allocated, held column-wise.

Placement policies score every node for every pod, so the allocation state lives in numpy arrays
(one row per node, one column per GPU slot) rather than in per-node objects; ``assume``/``release``
keep the arrays and a per-node version counter (for score caches) up to date.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpupool_sched.model.request import MILLI, PodRequest

if TYPE_CHECKING:
    from gpupool_sched.model.decision import Placement
    from gpupool_sched.model.topology import NodeTopology

ABSENT = -1  # free_milli of a GPU slot that does not exist or is split into MIG slices


@dataclass(frozen=True, slots=True)
class MigSlice:
    """One MIG device of a MIG-enabled GPU."""

    uuid: str
    profile: str  # e.g. "1g.10gb"
    gpu_index: int


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One physical GPU of a node. ``memory_mib == 0`` means unknown (trace replays): memory shares
    cannot land there, compute shares and whole-GPU requests can."""

    index: int
    model: str
    memory_mib: int = 0
    uuid: str = ""
    numa_node: int | None = None
    mig_enabled: bool = False
    mig_slices: tuple[MigSlice, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What a node offers; the allocation on it lives in :class:`ClusterSnapshot`."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuSpec, ...] = ()
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)
    topology: NodeTopology | None = None

    @property
    def gpu_model(self) -> str:
        """The node's GPU model ('' without GPUs; models joined by '+' on mixed nodes)."""
        return "+".join(sorted({g.model for g in self.gpus}))


class ClusterSnapshot:
    """Nodes and their allocation state. Pure data: no I/O, no clock, no Kubernetes client."""

    def __init__(self, nodes: Sequence[NodeSpec], tie_order: Sequence[str] | None = None) -> None:
        self.nodes: tuple[NodeSpec, ...] = tuple(nodes)
        names = [n.name for n in self.nodes]
        self.node_names: tuple[str, ...] = tuple(names)
        self.index: dict[str, int] = {name: i for i, name in enumerate(names)}
        if len(self.index) != len(names):
            dupes = sorted(name for name, c in Counter(names).items() if c > 1)
            raise ValueError(f"duplicate node names: {', '.join(dupes[:5])}")
        n = len(self.nodes)
        g = max((len(node.gpus) for node in self.nodes), default=0)
        self.gpu_slots = max(g, 1)
        self.models: list[str] = sorted({gpu.model for node in self.nodes for gpu in node.gpus})
        model_id = {m: i for i, m in enumerate(self.models)}

        self.cpu_total = np.array([node.cpu_milli for node in self.nodes], dtype=np.int64)
        self.mem_total = np.array([node.memory_mib for node in self.nodes], dtype=np.int64)
        self.pods_total = np.array([node.max_pods for node in self.nodes], dtype=np.int64)
        self.gpu_count = np.array([len(node.gpus) for node in self.nodes], dtype=np.int64)
        self.gpu_model = np.full((n, self.gpu_slots), ABSENT, dtype=np.int16)
        self.gpu_mem_total = np.zeros((n, self.gpu_slots), dtype=np.int64)
        self.mig_profiles: list[str] = sorted(
            {s.profile for node in self.nodes for gpu in node.gpus for s in gpu.mig_slices}
        )
        self.mig_total: dict[str, np.ndarray] = {p: np.zeros(n, dtype=np.int64) for p in self.mig_profiles}
        whole_capable = np.zeros((n, self.gpu_slots), dtype=bool)
        for i, node in enumerate(self.nodes):
            for j, gpu in enumerate(node.gpus):
                if gpu.index != j:
                    raise ValueError(f"node {node.name}: GPU indices must be 0..{len(node.gpus) - 1} in order")
                self.gpu_model[i, j] = model_id[gpu.model]
                self.gpu_mem_total[i, j] = gpu.memory_mib
                whole_capable[i, j] = not gpu.mig_enabled
                for s in gpu.mig_slices:
                    self.mig_total[s.profile][i] += 1
        self.gpu_usable = whole_capable  # GPUs that take whole or shared pods (not MIG-split)

        # allocation state
        self.cpu_free = self.cpu_total.copy()
        self.mem_free = self.mem_total.copy()
        self.pods_free = self.pods_total.copy()
        self.free_milli = np.where(whole_capable, MILLI, ABSENT).astype(np.int64)
        self.gpu_mem_free = np.where(whole_capable, self.gpu_mem_total, 0)
        self.mig_free = {p: v.copy() for p, v in self.mig_total.items()}
        self.mig_taken: list[set[str]] = [set() for _ in range(n)]
        self.gpu_tags: list[Counter[str]] = [Counter() for _ in range(n)]
        self.version = np.zeros(n, dtype=np.int64)
        self.caches: dict[object, object] = {}  # derived data keyed by its owner; validated by `version`
        self.set_tie_order(tie_order)

    # ---- views -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def total_gpu_milli(self) -> int:
        return int(self.gpu_count.sum()) * MILLI

    def set_tie_order(self, order: Sequence[str] | None) -> None:
        """Equal scores go to the node that comes first in ``order`` (default: node name order)."""
        keys = list(order) if order is not None else [n.name for n in self.nodes]
        if len(keys) != len(self.nodes):
            raise ValueError(f"tie order has {len(keys)} entries for {len(self.nodes)} nodes")
        rank = np.argsort(np.argsort(np.array(keys, dtype=object), kind="stable"), kind="stable")
        self.tie_rank = rank.astype(np.int64)

    def used_gpu_milli(self) -> int:
        """Allocated GPU capacity in milli-GPU (shared GPUs count fractionally; MIG slices excluded)."""
        used = np.where(self.gpu_usable, MILLI - self.free_milli, 0)
        return int(used.sum())

    def allowed_models(self, models: Iterable[str]) -> np.ndarray:
        """Boolean [nodes, slots]: GPUs whose model is in ``models`` (all GPUs when empty)."""
        models = tuple(models)
        if not models:
            return self.gpu_model != ABSENT
        wanted = [self.models.index(m) for m in models if m in self.models]
        return np.isin(self.gpu_model, wanted)

    def copy(self) -> ClusterSnapshot:
        other = object.__new__(ClusterSnapshot)
        for key, value in self.__dict__.items():
            if isinstance(value, np.ndarray):
                value = value.copy()
            elif key == "mig_free":
                value = {p: v.copy() for p, v in value.items()}
            elif key == "mig_taken":
                value = [set(s) for s in value]
            elif key == "gpu_tags":
                value = [Counter(c) for c in value]
            elif key == "caches":
                value = {}
            other.__dict__[key] = value
        return other

    # ---- mutation ----------------------------------------------------------------------------
    def assume(self, request: PodRequest, placement: Placement) -> None:
        """Account ``request`` on the node and GPUs of ``placement``."""
        self._apply(request, placement, +1)

    def release(self, request: PodRequest, placement: Placement) -> None:
        """Undo :meth:`assume` (a pod finished, was preempted, or a bind failed)."""
        self._apply(request, placement, -1)

    def _apply(self, request: PodRequest, placement: Placement, sign: int) -> None:
        i = self.index[placement.node]
        self.cpu_free[i] -= sign * request.cpu_milli
        self.mem_free[i] -= sign * request.memory_mib
        self.pods_free[i] -= sign
        for j in placement.gpu_indices:
            self.free_milli[i, j] -= sign * placement.gpu_milli
            self.gpu_mem_free[i, j] -= sign * placement.gpu_memory_mib
        if placement.mig_devices:
            node = self.nodes[i]
            by_uuid = {s.uuid: s for g in node.gpus for s in g.mig_slices}
            for uuid in placement.mig_devices:
                profile = by_uuid[uuid].profile
                if sign > 0:
                    self.mig_taken[i].add(uuid)
                else:
                    self.mig_taken[i].discard(uuid)
                self.mig_free[profile][i] -= sign
        tag = request.gpu_tag()
        if tag != "cpu":
            self.gpu_tags[i][tag] += sign
            if self.gpu_tags[i][tag] <= 0:
                del self.gpu_tags[i][tag]
        self.version[i] += 1
