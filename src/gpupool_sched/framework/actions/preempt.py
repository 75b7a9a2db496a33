"""Preempt: evict pods of strictly lower priority than every member (kube-scheduler's DefaultPreemption,
GPU-aware: `placement.preemption`, `placement.gang_preemption`), PodDisruptionBudgets counted."""

from __future__ import annotations

from gpupool_sched.framework.actions.evictions import evict, may_evict
from gpupool_sched.framework.session import Outcome, Session, Steps

NAME = "preempt"


def run(session: Session) -> Steps[Outcome | None]:
    if session.running is None or not may_evict(session):
        return None
    priority = session.priority
    if not session.state.has_lower_priority(priority):
        return None  # cheap: no victim search without pods below it
    return (yield from evict(session, priority, session.running(), reclaiming=False))
