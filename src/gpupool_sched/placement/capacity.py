"""Per-node resource vectors shared by the classic score plugins."""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import MILLI


def gpu_milli_free(snapshot: ClusterSnapshot, nodes: np.ndarray) -> np.ndarray:
    """Idle milli-GPU per node (shareable GPUs only)."""
    return np.clip(snapshot.free_milli[nodes], 0, None).sum(axis=1)  # type: ignore[no-any-return]


def max_node_capacity(snapshot: ClusterSnapshot) -> tuple[float, float]:
    """(milli-CPU, milli-GPU) of the largest node: the scale the classic heuristics normalise by."""
    cpu = float(snapshot.cpu_total.max()) if len(snapshot) else 1.0
    gpu = float(snapshot.gpu_count.max() * MILLI) if len(snapshot) else 1.0
    return max(cpu, 1.0), max(gpu, 1.0)
