"""What a node offers, as placement sees it (model/cluster.py): its GPUs (`GpuSpec`) and their MIG
devices (`MigSlice`), CPU, memory, labels, taints and cordon (`NodeSpec`), and the part of a node that
node constraints are evaluated against (`NodeSignature`). Pure values; the allocation on a node lives
in the ClusterSnapshot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpupool_sched.model.constraints import HARD_EFFECTS, Taint

if TYPE_CHECKING:
    from gpupool_common.topology import NodeTopology


@dataclass(frozen=True, slots=True)
class MigSlice:
    """One MIG device of a MIG-enabled GPU."""

    uuid: str
    profile: str  # e.g. "1g.10gb"
    gpu_index: int


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One physical GPU of a node. ``memory_mib == 0`` means unknown (trace replays): memory shares
    cannot land there, compute shares and whole-GPU requests can. An unhealthy GPU (the device plugin
    reports it failed) keeps its index but takes no new pods: neither whole, shared nor its MIG slices."""

    index: int
    model: str
    memory_mib: int = 0
    uuid: str = ""
    numa_node: int | None = None
    mig_enabled: bool = False
    mig_slices: tuple[MigSlice, ...] = ()
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What a node offers; the allocation on it lives in :class:`ClusterSnapshot`.

    ``taints`` and ``unschedulable`` (a cordon) are the node's, as Kubernetes has them."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuSpec, ...] = ()
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)
    topology: NodeTopology | None = None
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False

    @property
    def gpu_model(self) -> str:
        """The node's GPU model ('' without GPUs; models joined by '+' on mixed nodes)."""
        return "+".join(sorted({g.model for g in self.gpus}))


@dataclass(frozen=True, slots=True)
class NodeSignature:
    """What node constraints are evaluated against, minus the name. Many nodes share one, so filters
    evaluate a pod's constraints once per signature instead of once per node."""

    labels: tuple[tuple[str, str], ...]
    taints: tuple[Taint, ...]
    unschedulable: bool

    @classmethod
    def of(cls, spec: NodeSpec) -> NodeSignature:
        return cls(tuple(sorted(spec.labels.items())), tuple(spec.taints), bool(spec.unschedulable))

    @property
    def hard_tainted(self) -> bool:
        return any(t.effect in HARD_EFFECTS for t in self.taints)

    def label_map(self) -> dict[str, str]:
        return dict(self.labels)
