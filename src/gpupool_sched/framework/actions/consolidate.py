"""Consolidate: move running pods so that the job fits, before anything is killed (`placement.consolidation`,
pure: the fewest movers, every one with a destination). Only a lone pod that has waited long enough, with
movable pods of no higher priority (framework/plugins/movers.py decides which and whether the budget
allows), and never towards or from a node where a migration is under way.

The statement holds everything before any eviction: the job is nominated on the node its movers leave
(what they free is held for it as they go, as for preemption's victims) and each mover's destination is
reserved for its replacement. The writer then evicts the movers (writer/migrator.py)."""

from __future__ import annotations

import time
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.framework.session import Outcome, Planning, Session, Steps
from gpupool_sched.framework.statement import Statement
from gpupool_sched.placement.consolidation import Consolidation, plan_consolidation, still_fits
from gpupool_sched.placement.preemption import Preemption, count_down

NAME = "consolidate"
REPLACEMENT_WINDOW_S = 120.0  # a reservation lasts the mover's grace + the slack + this (controller, watch)


def run(session: Session) -> Steps[Outcome | None]:
    if session.gang or session.movable is None:
        return None
    if session.state.nomination_live(session.plans[0].uid):
        return None  # its movers (or victims) of an earlier attempt are still going: no second migration
    movable = session.movable()
    if not movable:
        return None
    state, plan = session.state, session.plans[0]
    snapshot = state.snapshot.copy() if session.offload else state.snapshot
    busy = frozenset(session.busy() if session.busy is not None else ())
    policy, rng, budget, most = session.policy, session.rng, session.candidates, session.max_movers
    timed: list[float] = []

    def compute() -> Consolidation | None:
        start = time.perf_counter()
        try:
            return plan_consolidation(snapshot, plan.request, plan.priority, movable, policy, rng,
                                      max_movers=most, busy=busy, budget=budget)
        finally:
            timed.append(time.perf_counter() - start)

    found: Any = yield Planning(compute)
    session.seconds += sum(timed)
    if found is None or not found.moves:
        return None
    if any(count_down([m.pod for m in found.moves])):  # the movers together exceed a budget: not this way
        return None
    if session.moves_later:
        return Outcome(deferred=found)  # not yet: and no preemption meanwhile (moving is cheaper)
    if session.offload and not _still_holds(session, found):
        return Outcome(stale=True)
    movers = [m.pod for m in found.moves]
    with Statement(state) as statement:
        hold = session.hold_s(m.uid for m in movers)
        statement.evict(plan, Preemption(found.node, tuple(movers), found.placement, 0), hold)
        for move in found.moves:
            statement.reserve(plan, state.pods[move.pod.uid], move.destination,
                              session.hold_s((move.pod.uid,)) + REPLACEMENT_WINDOW_S)
        statement.commit()
    return Outcome(statement, migration=found)


def _still_holds(session: Session, found: Consolidation) -> bool:
    """What an off-loop plan relied on, checked on the live cache: every mover still accounted where it
    was and not being evicted, no migration started meanwhile on its nodes, the pod still pending."""
    state = session.state
    busy = state.migrating_nodes()
    for move in found.moves:
        entry = state.pods.get(move.pod.uid)
        if (entry is None or entry.evicting_for is not None or not entry.applied or entry.node != move.pod.node
                or entry.phase not in (Phase.BOUND, Phase.CONFIRMED) or move.destination.node not in state.nodes
                or move.destination.node in busy or entry.node in busy):
            return False
    plan = session.plans[0]
    return (plan.uid not in state.pods and not state.is_gone(plan.uid)
            and still_fits(state.snapshot, plan.request, found))
