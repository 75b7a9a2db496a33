"""One popped pod to a decision for its job: build the job, admit it (quota), decide (the cycle), and
hand the answer on (binder, preemptor, Events).

A pod outside any PodGroup is a gang of one. A PodGroup member brings along the group's other pending
members (`Job`); when the group's minimum is already placed, the member is a gang of one too. Every
rule after that is written once, for jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle, CycleResult, GangResult
from gpupool_sched.framework.job import Job
from gpupool_sched.framework.plugins.gangs import GROUP, Gangs, group_of
from gpupool_sched.framework.plugins.quotas import QuotaBook
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, eviction_reason, may_preempt, running_pods
from gpupool_sched.framework.queue import ClusterEvent, QueuedPod, SchedulingQueue
from gpupool_sched.framework.session import Steps, drive, drive_offloaded
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import InvalidPod, PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.consolidation import Movable
from gpupool_sched.placement.gang import GangUnschedulable
from gpupool_sched.placement.gang_preemption import GangPreemption
from gpupool_sched.placement.preemption import Preemption, RunningPod
from gpupool_sched.scheduler.defrag import Defrag
from gpupool_sched.scheduler.elastic import Elastic
from gpupool_sched.scheduler.idle import IDLE_WHY, IdleReclaim
from gpupool_sched.writer.binder import Binder
from gpupool_sched.writer.preemptor import Preemptor
from gpupool_sched.writer.recorder import EventRecorder, says_unschedulable

log = logging.getLogger(__name__)

# what may help a pod that fit nowhere (kube-scheduler's queueing hints)
UNSCHEDULABLE_HINTS = (ClusterEvent.NODE_ADDED, ClusterEvent.NODE_CHANGED, ClusterEvent.GPU_FREED,
                       ClusterEvent.BUDGET_RELAXED)
LOANS = "borrowed by an elastic Deployment (given back)"  # why give-back's replicas go, in messages
NOT_YET_HINTS = (ClusterEvent.NODE_ADDED, ClusterEvent.NODE_CHANGED)  # unknown model / profile, too big a share


@dataclass
class Scheduling:
    state: ClusterState
    queue: SchedulingQueue
    cycle: Cycle
    quotas: QuotaBook
    gangs: Gangs
    budgets: DisruptionBudgets
    binder: Binder
    preemptor: Preemptor
    recorder: EventRecorder
    metrics: SchedulerMetrics
    pending: dict[str, PodInfo]  # uid -> latest event of our pending pods, read once
    observe: Callable[[str, PodRequest], None]  # a request into the workload profile
    defrag: Defrag | None = None  # the consolidate action's movers, budgets and migrator (None: off)
    idle: IdleReclaim | None = None  # idle pods the reclaim-idle action may take (None: none)
    elastic: Elastic | None = None  # elastic Deployments: borrowed replicas (give-back; None: off)

    def schedule_one(self, item: QueuedPod) -> None:
        """Decide for the popped pod's job, eviction planning inline."""
        drive(self._steps(item))

    async def schedule_one_offloaded(self, item: QueuedPod) -> None:
        """Decide for the popped pod's job; eviction planning runs on a worker thread against a copy of the
        snapshot while the loop serves the watch (the plan is checked on the live cache before it is used)."""
        await drive_offloaded(self._steps(item, offload=True))

    def _steps(self, item: QueuedPod, offload: bool = False) -> Steps[None]:
        info = self.pending.get(item.uid)
        if info is None or item.uid in self.state.pods:
            self.queue.done(item.uid)
            return
        popped = time.monotonic()
        log.debug("scheduling %s", item.key)
        group, problem = group_of(info.obj)
        if problem is not None:
            self.metrics.attempts.labels(result="invalid").inc()
            self.queue.park(item, ())
            self.report_unschedulable(info.obj, problem)
            return
        try:
            plan = self.state.plan(info)
        except InvalidPod as exc:
            self.metrics.attempts.labels(result="invalid").inc()
            self.queue.park(item, () if exc.permanent else NOT_YET_HINTS)
            self.report_unschedulable(info.obj, str(exc))
            return
        job = self._job(item, plan, group) if group is not None else Job(plan.key, [plan], [item])
        if job is None:
            return
        self.observe(plan.uid, plan.request)
        yield from self._schedule(job, popped, offload)

    def _job(self, item: QueuedPod, plan: PodPlan, key: str) -> Job | None:
        """The job of a PodGroup member: the group's pending members, or the member alone once the group's
        minimum is placed. None: the member waits for its group (told why)."""
        group = self.gangs.groups.get(key)
        if group is None or group.problem is not None:
            if group is not None:
                why = group.problem or ""
            elif not self.gangs.available:
                why = f"PodGroup {key} cannot exist: the PodGroup CRD ({GROUP}) is not installed"
            else:
                why = f"PodGroup {key} not found; the pod waits for it"
            self.metrics.attempts.labels(result="unschedulable").inc()
            self.queue.park(item, ())
            self.report_unschedulable(self.pending[plan.uid].obj, why)
            return None
        placed = self.gangs.placed(key, self.state)
        need = group.min_member - len(placed)
        if need <= 0:
            return Job(plan.key, [plan], [item])
        self.gangs.started(key)
        job = Job(key, [plan], [item], need, group, placed)
        for uid in sorted(u for u in self.gangs.members.get(key, ()) if u in self.pending and u not in self.state.pods):
            if uid == plan.uid:
                continue
            try:
                other = self.state.plan(self.pending[uid])
            except InvalidPod:
                continue  # it gets its own Event when it is popped
            taken = self.queue.take(uid)
            if taken is not None:
                job.plans.append(other)
                job.items.append(taken)
        return job

    def _schedule(self, job: Job, popped: float, offload: bool) -> Steps[None]:
        # every member bound passes admission: the quota's refusal keeps all of them (minimum over) or
        # those beyond what it admits waiting
        admitted, verdict = (self.quotas.admit_gang(job.plans, job.need) if len(job.plans) >= job.need
                             else (len(job.plans), None))
        if verdict is not None and not verdict.ok:
            for member, item in zip(job.plans[admitted:], job.items[admitted:], strict=True):
                self.metrics.attempts.labels(result="unschedulable").inc()
                self.queue.park(item, self.quotas.wake_hints(verdict))
                if (info := self.pending.get(member.uid)) is not None:
                    self.report_unschedulable(info.obj, job.says(verdict.message))
            if not admitted:
                return
            job = job.first(admitted)
        if len(job.plans) < job.need:
            assert job.group is not None
            self._unschedulable(job, job.says(
                f"waiting for members: {len(job.placed)} placed and {len(job.plans)} pending of the "
                f"{job.group.min_member} (minMember) that must start together"))
            return
        preempts = all(may_preempt(self.pending[p.uid].obj, self.state.non_preempting_classes) for p in job.plans)
        borrowed, preempts = self._loans(job, preempts)
        # a lone pod placed away from its holds wakes the queue (they went back to the pool); a gang's
        # members do not, as before the redesign (tests/data/decisions records it)
        nominated = {} if job.gang else {p.uid: n for p in job.plans if (n := self.state.nominations.get(p.uid))}
        floor = job.priority
        victims = (lambda: running_pods(self.state, self.budgets, floor)) if preempts else None
        reclaim = ((lambda: self.quotas.reclaim_gang(job.plans, running_pods(self.state, self.budgets)))
                   if preempts and self.quotas.may_reclaim(job.plans[0].namespace) else None)
        movable, most, not_moved, later = self._movers(job, preempts)
        idle = self.idle
        idle_victims = ((lambda: idle.victims(job.plans, floor, job.key))
                        if preempts and idle is not None and idle.may_help() else None)
        result = yield from self.cycle.decide(job.plans, job.need, gang=job.gang, running=victims, reclaim=reclaim,
                                              offload=offload, movable=movable, max_movers=most, moves_later=later,
                                              idle=idle_victims, borrowed=borrowed)
        self.metrics.algorithm_latency.observe(result.seconds)
        if result.stale:  # the cluster moved while the plan was computed off the loop: try again soon
            for item in job.items:
                self.queue.backoff(item)
            return
        if result.statement is not None and result.statement.displaced:
            self._clear_displaced(result.statement.displaced)
        deferred = result.deferred if isinstance(result, CycleResult) else None
        if deferred is not None and self.defrag is not None:
            self.defrag.wait(job.plans[0].uid, job.items[0].first_seen, job.priority)
            self._unschedulable(job, job.says(result.unschedulable.message if result.unschedulable else "") +
                                f"; moving {len(deferred.moves)} pod(s) off {deferred.node} would make room once "
                                f"it has waited {self.defrag.movers.config.after_s:.0f}s (--defrag-after): "
                                "not preempting meanwhile")
            return
        migration = result.migration if isinstance(result, CycleResult) else None
        if migration is not None and self.defrag is not None:
            self.defrag.planned(job.plans[0], migration)
            self._unschedulable(job, job.says(result.unschedulable.message if result.unschedulable else "") +
                                f"; moving {len(migration.moves)} pod(s) off {migration.node} to make room")
            return
        if result.give_back and self.elastic is not None and result.statement is not None:
            for member, eviction in result.statement.evictions:
                self.elastic.carry_out(member, eviction)
            self._unschedulable(job, self._failure(job, result, LOANS))
            return
        if result.statement is None or result.preemption is not None:
            why = eviction_reason(result.reclaim, verdict.quota if verdict is not None else None)
            if result.idle is not None and self.idle is not None:
                why = IDLE_WHY
            for member, eviction in result.statement.evictions if result.statement else ():
                if result.idle is not None and self.idle is not None:
                    self.idle.spent(len(eviction.victims))
                    self.preemptor.carry_out(member, eviction, why,
                                             idle=self.idle.messages(job.key, result.idle, eviction.victims))
                    continue
                self.preemptor.carry_out(member, eviction, why)
            message = self._failure(job, result, why)
            if (not job.gang and result.preemption is None and result.blocked_by_budget is None and preempts
                    and not self.state.nomination_live(job.plans[0].uid)):
                self.metrics.preemption_attempts.labels(result="no_plan").inc()
            if not_moved is not None and result.preemption is None:
                message += f"; no pod moves for it: {not_moved}"
            if self.defrag is not None and not job.gang and (movable is None or later) and not_moved is None:
                self.defrag.wait(job.plans[0].uid, job.items[0].first_seen, job.priority)
            elif self.defrag is not None and not job.gang and result.preemption is None:
                self.defrag.held_back(job.plans[0].uid)  # a cooldown or the budget kept movers in place
            self._unschedulable(job, message)
            return
        by_uid = dict(zip((p.uid for p in job.plans), job.items, strict=True))
        placements = result.statement.placements
        for member, placement in placements:
            held = nominated.get(member.uid)
            if held is not None and held.holds and placement.node != held.node:
                self.queue.on_event(ClusterEvent.GPU_FREED)  # placed elsewhere: its holds went back to the pool
            self.binder.submit(member, placement, by_uid[member.uid], popped)
        bound = {member.uid for member, _ in placements}
        for member, item in zip(job.plans, job.items, strict=True):
            if member.uid not in bound:  # beyond the minimum and no room now: on its own later
                self.queue.park(item, UNSCHEDULABLE_HINTS)
        if job.group is not None:
            if job.group.first_try is not None:
                self.metrics.gang_wait.observe(time.monotonic() - job.group.first_try)
            self.gangs.scheduled(job.key)
            log.info("PodGroup %s: %d member(s) placed together on %s", job.key, len(bound),
                     ", ".join(sorted({p.node for _, p in placements})))

    def _clear_displaced(self, uids: list[str]) -> None:
        """Lower nominations whose held room this decision took: their nominatedNodeName is cleared, as
        kube-scheduler clears those of lower pods on the node it nominates a preemptor to. The nomination
        itself stays while its victims terminate (`ClusterState.drop_holds`)."""
        for uid in uids:
            if (nomination := self.state.nominations.get(uid)) is not None:
                namespace, _, name = nomination.key.partition("/")
                self.preemptor.clear(namespace, name)

    def _loans(self, job: Job, preempts: bool) -> tuple[Callable[[], list[RunningPod]] | None, bool]:
        """Elastic inference: (the borrowed replicas the job may take back, whether it may still preempt).
        A borrowed replica itself takes nothing back and preempts, moves and reclaims nothing: free GPUs only."""
        elastic = self.elastic
        if elastic is None or not elastic.targets:
            return None, preempts
        if not job.gang:
            plan = job.plans[0]
            labels = ((self.pending[plan.uid].obj.get("metadata") or {}).get("labels") or {}
                      if plan.uid in self.pending else {})
            if elastic.borrowing(plan, labels):
                return None, False
        return elastic.candidates, preempts

    def _movers(self, job: Job, preempts: bool) -> tuple[Callable[[], list[Movable]] | None, int | None, str | None,
                                                         bool]:
        """What the consolidate action may move for `job`: (candidates, at most how many, why none, not
        yet). None candidates and no reason: not at all (a gang, Never, nothing movable while it waits).
        Not yet: it has not waited `--defrag-after`; the action only looks, and a move it finds holds back
        preemption until then (moving is cheaper than killing)."""
        if self.defrag is None or not self.defrag.movers.config.enabled or job.gang or not preempts:
            return None, None, None, False
        item = job.items[0]
        waited = self.queue.clock() - item.first_seen if item.first_seen is not None else 0.0
        offer = self.defrag.movers.offer(waited, job.priority)
        return offer.candidates, offer.most, offer.why_not, offer.later

    def _failure(self, job: Job, result: CycleResult | GangResult, why_evicted: str) -> str:
        """Why the job was not placed (for its members' Events), and the evictions it started, if any."""
        assert result.unschedulable is not None
        message = job.says(result.unschedulable.message)
        if job.group is not None and job.placed:  # a gang short of members it had: not "0 of the 1 it needs"
            why = result.unschedulable.message
            if isinstance(result.unschedulable, GangUnschedulable):
                why = result.unschedulable.unschedulable.message  # the per-node reasons
            message = (f"PodGroup {job.key}: {len(job.placed)} of the {job.group.min_member} members (minMember) "
                       f"are bound and {job.need} more must join them; none fits now: {why}")
        if (preemption := result.preemption) is not None:
            nodes = ", ".join(sorted({v.node for v in preemption.victims}))
            message += f"; preempting {len(preemption.victims)} pod(s) {why_evicted} on {nodes}"
            if isinstance(preemption, GangPreemption):
                message += f" for {len(preemption.members)} members"
        elif (blocked := result.blocked_by_budget) is not None:
            self.metrics.preemption_attempts.labels(result="pdb_blocked").inc()
            where = f" on {blocked.node}" if isinstance(blocked, Preemption) else ""
            message += (f"; preemption would need {blocked.pdb_violations} pod(s) a PodDisruptionBudget "
                        f"protects{where}: waiting")
        return message

    def _unschedulable(self, job: Job, message: str) -> None:
        for member, item in zip(job.plans, job.items, strict=True):
            self.metrics.attempts.labels(result="unschedulable").inc()
            self.queue.park(item, UNSCHEDULABLE_HINTS)
            if (info := self.pending.get(member.uid)) is not None:
                self.report_unschedulable(info.obj, message)
        if job.group is not None:
            job.group.last_message = message

    def report_unschedulable(self, obj: Mapping[str, Any], message: str) -> None:
        meta = obj.get("metadata") or {}
        ns, name, uid = meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", "")
        log.info("pod %s/%s: %s", ns, name, message)
        self.recorder.unschedulable(ns, name, uid, message, condition=not says_unschedulable(obj, message))
