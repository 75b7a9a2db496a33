"""What a parked pod waits for (framework/queue.py): a cluster event that may make an unschedulable pod
fit (`ClusterEvent`), or the usage of a GpuQuota's team dropping (`QuotaFreed`); a `Hint` is either.
The queue wakes the pods parked on a hint when it is reported (`SchedulingQueue.on_event`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ClusterEvent(StrEnum):
    """What may make an unschedulable pod fit; `park` lists the ones a pod waits for."""

    NODE_ADDED = "NodeAdded"  # a node appeared (or was seen for the first time): capacity, models, profiles
    NODE_CHANGED = "NodeChanged"  # a node's allocatable, labels, taints, cordon or GPU inventory changed
    GPU_FREED = "GpuFreed"  # a pod released what it held on a node (ended, deleted, bind failed, forgotten)
    BUDGET_RELAXED = "BudgetRelaxed"  # a PodDisruptionBudget allows more disruptions now, or is gone
    QUOTA_CHANGED = "QuotaChanged"  # a GpuQuota or a namespace's labels changed


@dataclass(frozen=True, slots=True)
class QuotaFreed:
    """What the team of GpuQuota `quota` uses dropped (None: any quota's, so the cohort has more to lend):
    wakes only the over-quota pods waiting for that, not every over-quota pod on every freed GPU."""

    quota: str | None


Hint = ClusterEvent | QuotaFreed  # what a parked pod waits for
