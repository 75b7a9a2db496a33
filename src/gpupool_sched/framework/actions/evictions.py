"""What preempt and reclaim share: whether the job may evict now, the plan (pure; computed off the
loop when the session offloads), the check that an off-loop plan still holds, and the statement that
marks its victims and nominates the members that wait for them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.framework.session import IdleVictims, Outcome, Planning, Session, Steps
from gpupool_sched.framework.statement import Statement, free_room
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
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
    policy, rng, plans, budget = session.policy, session.rng, session.plans, session.candidates
    # the room held for the job itself and for nominees of lower priority is free to it (kube-scheduler
    # counts nominated pods only against pods of their priority or lower): the statement releases it too
    own, lowest = {p.uid for p in plans}, min(p.priority for p in plans)
    if session.state.unheld(own, lowest):
        snapshot = session.state.unheld_snapshot(own, lowest)
    else:
        snapshot = session.state.snapshot.copy() if session.offload else session.state.snapshot
    compute: Callable[[], Any]
    if session.gang:
        requests = [p.request for p in plans]

        def compute() -> GangPreemption | None:
            return plan_gang_preemption(snapshot, requests, session.need, priority, candidates, policy, rng,
                                        budget=budget)
    else:
        def compute() -> Preemption | None:
            # the memo only inline: an off-loop plan runs on another thread
            memo = None if session.offload else session.memo
            return plan_preemption(snapshot, plans[0].request, priority, candidates, policy, rng, budget=budget,
                                   memo=memo)

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
    nominees = _nominees(session, plan)
    if session.offload and not _still_holds(session, plan, nominees):
        return Outcome(stale=True)
    with Statement(session.state) as statement:
        statement.release_holds(plans)  # what the plan may count on; lower nominees lose it on its node
        for member, preemption, room in nominees:
            statement.evict(session.plans[member], preemption, session.hold_s(v.uid for v in preemption.victims),
                            room)
        statement.commit()
    return Outcome(statement, plan, reclaim=reclaiming, idle=idle)


Nominee = tuple[int, Preemption, list[tuple[PodRequest, Placement]]]


def _nominees(session: Session, plan: Preemption | GangPreemption) -> list[Nominee]:
    """The members to nominate (index, their preemption, the free room held for them), each held for its
    victims' longest grace plus the slack. A gang's free room on a node (what its members there take beyond
    all the gang's victims there) is held for the first member nominated there; a node where no member
    needs victims has no nomination, and nothing is held there (its members fit as things are)."""
    if not isinstance(plan, GangPreemption):
        return [(0, plan, free_room(session.state, session.plans[0], plan))]
    out: list[Nominee] = []
    roomed: set[str] = set()
    for member in plan.members:
        if not member.victims:
            continue
        node = member.placement.node
        preemption = Preemption(node, member.victims, member.placement, 0)
        room: list[tuple[PodRequest, Placement]] = []
        if node not in roomed:
            roomed.add(node)
            takes = [(session.plans[m.member].request, m.placement) for m in plan.members if m.placement.node == node]
            together = Preemption(node, plan.victims, member.placement, 0)
            room = free_room(session.state, session.plans[member.member], together, takes)
        out.append((member.member, preemption, room))
    return out


def _still_holds(session: Session, plan: Preemption | GangPreemption, nominees: list[Nominee]) -> bool:
    """What an off-loop plan relied on, checked on the live cache: every victim still accounted and not
    being evicted, its node still there, no member placed or gone meanwhile, the free room it counts on
    still free."""
    state = session.state
    for victim in plan.victims:
        entry = state.pods.get(victim.uid)
        if (entry is None or entry.evicting_for is not None or not entry.applied
                or entry.phase not in (Phase.BOUND, Phase.CONFIRMED) or entry.node not in state.nodes):
            return False
    if any(p.uid in state.pods or state.is_gone(p.uid) for p in session.plans):
        return False
    room = [pair for _, _, held in nominees for pair in held]
    return not room or _fit_together(state.unheld_snapshot({p.uid for p in session.plans},
                                                           min(p.priority for p in session.plans)), room)


def _fit_together(snapshot: ClusterSnapshot, pairs: list[tuple[PodRequest, Placement]]) -> bool:
    """`snapshot` can take every (request, placement) of `pairs` at once (it is left as it was)."""
    taken: list[tuple[PodRequest, Placement]] = []
    try:
        for request, placement in pairs:
            if not snapshot.fits(request, placement):
                return False
            snapshot.assume(request, placement)
            taken.append((request, placement))
        return True
    finally:
        for request, placement in reversed(taken):
            snapshot.release(request, placement)

