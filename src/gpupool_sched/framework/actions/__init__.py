"""The actions a decision runs, in this declared order; the first that changes something ends it.

    allocate     place the job as things are (decide / place_gang), a preemptor's holds its own and a
                 replacement's reservation its own
    give-back    take back borrowed replicas of elastic Deployments (a scale-down, cheapest first, never
                 below their min), whatever their priority: ending a loan is cheaper than moving or killing
    consolidate  move running pods of no higher priority so that a lone pod fits (every mover with a
                 destination held before it is evicted): moving is cheaper than killing
    reclaim-idle evict pods their device plugin lists idle past their policy's idleAfter (reclaimWhenNeeded
                 or reclaim) when the job is within its GpuQuota's guarantee or above every victim's
                 priority: evicting idle work is cheaper than killing busy work
    preempt      evict pods of lower priority than every member (kube-scheduler's DefaultPreemption)
    reclaim      evict pods other teams borrow beyond their GpuQuota, whatever their priority (Kueue's
                 reclaimWithinCohort: Any), when preemption by priority found no plan

Preemption by priority comes before reclaim so that a pod of high priority never takes a team's
borrowed room while lower-priority pods could make way (docs/architecture.md). Adding an action is a
module with `NAME` and `run(session) -> Steps[Outcome | None]`, and a line below.
"""

from __future__ import annotations

from collections.abc import Callable

from gpupool_sched.framework.actions import allocate, consolidate, give_back, preempt, reclaim, reclaim_idle
from gpupool_sched.framework.session import Outcome, Session, Steps

Action = Callable[[Session], Steps[Outcome | None]]

ACTIONS: tuple[tuple[str, Action], ...] = (
    (allocate.NAME, allocate.run),
    (give_back.NAME, give_back.run),
    (consolidate.NAME, consolidate.run),
    (reclaim_idle.NAME, reclaim_idle.run),
    (preempt.NAME, preempt.run),
    (reclaim.NAME, reclaim.run),
)
