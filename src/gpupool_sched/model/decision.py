"""What placement answers: where a pod goes, or why it fits nowhere."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Placement:
    """A node, the GPUs (or MIG devices) the pod takes there, and how the policy scored it.

    ``gpu_milli`` and ``gpu_memory_mib`` are what the pod takes on *each* GPU in ``gpu_indices``;
    a whole GPU (``gpu_milli == 1000``) takes all of its own memory, whatever ``gpu_memory_mib`` says
    (it holds the first GPU's memory, for display). ``extras`` places the request's ``extra`` shapes,
    one Placement each, in the same order and on the same node; their score and breakdown are empty.
    """

    node: str
    gpu_indices: tuple[int, ...] = ()
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    mig_devices: tuple[str, ...] = ()
    score: float = 0.0
    breakdown: Mapping[str, float] = field(default_factory=dict)
    extras: tuple[Placement, ...] = ()

    @property
    def schedulable(self) -> bool:
        return True

    def parts(self) -> tuple[Placement, ...]:
        """This placement's primary part followed by its extras."""
        return (self, *self.extras)


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """No node fits. Each node is rejected by the first filter it failed: ``filter_reasons[k]`` is the
    message of filter k and ``failed_filter[i]`` the filter that rejected ``node_names[i]``."""

    node_names: Sequence[str]
    filter_reasons: Sequence[str]
    failed_filter: Sequence[int] | np.ndarray  # decide() gives an int array

    @property
    def schedulable(self) -> bool:
        return False

    @property
    def node_reasons(self) -> dict[str, str]:
        return {n: self.filter_reasons[k] for n, k in zip(self.node_names, self.failed_filter, strict=True)}

    @property
    def reason_counts(self) -> Counter[str]:
        return Counter(self.filter_reasons[k] for k in self.failed_filter)

    @property
    def message(self) -> str:
        """kube-scheduler style: ``0/3 nodes are available: 2 Insufficient cpu, 1 ...``."""
        total = len(self.node_names)
        if not total:
            return "0/0 nodes are available: the cluster has no nodes."
        counts = sorted(self.reason_counts.items(), key=lambda rc: (-rc[1], rc[0]))
        return f"0/{total} nodes are available: " + ", ".join(f"{c} {r}" for r, c in counts) + "."


Decision = Placement | Unschedulable
