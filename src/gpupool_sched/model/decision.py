"""What placement answers: where a pod goes, or why it fits nowhere."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Placement:
    """A node, the GPUs (or MIG devices) the pod takes there, and how the policy scored it.

    ``gpu_milli`` and ``gpu_memory_mib`` are what the pod takes on *each* GPU in ``gpu_indices``.
    """

    node: str
    gpu_indices: tuple[int, ...] = ()
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    mig_devices: tuple[str, ...] = ()
    score: float = 0.0
    breakdown: Mapping[str, float] = field(default_factory=dict)

    @property
    def schedulable(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """No node fits. ``node_reasons`` holds, per node, the first filter that rejected it."""

    node_names: Sequence[str]
    reason_of_node: Sequence[str]

    @property
    def schedulable(self) -> bool:
        return False

    @property
    def node_reasons(self) -> dict[str, str]:
        return dict(zip(self.node_names, self.reason_of_node, strict=True))

    @property
    def reason_counts(self) -> Counter[str]:
        return Counter(self.reason_of_node)

    @property
    def message(self) -> str:
        """kube-scheduler style: ``0/3 nodes are available: 2 Insufficient cpu, 1 ...``."""
        total = len(self.node_names)
        if not total:
            return "0/0 nodes are available: the cluster has no nodes."
        parts = ", ".join(f"{c} {r}" for r, c in sorted(self.reason_counts.items(), key=lambda rc: (-rc[1], rc[0])))
        return f"0/{total} nodes are available: {parts}."


Decision = Placement | Unschedulable
