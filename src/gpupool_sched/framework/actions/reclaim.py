"""Reclaim: a team takes back its guaranteed GPUs from pods other teams borrow beyond their GpuQuota,
whatever those pods' priority (Kueue's reclaimWithinCohort: Any); the plan treats the job as above all
of them. The candidates come from the quota book (`QuotaBook.reclaim_gang`)."""

from __future__ import annotations

from gpupool_sched.framework.actions.evictions import evict, may_evict
from gpupool_sched.framework.session import Outcome, Session, Steps

NAME = "reclaim"


def run(session: Session) -> Steps[Outcome | None]:
    if session.reclaim is None or not may_evict(session):
        return None
    borrowed = session.reclaim()
    if not borrowed:
        return None
    return (yield from evict(session, max(v.priority for v in borrowed) + 1, borrowed, reclaiming=True))
