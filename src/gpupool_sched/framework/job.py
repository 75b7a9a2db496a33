"""The unit of scheduling: a job is a PodGroup's pending members, or one pod as a gang of one.

Quota admission, preemption eligibility, reclaim, reporting and binding are written once, for jobs
(`gpupool_sched.scheduler.scheduling`); only the placement call differs (`decide` for a gang of one,
`place_gang` for a gang), because a lone pod's answer must stay the placement core's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpupool_sched.framework.plugins.gangs import PodGroup
from gpupool_sched.framework.queue import QueuedPod
from gpupool_sched.kube.podspec import PodPlan


@dataclass(slots=True)
class Job:
    key: str  # namespace/name of the PodGroup, or of the lone pod
    plans: list[PodPlan]  # the members to decide for now, the popped pod first
    items: list[QueuedPod]  # their queue entries, in the same order
    need: int = 1  # how many of them must be placed together now
    group: PodGroup | None = None  # None: a gang of one
    placed: list[str] = field(default_factory=list)  # members already in the ledger (a gang short of some)

    @property
    def gang(self) -> bool:
        return self.group is not None

    @property
    def priority(self) -> int:
        """The job preempts only pods below all of its members."""
        return min(p.priority for p in self.plans)

    def says(self, message: str) -> str:
        """A message for the members' Events: a gang's names its PodGroup."""
        return f"PodGroup {self.key}: {message}" if self.gang else message

    def first(self, count: int) -> Job:
        """The job with only its first `count` members (the rest wait)."""
        return Job(self.key, self.plans[:count], self.items[:count], self.need, self.group, self.placed)
