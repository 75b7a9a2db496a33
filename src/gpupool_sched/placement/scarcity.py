"""GPU model scarcity: keep the GPU models that constrained tasks need for those tasks.

Many tasks accept any GPU, some only a given model (``gpu_spec`` in the openb trace). When the tasks
that *require* a model ask for more of it than the cluster has, every unconstrained task placed on
that model turns into a constrained task that fails later. The pressure on a model is the demand of
the tasks constrained to it (spread over the models each accepts, in proportion to their supply),
relative to its supply, with demand scaled so the whole workload matches the cluster's capacity.
The score is minus the pressure of the node's GPU model times the GPUs the pod takes: ties between
equally good nodes go to the least demanded model, and an unconstrained pod pays for taking a
scarce model.
"""

from __future__ import annotations

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.fragmentation import WorkloadProfile, cached_for_profile
from gpupool_sched.placement.framework import CycleState, ScorePlugin


def model_pressure(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> np.ndarray:
    """Pressure per model index of ``snapshot.models`` (0 for models no task is constrained to)."""
    usable = snapshot.gpu_usable
    supply = np.array([float(((snapshot.gpu_model == m) & usable).sum()) for m in range(len(snapshot.models))])
    demand = np.zeros_like(supply)
    total = 0.0
    for c in profile.classes:
        weight = c.count * c.gpu_milli * c.gpu_count / MILLI
        total += weight
        ids = [snapshot.models.index(m) for m in c.models if m in snapshot.models]
        if c.gpu_milli and ids and supply[ids].sum() > 0:
            demand[ids] += weight * supply[ids] / supply[ids].sum()
    if total == 0 or supply.sum() == 0:
        return np.zeros_like(supply)
    demand *= supply.sum() / total  # the workload scaled to the cluster's size
    return np.divide(demand, supply, out=np.zeros_like(supply), where=supply > 0)  # type: ignore[no-any-return]


def node_pressure(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> np.ndarray:
    """Mean pressure of each node's usable GPUs (cached on the snapshot; node specs are static)."""

    def build() -> np.ndarray:
        per_model = model_pressure(snapshot, profile)
        ids = np.where(snapshot.gpu_usable, snapshot.gpu_model, -1)
        values = np.where(ids >= 0, per_model[np.maximum(ids, 0)] if per_model.size else 0.0, 0.0)
        count = (ids >= 0).sum(axis=1)
        return (  # type: ignore[no-any-return]
            np.divide(values.sum(axis=1), count, out=np.zeros(len(snapshot)), where=count > 0)
        )

    return cached_for_profile(snapshot, "model-pressure", profile, build, lambda pressure: pressure)  # read-only


class ScarcityScore(ScorePlugin):
    name = "ModelScarcity"

    def __init__(self, profile: WorkloadProfile) -> None:
        self.profile = profile

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        gpus = state.milli_taken(candidates) / MILLI
        return -node_pressure(state.snapshot, self.profile)[candidates] * gpus  # type: ignore[no-any-return]
