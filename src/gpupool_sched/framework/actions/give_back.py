"""Give back: take borrowed replicas of elastic Deployments back so that the job fits (issue 20 §3,
docs/idle-and-elastic.md#elastic-inference). Before consolidate and preempt: ending a loan is cheaper
than moving or killing work. The candidates (`Session.borrowed`, scheduler/elastic.py) are only replicas
beyond each Deployment's `min`, ranked by the give-back order (the fewest requests in flight, then the
youngest) through their plan priority, so the planner keeps the costliest and never reaches a `min`
replica. The job's own priority does not matter: a borrowed replica ranks below every guaranteed pod.
The plan is the preemption planners' (`evictions.evict`); it is carried out by scaling the Deployment
down (writer/elastic.py), not through the Eviction API, so that its ReplicaSet does not recreate them."""

from __future__ import annotations

from gpupool_sched.framework.actions.evictions import evict
from gpupool_sched.framework.session import Outcome, Session, Steps

NAME = "give-back"


def run(session: Session) -> Steps[Outcome | None]:
    if session.borrowed is None:
        return None
    state = session.state
    if any(state.nomination_live(p.uid) for p in session.plans):
        return None  # what it waits for is going already
    if any(state.preemptions.get(p.uid, 0) >= session.max_preemptions for p in session.plans):
        return None
    loans = session.borrowed()
    if not loans:
        return None
    outcome = yield from evict(session, max(v.priority for v in loans) + 1, loans, reclaiming=False)
    if outcome is not None:
        outcome.give_back = True
    return outcome
