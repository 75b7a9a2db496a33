"""One scheduling cycle: a pod (later: a gang) in, a statement out.

The cycle asks the placement core (`decide`, unchanged and pure) and records its answer as a
`Statement`: tentative operations on the cluster state that are committed or discarded as a whole,
as Volcano's Statement does. A committed statement is what the binder carries out. Preemption is
such a step: a pod that fits nowhere and may preempt gets a `plan_preemption` answer (pure, like
`decide`), recorded as a statement with evictions (victims marked, nomination made) that the preemptor
carries out. A preemptor's holds (what its gone victims freed) are released for its own decision only.
A gang is one statement with several placements: `place_gang` (pure) answers for all of its members
at once, and they are assumed together or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement, Unschedulable
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


@dataclass(slots=True)
class Statement:
    """Tentative placements on the state: each is assumed at once (so that later steps of the same
    cycle see it) and released again by `discard`."""

    state: ClusterState
    placements: list[tuple[PodPlan, Placement]] = field(default_factory=list)
    evictions: list[tuple[PodPlan, Preemption]] = field(default_factory=list)  # victims marked, nominated
    committed: bool = False

    def assume(self, plan: PodPlan, placement: Placement) -> None:
        if self.committed:
            raise RuntimeError("statement already committed")
        self.state.assume(plan, placement)
        self.placements.append((plan, placement))

    def evict(self, plan: PodPlan, preemption: Preemption, timeout_s: float) -> None:
        """Mark `preemption`'s victims as evicted for `plan` and nominate it on their node (a gang's
        statement does this for each member that needs victims)."""
        if self.committed:
            raise RuntimeError("statement already committed")
        victims = [v.uid for v in preemption.victims]
        self.state.nominate(plan.uid, plan.key, preemption.node, plan.priority, victims, timeout_s)
        self.evictions.append((plan, preemption))

    def discard(self) -> None:
        for plan, _ in reversed(self.placements):
            self.state.forget(plan.uid)
        self.placements.clear()
        for plan, preemption in reversed(self.evictions):
            self.state.spare(plan.uid, (v.uid for v in preemption.victims))
            self.state.end_nomination(plan.uid)
        self.evictions.clear()

    def commit(self) -> list[tuple[PodPlan, Placement]]:
        self.committed = True
        return list(self.placements)


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
        held = self.state.release_holds(plan.uid)
        lower = self.state.release_lower_holds(plan.priority, {plan.uid})
        try:
            result = self._decide(plan)
        except BaseException:
            for uid in (plan.uid, *lower):
                self.state.restore_holds(uid)
            raise
        if result.statement is not None:  # assumed: its own holds went with its nomination
            self._settle_lower_holds(lower, {result.statement.placements[0][1].node})
            return result
        self._settle_lower_holds(lower, set())
        if held:
            self.state.restore_holds(plan.uid)
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
        statement = Statement(self.state)
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
        held = [p.uid for p in plans if self.state.release_holds(p.uid)]
        lower = self.state.release_lower_holds(min(p.priority for p in plans), {p.uid for p in plans})
        snapshot = self.state.snapshot
        sampler = self.sampler.follow(snapshot) if self.sampler is not None else None
        start = time.perf_counter()
        try:
            out = place_gang(snapshot, [p.request for p in plans], need, self.policy(), self.rng, sample=sampler)
        except BaseException:
            for uid in (*held, *lower):
                self.state.restore_holds(uid)
            raise
        seconds = time.perf_counter() - start
        if isinstance(out, GangUnschedulable):
            for uid in (*held, *lower):
                self.state.restore_holds(uid)
            return self._preempt_for_gang(plans, need, out, seconds, running, reclaim)
        statement = Statement(self.state)
        try:
            for i, placement in out.placements:
                statement.assume(plans[i], placement)  # ends that member's nomination: its holds went
        except BaseException:
            statement.discard()
            for uid in (*held, *lower):
                self.state.restore_holds(uid)
            raise
        placed = {plans[i].uid for i, _ in out.placements}
        for uid in held:
            if uid not in placed:
                self.state.restore_holds(uid)
        self._settle_lower_holds(lower, {p.node for _, p in out.placements})
        statement.commit()
        return GangResult(statement, None, seconds)

    def _settle_lower_holds(self, released: list[str], taken: set[str]) -> None:
        """Less important preemptors' holds released for a decision: dropped on the nodes the decision
        took (that room went to the more important pod), accounted again elsewhere."""
        for uid in released:
            if self.state.nominations[uid].node in taken:
                self.state.drop_holds(uid)
            else:
                self.state.restore_holds(uid)

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
        statement = Statement(self.state)
        for member in preemption.members:
            if member.victims:
                self._evict(statement, plans[member.member],
                            Preemption(member.placement.node, member.victims, member.placement, 0))
        statement.commit()
        return GangResult(statement, out, seconds, preemption=preemption, reclaim=reclaiming)

    def _decide(self, plan: PodPlan) -> CycleResult:
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
        statement = Statement(self.state)
        statement.assume(plan, decision)
        statement.commit()
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
