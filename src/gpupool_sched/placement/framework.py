"""The shape of a placement policy, after kube-scheduler's framework: filters, then scorers, then
the choice of GPUs on the winning node.

Plugins work on all nodes at once (numpy arrays indexed by node), because the simulator calls them
hundreds of thousands of times and the scheduler must stay fast at tens of thousands of nodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import MILLI, PodRequest


class CycleState:
    """Per-decision scratch space shared by the plugins (kube-scheduler's CycleState)."""

    def __init__(self, snapshot: ClusterSnapshot, request: PodRequest, rng: np.random.Generator | None) -> None:
        self.snapshot = snapshot
        self.request = request
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.scratch: dict[str, Any] = {}
        self._eligible: np.ndarray | None = None
        self._take: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def gpu_take(self) -> tuple[np.ndarray, np.ndarray]:
        """(milli, MiB) the request would take on each GPU slot, as [nodes, slots] arrays."""
        if self._take is None:
            snap, req = self.snapshot, self.request
            total = snap.gpu_mem_total
            if req.is_whole:
                milli = np.full(total.shape, MILLI, dtype=np.int64)
                mem = total.copy()
            elif req.gpu_memory_mib:
                milli = np.where(
                    total > 0, np.maximum(1, req.gpu_memory_mib * MILLI // np.maximum(total, 1)), MILLI + 1
                )
                mem = np.full(total.shape, req.gpu_memory_mib, dtype=np.int64)
            else:
                milli = np.full(total.shape, req.gpu_milli, dtype=np.int64)
                mem = req.gpu_milli * total // MILLI
            self._take = (milli, mem)
        return self._take

    def milli_taken(self, candidates: np.ndarray) -> np.ndarray:
        """Milli-GPU the pod takes on each candidate node. A memory share takes a different share of
        each GPU model; this is the most it would take on a GPU of the node that can host it."""
        if not self.request.gpu_memory_mib:
            return np.full(candidates.size, self.request.gpu_milli_total, dtype=np.int64)
        milli = np.where(self.eligible[candidates], self.gpu_take[0][candidates], 0)
        return milli.max(axis=1)  # type: ignore[no-any-return]

    @property
    def eligible(self) -> np.ndarray:
        """Boolean [nodes, slots]: GPUs that could host this request's share (or one of its whole GPUs)."""
        if self._eligible is None:
            snap, req = self.snapshot, self.request
            milli, mem = self.gpu_take
            if req.is_whole:
                ok = snap.free_milli == MILLI
            else:
                ok = (snap.free_milli >= milli) & (snap.gpu_mem_free >= mem)
                if req.gpu_memory_mib:
                    ok &= snap.gpu_mem_total > 0
            self._eligible = ok & snap.gpu_usable & snap.allowed_models(req.gpu_models)
        return self._eligible


class FilterPlugin(ABC):
    """Rejects nodes. ``reason`` is what users read in the pod's Unschedulable condition."""

    name: str = "filter"

    def applies(self, request: PodRequest) -> bool:
        return True

    @abstractmethod
    def passes(self, state: CycleState) -> np.ndarray:
        """Boolean per node."""

    @abstractmethod
    def reason(self, request: PodRequest) -> str: ...


class ScorePlugin(ABC):
    """Scores candidate nodes; higher is better. With ``normalize`` the scores are min-max scaled
    to 0..100 over the candidates before weighting (kube-scheduler's NormalizeScore)."""

    name: str = "score"
    normalize: bool = False

    @abstractmethod
    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        """One score per candidate node index."""


class GpuSelector(ABC):
    """Picks the GPUs on the chosen node (kube-scheduler's Reserve step for devices)."""

    name: str = "gpus"

    @abstractmethod
    def select(self, state: CycleState, node: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class Policy:
    """A named combination of filters, weighted scorers and a GPU selector."""

    name: str
    filters: tuple[FilterPlugin, ...]
    scorers: tuple[tuple[ScorePlugin, float], ...]
    gpu_selector: GpuSelector
    description: str = ""
    random_tie_break: bool = False
    params: dict[str, Any] = field(default_factory=dict)
