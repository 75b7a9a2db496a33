"""One scheduling cycle: a pod (later: a gang) in, a statement out.

The cycle asks the placement core (`decide`, unchanged and pure) and records its answer as a
`Statement`: tentative operations on the cluster state that are committed or discarded as a whole,
as Volcano's Statement does. A committed statement is what the binder carries out. Preemption is
such a step: a pod that fits nowhere and may preempt gets a `plan_preemption` answer (pure, like
`decide`), recorded as a statement with evictions (victims marked, nomination made) that the preemptor
carries out. A preemptor's holds (what its gone victims freed) are released for its own decision only,
through the statement (`gpupool_sched.framework.statement`), which settles or restores them.
A gang is one statement with several placements: `place_gang` (pure) answers for all of its members
at once, and they are assumed together or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from gpupool_sched.framework.statement import Statement
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Unschedulable
from gpupool_sched.placement.decide import NodeSample, decide
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gang import GangUnschedulable, place_gang
from gpupool_sched.placement.gang_preemption import GangPreemption, plan_gang_preemption
from gpupool_sched.placement.preemption import Preemption, RunningPod, plan_preemption
from gpupool_sched.placement.sampling import NodeSampler
from gpupool_sched.scheduler.podspec import PodPlan
from gpupool_sched.scheduler.preemptor import DEFAULT_MAX_CHECKPOINT_GRACE_S, nomination_timeout_s
from gpupool_sched.scheduler.state import ClusterState, plan_shapes

P = TypeVar("P", Preemption, GangPreemption)  # a pod's plan or a gang's


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


@dataclass(frozen=True, slots=True)
class GangResult:
    # committed: every placed member assumed, or (with `preemption`) the members' evictions; None: nothing
    statement: Statement | None
    unschedulable: GangUnschedulable | None
    seconds: float
    preemption: GangPreemption | None = None  # what the statement's evictions are (the gang waits for them)
    blocked_by_budget: GangPreemption | None = None  # needs victims a PodDisruptionBudget protects: waits
    reclaim: bool = False  # the evictions take back borrowed quota (victims of any priority)


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
    ) -> None:
        self.state = state
        # a pod preempts at most this often (an eviction refused, room lost to another scheduler, holds
        # expired): past it, it waits like a Never pod, so no two schedulers fight over a node forever
        self.max_preemptions = max_preemptions
        self.nomination_slack_s = nomination_slack_s  # holds last the victims' grace plus this
        self.max_checkpoint_grace_s = max_checkpoint_grace_s  # gpupool.io/checkpoint-grace-seconds cap
        self.policy = policy
        # None: score every feasible node (what the simulator does); else kube-scheduler's sampling
        self.sampler = None if percentage_of_nodes_to_score is None else NodeSampler(0, percentage_of_nodes_to_score)
        self.rng = np.random.default_rng(seed)

    def schedule(self, plan: PodPlan, running: Callable[[], list[RunningPod]] | None = None,
                 reclaim: Callable[[], list[RunningPod]] | None = None) -> CycleResult:
        """Decide for `plan`. With `running` (the pod may preempt: its policy is not Never) a pod that
        fits nowhere may preempt pods of lower priority among `running()`, unless its earlier victims
        are still terminating (kube-scheduler's PodEligibleToPreemptOthers). With `reclaim` (its team
        takes back guaranteed quota that others borrow), it may also evict those pods whatever their
        priority (Kueue's reclaimWithinCohort: Any), when preemption by priority finds no plan."""
        with Statement(self.state) as statement:
            statement.release_holds([plan])
            result = self._decide(plan, statement)
            if result.statement is not None:
                statement.commit()
                return result
        # discarded: every hold released for the decision is accounted again
        if running is None or self.state.nomination_live(plan.uid):
            return result
        if self.state.preemptions.get(plan.uid, 0) >= self.max_preemptions:
            return result
        start = time.perf_counter()
        preemption, reclaiming = self._plan_evictions(
            plan.priority, running, reclaim,
            lambda priority, pods: plan_preemption(self.state.snapshot, plan.request, priority, pods, self.policy(),
                                                   self.rng))
        seconds = result.seconds + time.perf_counter() - start
        if preemption is None or not preemption.victims:
            return CycleResult(plan, None, result.unschedulable, seconds)
        if preemption.pdb_violations:
            # the plan already has the fewest violations: every node needs a protected victim. The
            # Eviction API would refuse it (429) after the unprotected victims were gone, so evict nobody
            return CycleResult(plan, None, result.unschedulable, seconds, blocked_by_budget=preemption)
        with Statement(self.state) as statement:
            self._evict(statement, plan, preemption)
            statement.commit()
        return CycleResult(plan, statement, result.unschedulable, seconds, preemption, reclaiming)

    def _plan_evictions(self, priority: int, running: Callable[[], list[RunningPod]],
                        reclaim: Callable[[], list[RunningPod]] | None,
                        plan_with: Callable[[int, list[RunningPod]], P | None]) -> tuple[P | None, bool]:
        """Victims by priority (`plan_with(priority, candidates)`), else, with `reclaim`, among the pods
        other teams borrow, whatever their priority (planned as if above all of them). True: reclaimed."""
        preemption = plan_with(priority, running()) if self.state.has_lower_priority(priority) else None
        if (preemption is None or not preemption.victims) and reclaim is not None:
            borrowed = reclaim()
            if borrowed:
                return plan_with(max(v.priority for v in borrowed) + 1, borrowed), True
        return preemption, False

    def _evict(self, statement: Statement, plan: PodPlan, preemption: Preemption) -> None:
        """`plan` nominated on `preemption`'s node, held for its victims' longest grace plus the slack."""
        victims = [v.uid for v in preemption.victims]
        statement.evict(plan, preemption, self.hold_s(victims))

    def hold_s(self, victims: Iterable[str]) -> float:
        """How long a nomination for `victims` holds their room: their longest eviction grace + the slack."""
        return nomination_timeout_s(self.state, victims, self.nomination_slack_s, self.max_checkpoint_grace_s)

    def schedule_gang(self, plans: list[PodPlan], need: int,
                      running: Callable[[], list[RunningPod]] | None = None,
                      reclaim: Callable[[], list[RunningPod]] | None = None) -> GangResult:
        """Decide for a gang's pending members together: at least `need` of them placed (and assumed in
        one statement), or none. The members' own holds (from an earlier gang preemption) are theirs for
        the decision. With `running` (every member may preempt), a gang that does not fit may evict pods
        of lower priority than all its members, only where that makes its minimum fit together
        (`plan_gang_preemption`), and not while victims of an earlier attempt are still terminating.
        With `reclaim` too (its team takes back guaranteed quota others borrow), it may evict those
        borrowed pods whatever their priority when preemption by priority finds no plan."""
        with Statement(self.state) as statement:
            statement.release_holds(plans)
            snapshot = self.state.snapshot
            sampler = self.sampler.follow(snapshot) if self.sampler is not None else None
            start = time.perf_counter()
            out = place_gang(snapshot, [p.request for p in plans], need, self.policy(), self.rng, sample=sampler)
            seconds = time.perf_counter() - start
            if not isinstance(out, GangUnschedulable):
                for i, placement in out.placements:
                    statement.assume(plans[i], placement)  # ends that member's nomination: its holds went
                statement.commit()
                return GangResult(statement, None, seconds)
        # discarded: every hold released for the decision is accounted again
        return self._preempt_for_gang(plans, need, out, seconds, running, reclaim)

    def _preempt_for_gang(self, plans: list[PodPlan], need: int, out: GangUnschedulable, seconds: float,
                          running: Callable[[], list[RunningPod]] | None,
                          reclaim: Callable[[], list[RunningPod]] | None) -> GangResult:
        if running is None or any(self.state.nomination_live(p.uid) for p in plans):
            return GangResult(None, out, seconds)
        if any(self.state.preemptions.get(p.uid, 0) >= self.max_preemptions for p in plans):
            return GangResult(None, out, seconds)
        requests = [p.request for p in plans]
        start = time.perf_counter()
        preemption, reclaiming = self._plan_evictions(
            min(p.priority for p in plans), running, reclaim,
            lambda priority, pods: plan_gang_preemption(self.state.snapshot, requests, need, priority, pods,
                                                        self.policy(), self.rng))
        seconds += time.perf_counter() - start
        if preemption is None or not preemption.victims:
            return GangResult(None, out, seconds)
        if preemption.pdb_violations:
            return GangResult(None, out, seconds, blocked_by_budget=preemption)
        with Statement(self.state) as statement:
            for member in preemption.members:
                if member.victims:
                    self._evict(statement, plans[member.member],
                                Preemption(member.placement.node, member.victims, member.placement, 0))
            statement.commit()
        return GangResult(statement, out, seconds, preemption=preemption, reclaim=reclaiming)

    def _decide(self, plan: PodPlan, statement: Statement) -> CycleResult:
        snapshot = self.state.snapshot
        # scan in tie-break order from the first node each time: docs/benchmarks.md shows a rotating
        # start costs FGD 1.5 points of allocation on openb, a fixed one nothing measurable
        sampler = self.sampler.follow(snapshot) if self.sampler is not None else None
        sample: NodeSample | None = sampler
        busy = self.state.gate_busy(plan_shapes(plan))
        if busy:
            sample = self._open_gates_first(snapshot, busy, sampler)
        start = time.perf_counter()
        decision = decide(snapshot, plan.request, self.policy(), self.rng, sample=sample)
        seconds = time.perf_counter() - start
        if isinstance(decision, Unschedulable):
            return CycleResult(plan, None, decision, seconds)
        statement.assume(plan, decision)
        return CycleResult(plan, statement, None, seconds)

    @staticmethod
    def _open_gates_first(snapshot: ClusterSnapshot, busy: set[str], then: NodeSample | None) -> NodeSample:
        """Drop feasible nodes whose handshake gate is taken for the pod's shapes unless no other node
        is feasible: a pod placed there would wait for the previous pod's ack before its Binding goes
        out. Packing policies put consecutive same-shape pods on one node, so without this the binds
        of a burst go out one ack after another (docs/scheduler.md, "The gate and throughput")."""
        rows = np.fromiter((r for n in busy if (r := snapshot.index.get(n)) is not None), dtype=np.int64)

        def sample(candidates: np.ndarray) -> np.ndarray:
            if rows.size:
                free = candidates[~np.isin(candidates, rows)]
                if free.size:
                    candidates = free
            return then(candidates) if then is not None else candidates

        return sample
