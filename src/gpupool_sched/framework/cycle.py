"""One scheduling cycle: a job (a pod, or a gang's members) in, a committed statement out.

The cycle opens a session for the job (`framework.session`) and runs the actions in their declared
order (`framework.actions`: allocate, give-back, consolidate, reclaim-idle, preempt, reclaim), each asking the
pure placement core and recording what it decides as a statement (`framework.statement`): placements assumed,
or victims marked and members nominated. `schedule` / `schedule_gang` decide inline (the simulator's and the
tests' way); the service drives the same steps with eviction planning on a worker thread (`drive_offloaded`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.actions import ACTIONS
from gpupool_sched.framework.plugins.victims import DEFAULT_MAX_CHECKPOINT_GRACE_S, nomination_timeout_s
from gpupool_sched.framework.session import (
    Candidates,
    IdleCandidates,
    IdleVictims,
    Movers,
    Outcome,
    Session,
    Steps,
    drive,
)
from gpupool_sched.framework.statement import Statement
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.decision import Unschedulable
from gpupool_sched.placement.candidates import CandidateBudget
from gpupool_sched.placement.consolidation import DEFAULT_MAX_MOVERS, Consolidation
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gang import GangUnschedulable
from gpupool_sched.placement.gang_preemption import GangPreemption
from gpupool_sched.placement.preemption import Preemption
from gpupool_sched.placement.preemption_memo import PreemptionMemo
from gpupool_sched.placement.sampling import NodeSampler


@dataclass(frozen=True, slots=True)
class CycleResult:
    plan: PodPlan
    statement: Statement | None  # committed: a placement, or evictions; None when nothing is to be done
    unschedulable: Unschedulable | None
    seconds: float  # time in the placement core
    preemption: Preemption | None = None  # what the statement's evictions are (the pod itself is unschedulable)
    reclaim: bool = False  # the evictions take back borrowed quota (victims of any priority)
    # the best plan needs victims a PodDisruptionBudget protects: not carried out, the pod waits
    blocked_by_budget: Preemption | None = None
    stale: bool = False  # an off-loop plan no longer held when it came back: nothing done, try again
    migration: Consolidation | None = None  # the statement's evictions move pods for it (consolidate)
    deferred: Consolidation | None = None  # a move would place it later: nothing done, no preemption now
    idle: IdleVictims | None = None  # the evictions (or the blocked plan) take idle pods (reclaim-idle)
    give_back: bool = False  # the evictions are borrowed replicas given back (give-back: a scale-down)


@dataclass(frozen=True, slots=True)
class GangResult:
    # committed: every placed member assumed, or (with `preemption`) the members' evictions; None: nothing
    statement: Statement | None
    unschedulable: GangUnschedulable | None
    seconds: float
    preemption: GangPreemption | None = None  # what the statement's evictions are (the gang waits for them)
    blocked_by_budget: GangPreemption | None = None  # needs victims a PodDisruptionBudget protects: waits
    reclaim: bool = False  # the evictions take back borrowed quota (victims of any priority)
    stale: bool = False  # an off-loop plan no longer held when it came back: nothing done, try again
    idle: IdleVictims | None = None  # the evictions (or the blocked plan) take idle pods (reclaim-idle)
    give_back: bool = False  # the evictions are borrowed replicas given back (give-back: a scale-down)


class Cycle:
    """Binds the core to the live state: which policy (rebuilt when the workload profile changes),
    which node sample, which random stream."""

    def __init__(
        self,
        state: ClusterState,
        policy: Callable[[], Policy],
        *,
        percentage_of_nodes_to_score: int | None = None,
        seed: int = 0,
        nomination_slack_s: float = 60.0,
        max_preemptions: int = 3,
        max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S,
        candidates: CandidateBudget | None = None,
        max_movers: int = DEFAULT_MAX_MOVERS,
    ) -> None:
        self.state = state
        self.max_movers = max_movers  # movers a consolidation may plan for one pod
        # how many viable nodes end a preemption search (kube-scheduler's minCandidateNodes*; None: 10 %, 100)
        self.candidates = candidates
        # a pod preempts at most this often (an eviction refused, room lost to another scheduler, holds
        # expired): past it, it waits like a Never pod, so no two schedulers fight over a node forever
        self.max_preemptions = max_preemptions
        self.nomination_slack_s = nomination_slack_s  # holds last the victims' grace plus this
        self.max_checkpoint_grace_s = max_checkpoint_grace_s  # gpupool.io/checkpoint-grace-seconds cap
        self.policy = policy
        # None: score every feasible node (what the simulator does); else kube-scheduler's sampling
        self.sampler = None if percentage_of_nodes_to_score is None else NodeSampler(0, percentage_of_nodes_to_score)
        self.rng = np.random.default_rng(seed)
        self.preemption_memo = PreemptionMemo()  # what earlier plans found per node (inline plans only)

    def hold_s(self, victims: Iterable[str]) -> float:
        """How long a nomination for `victims` holds their room: their longest eviction grace + the slack."""
        return nomination_timeout_s(self.state, victims, self.nomination_slack_s, self.max_checkpoint_grace_s)

    def session(self, plans: list[PodPlan], need: int, *, gang: bool, running: Candidates | None = None,
                reclaim: Candidates | None = None, offload: bool = False, movable: Movers | None = None) -> Session:
        return Session(self.state, plans, need, gang, self.policy(), self.rng, self.sampler, running, reclaim,
                       self.hold_s, self.max_preemptions, offload, self.candidates, movable, self.max_movers,
                       self.state.migrating_nodes, memo=self.preemption_memo)

    @staticmethod
    def run(session: Session) -> Steps[Outcome]:
        """The actions in their declared order (`framework.actions.ACTIONS`); the first that changes
        something ends the decision."""
        for _name, action in ACTIONS:
            outcome = yield from action(session)
            if outcome is not None:
                return outcome
        return Outcome()

    def decide(self, plans: list[PodPlan], need: int, *, gang: bool, running: Candidates | None = None,
               reclaim: Candidates | None = None, offload: bool = False,
               movable: Movers | None = None, max_movers: int | None = None,
               moves_later: bool = False, idle: IdleCandidates | None = None,
               borrowed: Candidates | None = None) -> Steps[CycleResult | GangResult]:
        """The steps of one decision, for a driver: `schedule` / `schedule_gang` run them inline, the
        service with eviction planning on a worker thread (`offload`). `movable`: the pods a lone pod may
        move out of its way (consolidate; at most `max_movers`, default the cycle's); None: none.
        `moves_later`: it may not move them yet; a move that would place it defers preemption."""
        session = self.session(plans, need, gang=gang, running=running, reclaim=reclaim, offload=offload,
                               movable=movable)
        session.moves_later = moves_later
        session.borrowed = borrowed  # borrowed replicas it may take back (give-back)
        session.idle = idle
        if max_movers is not None:
            session.max_movers = max_movers
        outcome = yield from self.run(session)
        return gang_result(session, outcome) if gang else pod_result(session, outcome)

    def schedule(self, plan: PodPlan, running: Candidates | None = None,
                 reclaim: Candidates | None = None, movable: Movers | None = None) -> CycleResult:
        """Decide for `plan`. With `running` (the pod may preempt: its policy is not Never) a pod that
        fits nowhere may preempt pods of lower priority among `running()`, unless its earlier victims
        are still terminating (kube-scheduler's PodEligibleToPreemptOthers). With `reclaim` (its team
        takes back guaranteed quota that others borrow), it may also evict those pods whatever their
        priority (Kueue's reclaimWithinCohort: Any), when preemption by priority finds no plan."""
        session = self.session([plan], 1, gang=False, running=running, reclaim=reclaim, movable=movable)
        return pod_result(session, drive(self.run(session)))

    def schedule_gang(self, plans: list[PodPlan], need: int, running: Candidates | None = None,
                      reclaim: Candidates | None = None) -> GangResult:
        """Decide for a gang's pending members together: at least `need` of them placed (and assumed in
        one statement), or none. The members' own holds (from an earlier gang preemption) are theirs for
        the decision. With `running` (every member may preempt), a gang that does not fit may evict pods
        of lower priority than all its members, only where that makes its minimum fit together
        (`plan_gang_preemption`), and not while victims of an earlier attempt are still terminating.
        With `reclaim` too (its team takes back guaranteed quota others borrow), it may evict those
        borrowed pods whatever their priority when preemption by priority finds no plan."""
        session = self.session(plans, need, gang=True, running=running, reclaim=reclaim)
        return gang_result(session, drive(self.run(session)))


def pod_result(session: Session, outcome: Outcome) -> CycleResult:
    plan, unschedulable = session.plans[0], session.unschedulable
    assert not isinstance(unschedulable, GangUnschedulable)
    preemption, blocked = outcome.preemption, outcome.blocked_by_budget
    assert not isinstance(preemption, GangPreemption) and not isinstance(blocked, GangPreemption)
    return CycleResult(plan, outcome.statement, unschedulable, session.seconds, preemption,
                       outcome.reclaim and preemption is not None, blocked, outcome.stale, outcome.migration,
                       outcome.deferred, outcome.idle, give_back=outcome.give_back)


def gang_result(session: Session, outcome: Outcome) -> GangResult:
    unschedulable = session.unschedulable
    assert not isinstance(unschedulable, Unschedulable)
    preemption, blocked = outcome.preemption, outcome.blocked_by_budget
    assert not isinstance(preemption, Preemption) and not isinstance(blocked, Preemption)
    return GangResult(outcome.statement, unschedulable, session.seconds, preemption, blocked,
                      outcome.reclaim and preemption is not None, outcome.stale, outcome.idle,
                      give_back=outcome.give_back)
