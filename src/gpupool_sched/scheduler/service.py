"""The scheduler service: watch → state (ledger) → queue → cycle (placement core) → binder → events.

    kopf on.event (pods, nodes, PriorityClasses, PodDisruptionBudgets)
          │
          ▼
    ClusterState ──(facts, snapshot)──▶ Cycle: decide() ──▶ Statement ──▶ Binder: gate → Binding
          │                                 ▲                                  │
          └──(cluster events)──▶ SchedulingQueue ◀──(backoff / park)───────────┘
                                          │
                                          └──▶ FailedScheduling Event + PodScheduled=False
    Cycle: fits nowhere ──▶ plan_preemption ──▶ Statement (evictions) ──▶ Preemptor: nominate, Eviction API

Everything runs on one asyncio loop (kopf's); only API calls leave it, on a thread pool. The state is
rebuilt from a LIST of nodes and pods (their assignment and ack annotations) before the first cycle,
so a restarted scheduler never hands out a device twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpupool_sched.cache.nodes import apply_node_event
from gpupool_sched.cache.policy import PolicyCache
from gpupool_sched.cache.sync import caches_ready, initial_sync, stop_syncing
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.placement.gang import GangUnschedulable
from gpupool_sched.scheduler import gcpolicy
from gpupool_sched.scheduler.binder import Binder, BindOutcome
from gpupool_sched.scheduler.cycle import Cycle
from gpupool_sched.scheduler.gangs import GROUP, PLURAL, PODGROUPS, VERSION, Gangs, group_of
from gpupool_sched.scheduler.informer import Informers, WatchedKind
from gpupool_sched.scheduler.kubeapi import ApiError, KubeApi
from gpupool_sched.scheduler.leader import AlwaysLeader, LeaderElector
from gpupool_sched.scheduler.metrics import GPU_STATES, SchedulerMetrics, gpu_states
from gpupool_sched.scheduler.podspec import InvalidPod, PodPlan, pod_revision
from gpupool_sched.scheduler.preemptor import (
    DEFAULT_MAX_CHECKPOINT_GRACE_S,
    DisruptionBudgets,
    Preemptor,
    eviction_reason,
    may_preempt,
    running_pods,
)
from gpupool_sched.scheduler.queue import ClusterEvent, QueuedPod, QuotaFreed, SchedulingQueue
from gpupool_sched.scheduler.quotas import QuotaBook, quota_kinds
from gpupool_sched.scheduler.recorder import EventRecorder, says_unschedulable
from gpupool_sched.scheduler.state import ClusterState, Phase

log = logging.getLogger(__name__)

# what may help a pod that fit nowhere (kube-scheduler's queueing hints)
UNSCHEDULABLE_HINTS = (ClusterEvent.NODE_ADDED, ClusterEvent.NODE_CHANGED, ClusterEvent.GPU_FREED,
                       ClusterEvent.BUDGET_RELAXED)
NOT_YET_HINTS = (ClusterEvent.NODE_ADDED, ClusterEvent.NODE_CHANGED)  # unknown model / profile, too big a share
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
PDBS = "/apis/policy/v1/poddisruptionbudgets"
CYCLE_SLICE_S = 0.005


@dataclass(frozen=True)
class SchedulerConfig:
    scheduler_name: str = "gpupool"
    policy: str = "gpupool"
    memory_unit_mib: int = 1024
    percentage_of_nodes_to_score: int = 0  # 0: adaptive, as kube-scheduler
    gate_timeout_s: float = 30.0
    confirm_ttl_s: float = 60.0
    event_workers: int = 16  # API threads of their own that post Events and PodScheduled=False
    leader_elect: bool = False
    lease_namespace: str = "kube-system"
    lease_name: str = "gpupool-scheduler"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    identity: str = "gpupool"
    profile_window: int = 2000
    housekeeping_s: float = 1.0
    nomination_slack_s: float = 60.0  # freed GPUs are held for a preemptor the victims' grace + this
    gang_repair_s: float = 60.0  # a committed gang short of a member (failed Binding) for this long is released
    max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S  # gpupool.io/checkpoint-grace-seconds cap
    consistency_check_s: float = 300.0  # a re-list of every watched kind that repairs what the watch missed
    freeze_gc: bool = False  # the process's own (CLI): gc.freeze() after the first sync


def _created(obj: dict[str, Any]) -> float:
    text = (obj.get("metadata") or {}).get("creationTimestamp")
    if not text:
        return time.time()
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


class SchedulerService:
    def __init__(self, config: SchedulerConfig, api: KubeApi, metrics: SchedulerMetrics | None = None) -> None:
        self.config = config
        self.api = api
        api.component = config.scheduler_name
        api.identity = config.identity
        self.metrics = metrics or SchedulerMetrics()
        self.state = ClusterState(
            config.scheduler_name, memory_unit_mib=config.memory_unit_mib,
            gate_timeout_s=config.gate_timeout_s, confirm_ttl_s=config.confirm_ttl_s,
        )
        self.queue = SchedulingQueue()
        self.policies = PolicyCache(config.policy, self.state, window=config.profile_window,
                                    on_rebuilt=self.metrics.profile_version.set)
        self.cycle = Cycle(self.state, self.policies.current,
                           percentage_of_nodes_to_score=config.percentage_of_nodes_to_score,
                           nomination_slack_s=config.nomination_slack_s,
                           max_checkpoint_grace_s=config.max_checkpoint_grace_s)
        self.leader: LeaderElector | AlwaysLeader = (
            LeaderElector(api, config.lease_namespace, config.lease_name, config.identity,
                          lease_duration_s=config.lease_duration_s, renew_deadline_s=config.renew_deadline_s,
                          retry_period_s=config.retry_period_s)
            if config.leader_elect else AlwaysLeader()
        )
        if isinstance(self.leader, LeaderElector):  # every write (Bindings, evictions, reports) is fenced
            api.fence.window = self.leader.write_window
        self.binder = Binder(self.state, api, self.queue, self.metrics,
                             is_leader=lambda: self.leader.is_leader, on_bound=self._bound,
                             on_unbound=self._unbound,
                             on_read=lambda obj: self.informers["pods"].event("MODIFIED", obj))
        self.synced = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # reports on API threads of their own: behind a burst of Bindings they would wait their turn
        # for its whole length and the bounded queue would drop nearly all of them
        self.recorder = EventRecorder(api.lane(config.event_workers), self.metrics,
                                      workers=config.event_workers,
                                      waiting=lambda uid: uid in self._pending and uid not in self.state.pods)
        self.budgets = DisruptionBudgets()
        self.preemptor = Preemptor(self.state, api, self.queue, self.metrics, self.recorder,
                                   max_checkpoint_grace_s=config.max_checkpoint_grace_s)
        self._pending: dict[str, dict[str, Any]] = {}  # uid -> latest object of our pending pods
        self.gangs = Gangs()
        self.quotas = QuotaBook(self.state, self.metrics.registry)
        self.quotas.on_freed = lambda quota: self.queue.on_event(QuotaFreed(quota))  # over-quota pods: wake_hints
        self.informers = Informers(api, self._watched_kinds(), registry=self.metrics.registry,
                                   consistency_check_s=config.consistency_check_s)
        self._writes: set[asyncio.Task[None]] = set()  # status writes in flight (kept referenced)
        self._ended: dict[str, str] = {}  # UID -> Succeeded/Failed, for gang members (PodGroup status)
        self._node_gauges: dict[str, tuple[Any, Any]] = {}  # node -> its gpus_bound, memory_units_bound children
        self.decisions = 0
        self._gc_pauses = gcpolicy.GcPauses(
            lambda generation, seconds: self.metrics.gc_seconds.labels(generation=str(generation)).inc(seconds))

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, attempts: int = 5) -> None:
        """Rebuild the state from a LIST of everything, then start leading / standing by and cycling."""
        began = time.monotonic()
        await initial_sync(self.informers, attempts=attempts, freeze_gc=self.config.freeze_gc)
        self._gc_pauses.install()
        self.synced.set()
        self.recorder.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.leader.run(), name="leader"),
            loop.create_task(self._cycle_loop(), name="cycle"),
            loop.create_task(self._housekeeping(), name="housekeeping"),
            loop.create_task(self.informers.run_checks(), name="consistency-check"),
        ]
        log.info("scheduler %s started in %.1f s: %d nodes, %d pods in the ledger, %d pending",
                 self.config.scheduler_name, time.monotonic() - began, len(self.state.nodes), len(self.state.pods),
                 len(self.queue))

    async def resync(self) -> None:
        """LIST every watched kind into the state, in dependency order (classes, budgets, groups and
        quotas before the pods that name them; nodes before their pods)."""
        await initial_sync(self.informers)

    def _watched_kinds(self) -> list[WatchedKind]:
        def pdb_list_failed(exc: ApiError) -> bool:  # preemption then ranks victims without them
            log.warning("listing PodDisruptionBudgets failed (%s)", exc)
            return True

        def no_pod_groups(exc: ApiError) -> bool:  # no PodGroup CRD: pods naming a group are told so
            if exc.status != 404:
                return False
            log.warning("PodGroups (%s) are not served: gang scheduling is off until the CRD is installed",
                        PODGROUPS)
            self.gangs.available = False
            return True

        def groups_served() -> None:
            self.gangs.available = True

        def quota_changed() -> None:
            self.queue.on_event(ClusterEvent.QUOTA_CHANGED)

        return [
            WatchedKind("priorityclasses", PRIORITY_CLASSES, self.on_priority_class),
            WatchedKind("poddisruptionbudgets", PDBS, self.on_pdb, on_error=pdb_list_failed),
            WatchedKind("podgroups", PODGROUPS, self.on_pod_group, on_error=no_pod_groups,
                        on_listed=groups_served),
            *quota_kinds(self.quotas, quota_changed),
            WatchedKind("nodes", "/api/v1/nodes", self.on_node),
            WatchedKind("pods", "/api/v1/pods", self.on_pod),
        ]

    async def stop(self) -> None:
        await stop_syncing(self.informers, self._tasks)
        await self.binder.drain()
        await self.preemptor.drain()
        await self.leader.release()
        await self.recorder.stop()
        self._gc_pauses.remove()

    # ---- watch events (called by kopf handlers and by resync) ------------------------------------
    def on_priority_class(self, kind: str | None, obj: dict[str, Any]) -> None:
        self.state.apply_priority_class(kind, obj)

    def on_pdb(self, kind: str | None, obj: dict[str, Any]) -> None:
        if self.budgets.apply(kind, obj):
            self.queue.on_event(ClusterEvent.BUDGET_RELAXED)

    def on_pod_group(self, kind: str | None, obj: dict[str, Any]) -> None:
        self.gangs.available = True
        key = self.gangs.apply_group(kind, obj)
        if key is not None:
            self._wake_gang(key)

    def _wake_gang(self, key: str) -> None:
        """A gang's members waiting for each other or for their PodGroup try again (after their backoff)."""
        for uid in self.gangs.members.get(key, ()):
            self.queue.retry(uid)

    def on_node(self, kind: str | None, obj: dict[str, Any]) -> None:
        change = apply_node_event(self.state, self.policies.profile, kind, obj)
        if change is None:
            return
        self.metrics.nodes.set(len(self.state.nodes))
        if change.event is not None:
            self.queue.on_event(change.event)

    def on_pod(self, kind: str | None, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        update = self.state.apply_pod(obj, deleted=kind == "DELETED")
        self._track_gang(uid, obj, kind == "DELETED")
        if update.gone:
            self._pending.pop(uid, None)
            self.queue.delete(uid)
            entry = self.state.pods.get(uid)
            if entry is not None and not entry.ours:
                self.policies.observe(uid, entry.request)
        if update.freed:
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if update.gate_released:
            self.binder.gate_released(update.gate_released)
        if update.pending_ours:
            log.debug("pod %s/%s pending (%s)", meta.get("namespace"), meta.get("name"), kind)
            self._pending[uid] = obj
            priority = obj.get("spec", {}).get("priority")
            if not isinstance(priority, int):
                priority = self.state.priority_classes.get(obj.get("spec", {}).get("priorityClassName") or "", 0)
            item = QueuedPod(uid=uid, key=f"{meta.get('namespace')}/{meta.get('name')}", priority=priority,
                             created=_created(obj), payload=None, revision=pod_revision(obj))
            self.queue.add(item)
            self._follow_nomination(uid, item.key, priority, obj)

    def _follow_nomination(self, uid: str, key: str, priority: int, obj: dict[str, Any]) -> None:
        """Mirror a nomination another instance made (status.nominatedNodeName): a standby holds what the
        leader's victims free, so a failover does not hand that room to lower priorities or preempt again."""
        node = (obj.get("status") or {}).get("nominatedNodeName")
        if isinstance(node, str) and node:
            self.state.adopt_nomination(uid, key, node, priority, self.cycle.hold_s,
                                        reclaims=self.quotas.reclaimable_by(obj))
        elif self.state.drop_adopted(uid):
            self.queue.on_event(ClusterEvent.GPU_FREED)

    def _track_gang(self, uid: str, obj: dict[str, Any], deleted: bool) -> None:
        if deleted:
            self.gangs.untrack(uid)
            self._ended.pop(uid, None)
            return
        key, _ = group_of(obj)
        if key is None and self.gangs.member_of(uid) is None:
            return
        phase = (obj.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self._ended[uid] = phase
        joined = self.gangs.track(uid, key)
        if joined is not None:
            self._wake_gang(joined)

    # ---- the cycle -----------------------------------------------------------------------------
    async def _cycle_loop(self) -> None:
        await self.synced.wait()
        while True:
            if not self.leader.is_leader:
                await asyncio.sleep(0.2)
                continue
            if self.informers.stale:  # a watch gap is being repaired: decide on the repaired state
                await asyncio.sleep(0.05)
                continue
            item = self.queue.pop()
            if item is None:
                await self.queue.wait(timeout=1.0)
                continue
            # decide for up to CYCLE_SLICE_S before handing the loop back to watch events and binds:
            # one decision per turn leaves a burst's decisions queued behind every watch event
            until = time.monotonic() + CYCLE_SLICE_S
            while item is not None:
                try:
                    self.schedule_one(item)
                except Exception:  # nothing a pod says may stop the loop
                    log.exception("scheduling %s failed unexpectedly", item.key)
                    self.metrics.attempts.labels(result="error").inc()
                    self.queue.backoff(item)
                self.decisions += 1
                item = (self.queue.pop() if time.monotonic() < until and self.leader.is_leader
                        and not self.informers.stale else None)
            await asyncio.sleep(0)

    def schedule_one(self, item: QueuedPod) -> None:
        obj = self._pending.get(item.uid)
        if obj is None or item.uid in self.state.pods:
            self.queue.done(item.uid)
            return
        popped = time.monotonic()
        log.debug("scheduling %s", item.key)
        group, problem = group_of(obj)
        if problem is not None:
            self.metrics.attempts.labels(result="invalid").inc()
            self.queue.park(item, ())
            self._report_unschedulable(obj, problem)
            return
        try:
            plan = self.state.plan(obj)
        except InvalidPod as exc:
            self.metrics.attempts.labels(result="invalid").inc()
            self.queue.park(item, () if exc.permanent else NOT_YET_HINTS)
            self._report_unschedulable(obj, str(exc))
            return
        if group is not None and self._schedule_gang(item, plan, group, popped):
            return
        self.policies.observe(plan.uid, plan.request)
        verdict = self.quotas.check(plan)
        if not verdict.ok:
            self.metrics.attempts.labels(result="unschedulable").inc()
            self.queue.park(item, self.quotas.wake_hints(verdict))
            self._report_unschedulable(obj, verdict.message)
            return
        preempts = may_preempt(obj, self.state.non_preempting_classes)
        nominated = self.state.nominations.get(plan.uid)
        victims = (lambda: running_pods(self.state, self.budgets, plan.priority)) if preempts else None
        reclaim = (lambda: self.quotas.reclaim(plan, running_pods(self.state, self.budgets))) if preempts else None
        result = self.cycle.schedule(plan, victims, reclaim)
        self.metrics.algorithm_latency.observe(result.seconds)
        if result.unschedulable is not None:
            self.metrics.attempts.labels(result="unschedulable").inc()
            message = result.unschedulable.message
            if result.preemption is not None:
                why = eviction_reason(result.reclaim, verdict.quota)
                self.preemptor.carry_out(plan, result.preemption, why)
                message += f"; preempting {len(result.preemption.victims)} pod(s) {why} on {result.preemption.node}"
            elif (blocked := result.blocked_by_budget) is not None:
                self.metrics.preemption_attempts.labels(result="pdb_blocked").inc()
                message += (f"; preemption would need {blocked.pdb_violations} pod(s) a PodDisruptionBudget "
                            f"protects on {blocked.node}: waiting")
            elif preempts and not self.state.nomination_live(plan.uid):
                self.metrics.preemption_attempts.labels(result="no_plan").inc()
            self.queue.park(item, UNSCHEDULABLE_HINTS)
            self._report_unschedulable(obj, message)
            return
        assert result.statement is not None
        if nominated is not None and nominated.holds and result.statement.placements[0][1].node != nominated.node:
            self.queue.on_event(ClusterEvent.GPU_FREED)  # placed elsewhere: its holds went back to the pool
        for pod_plan, placement in result.statement.placements:
            self.binder.submit(pod_plan, placement, item, popped)

    def _schedule_gang(self, item: QueuedPod, plan: PodPlan, key: str, popped: float) -> bool:
        """Decide for the gang `key` that the popped pod belongs to. False: the gang's minimum is already
        placed, so the pod is scheduled on its own like any other."""
        gangs = self.gangs
        group = gangs.groups.get(key)
        if group is None or group.problem is not None:
            if group is not None:
                why = group.problem or ""
            elif not gangs.available:
                why = f"PodGroup {key} cannot exist: the PodGroup CRD ({GROUP}) is not installed"
            else:
                why = f"PodGroup {key} not found; the pod waits for it"
            self.metrics.attempts.labels(result="unschedulable").inc()
            self.queue.park(item, ())
            self._report_unschedulable(self._pending[plan.uid], why)
            return True
        placed = gangs.placed(key, self.state)
        need = group.min_member - len(placed)
        if need <= 0:
            return False
        gangs.started(key)
        members = sorted(u for u in gangs.members.get(key, ()) if u in self._pending and u not in self.state.pods)
        plans, items = [plan], [item]
        for uid in members:
            if uid == plan.uid:
                continue
            try:
                other = self.state.plan(self._pending[uid])
            except InvalidPod:
                continue  # it gets its own Event when it is popped
            taken = self.queue.take(uid)
            if taken is not None:
                plans.append(other)
                items.append(taken)
        self.policies.observe(plan.uid, plan.request)
        # every member bound passes admission: the quota's refusal keeps all of them (minimum over) or those
        # beyond what it admits waiting
        admitted, verdict = self.quotas.admit_gang(plans, need) if len(plans) >= need else (len(plans), None)
        if verdict is not None and not verdict.ok:
            for member, member_item in zip(plans[admitted:], items[admitted:], strict=True):
                self.metrics.attempts.labels(result="unschedulable").inc()
                self.queue.park(member_item, self.quotas.wake_hints(verdict))
                if (member_obj := self._pending.get(member.uid)) is not None:
                    self._report_unschedulable(member_obj, f"PodGroup {key}: {verdict.message}")
            if not admitted:
                return True
            plans, items = plans[:admitted], items[:admitted]
        if len(plans) < need:
            message = (f"PodGroup {key}: waiting for members: {len(placed)} placed and {len(plans)} pending "
                       f"of the {group.min_member} (minMember) that must start together")
            self._gang_unschedulable(key, plans, items, message)
            return True
        preempts = all(may_preempt(self._pending[p.uid], self.state.non_preempting_classes) for p in plans)
        floor = min(p.priority for p in plans)
        victims = (lambda: running_pods(self.state, self.budgets, floor)) if preempts else None
        reclaim = ((lambda: self.quotas.reclaim_gang(plans, running_pods(self.state, self.budgets)))
                   if preempts else None)
        result = self.cycle.schedule_gang(plans, need, victims, reclaim)
        self.metrics.algorithm_latency.observe(result.seconds)
        if result.statement is None or result.preemption is not None:
            assert result.unschedulable is not None
            message = f"PodGroup {key}: {result.unschedulable.message}"
            if placed:  # a gang short of members it had: say so, not "0 of the 1 members it needs"
                why = result.unschedulable.message
                if isinstance(result.unschedulable, GangUnschedulable):
                    why = result.unschedulable.unschedulable.message  # the per-node reasons
                message = (f"PodGroup {key}: {len(placed)} of the {group.min_member} members (minMember) are "
                           f"bound and {need} more must join them; none fits now: {why}")
            if result.preemption is not None:
                why = eviction_reason(result.reclaim, verdict.quota if verdict is not None else None)
                for member, eviction in result.statement.evictions if result.statement else ():
                    self.preemptor.carry_out(member, eviction, why)
                nodes = sorted({v.node for v in result.preemption.victims})
                message += (f"; preempting {len(result.preemption.victims)} pod(s) {why} on "
                            f"{', '.join(nodes)} for {len(result.preemption.members)} members")
            elif (blocked := result.blocked_by_budget) is not None:
                self.metrics.preemption_attempts.labels(result="pdb_blocked").inc()
                message += (f"; preemption would need {blocked.pdb_violations} pod(s) a PodDisruptionBudget "
                            f"protects: waiting")
            self._gang_unschedulable(key, plans, items, message)
            return True
        by_uid = dict(zip((p.uid for p in plans), items, strict=True))
        bound = set()
        for member, placement in result.statement.placements:
            self.binder.submit(member, placement, by_uid[member.uid], popped)
            bound.add(member.uid)
        for other_plan, other_item in zip(plans, items, strict=True):
            if other_plan.uid not in bound:  # beyond the minimum and no room now: on its own later
                self.queue.park(other_item, UNSCHEDULABLE_HINTS)
        if group.first_try is not None:
            self.metrics.gang_wait.observe(time.monotonic() - group.first_try)
        gangs.scheduled(key)
        log.info("PodGroup %s: %d member(s) placed together on %s", key, len(bound),
                 ", ".join(sorted({p.node for _, p in result.statement.placements})))
        return True

    def _gang_unschedulable(self, key: str, plans: list[PodPlan], items: list[QueuedPod], message: str) -> None:
        for member, member_item in zip(plans, items, strict=True):
            self.metrics.attempts.labels(result="unschedulable").inc()
            self.queue.park(member_item, UNSCHEDULABLE_HINTS)
            obj = self._pending.get(member.uid)
            if obj is not None:
                self._report_unschedulable(obj, message)
        group = self.gangs.groups.get(key)
        if group is not None:
            group.last_message = message

    def _bound(self, outcome: BindOutcome, item: QueuedPod) -> None:
        plan = outcome.plan
        if outcome.ok:
            self.queue.done(item.uid)
            self.recorder.scheduled(plan.namespace, plan.name, plan.uid, outcome.node)
            return
        key = self.gangs.member_of(plan.uid)
        if key is None or plan.uid in self.state.pods:
            return  # not a gang member, or its outcome is still unknown (kept while it is read)
        group = self.gangs.broke(key)
        if group is None:
            return
        placed = len(self.gangs.placed(key, self.state))
        timeout = group.timeout_s or self.config.gang_repair_s
        message = (f"member {plan.key}'s Binding to {outcome.node} failed ({outcome.error}): {placed} of the "
                   f"{group.min_member} members (minMember) are bound; the member is retried, and the bound "
                   f"ones are released if the gang is not whole again within {timeout:.0f} s")
        log.warning("PodGroup %s: %s", key, message)
        self.recorder.record_object((f"{GROUP}/{VERSION}", "PodGroup"), group.namespace, group.name, group.uid,
                                    "Warning", "GangBroken", message)
        group.last_message = message

    def _unbound(self, uid: str) -> None:
        """A pod read unbound after its Binding's outcome was unknown: back to the queue."""
        obj = self._pending.get(uid)
        if obj is not None:
            self.on_pod("MODIFIED", obj)

    def _verify_unconfirmed(self) -> None:
        for entry in self.state.expire():
            namespace, _, name = entry.key.partition("/")
            self.binder.verify(entry.uid, entry.key, namespace, name, entry.node, None)

    def _report_unschedulable(self, obj: dict[str, Any], message: str) -> None:
        meta = obj.get("metadata") or {}
        ns, name, uid = meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", "")
        log.info("pod %s/%s: %s", ns, name, message)
        self.recorder.unschedulable(ns, name, uid, message, condition=not says_unschedulable(obj, message))

    # ---- housekeeping: flush, expiry, gauges -----------------------------------------------------
    async def _housekeeping(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.config.housekeeping_s)
            try:
                self.queue.flush()
                self._verify_unconfirmed()
                self._expire_nominations()
                self._write_gang_status()
                self._release_broken_gangs()
                if self.leader.is_leader:
                    self._spawn(self._publish_quotas())
                self._gauges(full=tick % 5 == 0)
            except Exception:
                log.exception("housekeeping failed")
            tick += 1

    def _write_gang_status(self) -> None:
        """PodGroup status (phase, scheduled, running, ...) where it changed; only the leader writes."""
        if not self.leader.is_leader:
            return
        phases: Counter[str] = Counter()
        for group in list(self.gangs.groups.values()):
            if self.gangs.overdue(group.key) is not None:
                self.recorder.record_object(
                    (f"{GROUP}/{VERSION}", "PodGroup"), group.namespace, group.name, group.uid, "Warning",
                    "ScheduleTimeout", f"not placed within scheduleTimeoutSeconds ({group.timeout_s:.0f} s): "
                    f"{group.last_message}")
            status = self.gangs.status(group, self.state, self._ended)
            phases[status["phase"]] += 1
            if status == group.written:
                continue
            group.written = status
            self._spawn(self._patch_gang_status(group.namespace, group.name, status))
        self.metrics.gangs.clear()
        for phase, n in phases.items():
            self.metrics.gangs.labels(phase=phase).set(n)

    def _release_broken_gangs(self) -> None:
        """A committed gang that lost a member (its Binding failed) and is still short after its timeout:
        its bound members are evicted (their controller recreates them, and the gang is placed whole)."""
        if not self.leader.is_leader:
            return
        for group in self.gangs.to_release(self.state, self.config.gang_repair_s):
            bound = [self.state.pods[u] for u in sorted(self.gangs.placed(group.key, self.state))]
            bound = [e for e in bound if e.phase.value in ("bound", "confirmed")]
            message = (f"not whole again within {group.timeout_s or self.config.gang_repair_s:.0f} s after a "
                       f"member's Binding failed: releasing its {len(bound)} bound member(s) "
                       f"({', '.join(e.key for e in bound) or 'none'}) so that it is placed whole again")
            log.warning("PodGroup %s: %s", group.key, message)
            self.recorder.record_object((f"{GROUP}/{VERSION}", "PodGroup"), group.namespace, group.name, group.uid,
                                        "Warning", "GangReleased", message)
            group.last_message = message
            for entry in bound:
                namespace, _, name = entry.key.partition("/")
                self.recorder.record(namespace, name, entry.uid, "Warning", "GangReleased",
                                     f"evicted: its PodGroup {group.key} is short of minMember ({message})")
                self._spawn(self._evict_member(group.key, namespace, name, entry.uid))

    async def _evict_member(self, key: str, namespace: str, name: str, uid: str) -> None:
        try:
            await self.api.evict(namespace, name, uid, None)
        except ApiError as exc:
            log.warning("pod %s/%s: releasing it from its broken gang failed (%s); trying again after the "
                        "gang's timeout", namespace, name, exc)
            group = self.gangs.groups.get(key)
            if group is not None and group.broken_since is None:
                group.committed = True
                self.gangs.broke(key)

    async def _patch_gang_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            await self.api.patch_custom_status(GROUP, VERSION, PLURAL, namespace, name, status)
        except ApiError as exc:
            log.warning("PodGroup %s/%s: writing its status failed: %s", namespace, name, exc)
            group = self.gangs.groups.get(f"{namespace}/{name}")
            if group is not None:
                group.written = {}  # written again at the next housekeeping

    async def _publish_quotas(self) -> None:
        try:
            await self.quotas.publish(self.api)
        except ApiError as exc:
            log.warning("writing GpuQuota status failed: %s", exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _expire_nominations(self) -> None:
        stale = self.state.expire_nominations()
        for nomination in stale:
            if not self.leader.is_leader:
                continue  # the leader clears the field; this replica only stops holding
            namespace, _, name = nomination.key.partition("/")
            self.preemptor.clear(namespace, name)
        if stale:
            self.queue.on_event(ClusterEvent.GPU_FREED)

    def _gauges(self, full: bool) -> None:
        m = self.metrics
        m.nominations.set(len(self.state.nominations))
        m.leader.set(1 if self.leader.is_leader else 0)
        m.queue_length.clear()
        for (queue, priority), n in self.queue.lengths().items():
            m.queue_length.labels(queue=queue, priority=str(priority)).set(n)
        phases = Counter(e.phase.value for e in self.state.pods.values())
        for phase in Phase:
            m.ledger.labels(phase=phase.value).set(phases.get(phase.value, 0))
        m.gate_timeouts.set(self.state.gate_timeouts)
        if not full:
            return
        m.pending_oldest_age.clear()
        wall = time.time()
        for priority, created in self.queue.oldest_created_by_priority().items():
            m.pending_oldest_age.labels(priority=str(priority)).set(max(0.0, wall - created))
        gpus: Counter[str] = Counter()
        units: Counter[str] = Counter()
        unit = self.config.memory_unit_mib
        for e in self.state.pods.values():
            for part in (e.placement, *e.placement.extras):
                if part.gpu_indices and part.gpu_milli >= 1000:
                    gpus[e.node] += len(part.gpu_indices)
                elif part.gpu_memory_mib and part.gpu_indices:
                    units[e.node] += part.gpu_memory_mib // unit
        views = self.state.nodes.values()
        health = Counter("healthy" if g.healthy else "unhealthy" for v in views for g in v.spec.gpus)
        for state in ("healthy", "unhealthy"):
            m.gpus.labels(health=state).set(health.get(state, 0))
        by_state = gpu_states(self.state)
        for state in GPU_STATES:
            m.cluster_gpus.labels(state=state).set(by_state.get(state, 0))
        children = self._node_gauges  # labels() per node and tick would cost more than the rest together
        for node in [n for n in children if n not in self.state.nodes]:
            del children[node]
            m.gpus_bound.remove(node)
            m.memory_units_bound.remove(node)
        for node in self.state.nodes:
            pair = children.get(node)
            if pair is None:
                pair = children[node] = (m.gpus_bound.labels(node=node), m.memory_units_bound.labels(node=node))
            pair[0].set(gpus.get(node, 0))
            pair[1].set(units.get(node, 0))
        snap = self.state.snapshot
        total = snap.total_gpu_milli
        if total:
            m.gpu_allocated.set(100.0 * snap.used_gpu_milli() / total)
            frag = cluster_fragmentation_milli(snap, self.policies.profile.profile())
            m.fragmentation.set(100.0 * frag / total)

    # ---- health ----------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        role = "leading" if self.leader.is_leader else "standing by"
        return caches_ready(self.synced, f"synced, {role}")

