"""Reclaim idle: evict pods their device plugin lists idle past their policy's idleAfter (action
reclaimWhenNeeded or reclaim) so that the job fits, when the job is within its GpuQuota's guarantee or of
strictly higher priority than every victim (docs/idle-and-elastic.md). Before preempt: evicting idle work is
cheaper than killing busy work. The same planners as preempt and reclaim, PodDisruptionBudgets counted; the
candidates come from framework/plugins/idle.py through `Session.idle` (never-annotation, start grace, whole
gangs, the hourly budget already applied there), and a plan that would take a gang member without its whole
gang is not carried out."""

from __future__ import annotations

from gpupool_sched.framework.actions.evictions import evict, may_evict
from gpupool_sched.framework.session import Outcome, Session, Steps

NAME = "reclaim-idle"


def run(session: Session) -> Steps[Outcome | None]:
    if session.idle is None or not may_evict(session):
        return None
    found = session.idle()
    if found is None or not found.candidates:
        return None
    return (yield from evict(session, found.priority, found.candidates, reclaiming=False, idle=found))
