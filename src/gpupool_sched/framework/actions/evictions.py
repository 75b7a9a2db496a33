"""What preempt and reclaim share: whether the job may evict now, the plan (pure; computed off the
loop when the session offloads), the check that an off-loop plan still holds, and the statement that
marks its victims and nominates the members that wait for them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.framework.session import IdleVictims, Outcome, Planning, Session, Steps
from gpupool_sched.framework.statement import Statement
from gpupool_sched.placement.gang_preemption import GangPreemption, plan_gang_preemption
from gpupool_sched.placement.preemption import Preemption, RunningPod, plan_preemption


def may_evict(session: Session) -> bool:
    """Not without candidates (a Never pod), not while victims of an earlier attempt are still terminating
    (kube-scheduler's PodEligibleToPreemptOthers), not past `max_preemptions` (no two schedulers fight
    over a node for ever)."""
    state = session.state
    if session.running is None or any(state.nomination_live(p.uid) for p in session.plans):
        return False
    return not any(state.preemptions.get(p.uid, 0) >= session.max_preemptions for p in session.plans)


def evict(session: Session, priority: int, candidates: list[RunningPod], reclaiming: bool,
          idle: IdleVictims | None = None) -> Steps[Outcome | None]:
    """Plan evictions among `candidates` as if the job had `priority`; None when no plan has victims.
    `idle`: the candidates are idle pods (reclaim-idle); a plan that takes a gang member without its whole
    gang, or one a PodDisruptionBudget blocks, is not carried out (None: preempt and reclaim are tried)."""
    snapshot = session.state.snapshot.copy() if session.offload else session.state.snapshot
    policy, rng, plans, budget = session.policy, session.rng, session.plans, session.candidates
    compute: Callable[[], Any]
    if session.gang:
        requests = [p.request for p in plans]

        def compute() -> GangPreemption | None:
            return plan_gang_preemption(snapshot, requests, session.need, priority, candidates, policy, rng,
                                        budget=budget)
    else:
        def compute() -> Preemption | None:
            return plan_preemption(snapshot, plans[0].request, priority, candidates, policy, rng, budget=budget)

    timed: list[float] = []

    def measured() -> Any:
        start = time.perf_counter()
        try:
            return compute()
        finally:
            timed.append(time.perf_counter() - start)

    plan: Preemption | GangPreemption | None = yield Planning(measured)
    session.seconds += sum(timed)
    if plan is None or not plan.victims:
        return None
    if idle is not None and not idle.whole(v.uid for v in plan.victims):
        return None  # a gang is reclaimed whole or not at all
    if plan.pdb_violations:
        # the plan already has the fewest violations: every node needs a protected victim. The Eviction
        # API would refuse it (429) after the unprotected victims were gone, so evict nobody
        if idle is not None:  # taking idle pods was only cheaper: the next actions may still find a way
            idle.on_blocked()
            return None
        return Outcome(blocked_by_budget=plan, reclaim=reclaiming)
    if session.offload and not _still_holds(session, plan):
        return Outcome(stale=True)
    with Statement(session.state) as statement:
        if isinstance(plan, GangPreemption):
            for member in plan.members:
                if member.victims:
                    _nominate(session, statement, member.member,
                              Preemption(member.placement.node, member.victims, member.placement, 0))
        else:
            _nominate(session, statement, 0, plan)
        statement.commit()
    return Outcome(statement, plan, reclaim=reclaiming, idle=idle)


def _nominate(session: Session, statement: Statement, member: int, preemption: Preemption) -> None:
    """The member nominated on `preemption`'s node, held for its victims' longest grace plus the slack."""
    statement.evict(session.plans[member], preemption, session.hold_s(v.uid for v in preemption.victims))


def _still_holds(session: Session, plan: Preemption | GangPreemption) -> bool:
    """What an off-loop plan relied on, checked on the live cache: every victim still accounted and not
    being evicted, its node still there, no member placed or gone meanwhile."""
    state = session.state
    for victim in plan.victims:
        entry = state.pods.get(victim.uid)
        if (entry is None or entry.evicting_for is not None or not entry.applied
                or entry.phase not in (Phase.BOUND, Phase.CONFIRMED) or entry.node not in state.nodes):
            return False
    return not any(p.uid in state.pods or state.is_gone(p.uid) for p in session.plans)
