"""The scheduler service: watch → state (ledger) → queue → cycle (placement core) → binder → events.

    kopf on.event (pods, nodes, PriorityClasses, PodDisruptionBudgets, ..., Jobs while defrag is on)
          │
          ▼
    ClusterState ──(facts, snapshot)──▶ Cycle: decide() ──▶ Statement ──▶ Binder: gate → Binding
          │                                 ▲                                  │
          └──(cluster events)──▶ SchedulingQueue ◀──(backoff / park)───────────┘
                                          │
                                          └──▶ FailedScheduling Event + PodScheduled=False
    Cycle: fits nowhere ──▶ plan_preemption ──▶ Statement (evictions) ──▶ Preemptor: nominate, Eviction API

Everything runs on one asyncio loop (kopf's); only API calls (on thread pools) and eviction planning (on a
worker thread, against its own snapshot copy) leave it. The state is
rebuilt from a LIST of nodes and pods (their assignment and ack annotations) before the first cycle,
so a restarted scheduler never hands out a device twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpupool_sched.cache import gcpolicy
from gpupool_sched.cache.nodes import apply_node_event
from gpupool_sched.cache.policy import PolicyCache
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.cache.sync import caches_ready, initial_sync, stop_syncing
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.gangs import PODGROUPS, Gangs
from gpupool_sched.framework.plugins.idle import IdleReclaimConfig
from gpupool_sched.framework.plugins.movers import job_kind
from gpupool_sched.framework.plugins.quotas import QuotaBook, quota_kinds
from gpupool_sched.framework.plugins.victims import DEFAULT_MAX_CHECKPOINT_GRACE_S, DisruptionBudgets
from gpupool_sched.framework.queue import ClusterEvent, QueuedPod, QuotaFreed, SchedulingQueue
from gpupool_sched.kube.informer import Informers, WatchedKind
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.candidates import (
    MIN_CANDIDATE_NODES_ABSOLUTE,
    MIN_CANDIDATE_NODES_PERCENTAGE,
    CandidateBudget,
)
from gpupool_sched.scheduler.adoption import Adoption
from gpupool_sched.scheduler.defrag import Defrag
from gpupool_sched.scheduler.elastic import Elastic, ElasticConfig
from gpupool_sched.scheduler.gang_upkeep import GangUpkeep
from gpupool_sched.scheduler.gauges import Gauges
from gpupool_sched.scheduler.housekeeping import Housekeeping
from gpupool_sched.scheduler.idle import IdleReclaim
from gpupool_sched.scheduler.leader import AlwaysLeader, LeaderElector
from gpupool_sched.scheduler.scheduling import Scheduling
from gpupool_sched.writer.binder import Binder, BindOutcome
from gpupool_sched.writer.elastic import ElasticWriter
from gpupool_sched.writer.preemptor import Preemptor
from gpupool_sched.writer.recorder import EventRecorder
from gpupool_sched.writer.status import StatusWriter

log = logging.getLogger(__name__)

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
    scheduled_events: str = "best-effort"  # "all": no Scheduled Event dropped when the Event queue is full
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
    preemption_min_candidate_nodes_percentage: int = MIN_CANDIDATE_NODES_PERCENTAGE  # kube-scheduler's
    preemption_min_candidate_nodes_absolute: int = MIN_CANDIDATE_NODES_ABSOLUTE  # DefaultPreemptionArgs
    preemption_search_budget_s: float | None = None  # a search also ends after this, with a candidate found
    consistency_check_s: float = 300.0  # a re-list of every watched kind that repairs what the watch missed
    defrag: DefragConfig = field(default_factory=DefragConfig)  # the consolidate action (docs/defragmentation.md)
    freeze_gc: bool = False  # the process's own (CLI): gc.freeze() after the first sync
    idle: IdleReclaimConfig = field(default_factory=IdleReclaimConfig)  # idle GPUs (docs/idle-and-elastic.md)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)  # elastic inference (docs/idle-and-elastic.md)


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
                           max_checkpoint_grace_s=config.max_checkpoint_grace_s,
                           candidates=CandidateBudget(config.preemption_min_candidate_nodes_percentage,
                                                      config.preemption_min_candidate_nodes_absolute,
                                                      config.preemption_search_budget_s),
                           max_movers=config.defrag.max_movers)
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
                                      keep_scheduled=config.scheduled_events == "all",
                                      waiting=lambda uid: uid in self.pending and uid not in self.state.pods)
        self.budgets = DisruptionBudgets()
        self.preemptor = Preemptor(self.state, api, self.queue, self.metrics, self.recorder,
                                   max_checkpoint_grace_s=config.max_checkpoint_grace_s)
        self.pending: dict[str, PodInfo] = {}  # uid -> latest event of our pending pods, read once
        self.gangs = Gangs()
        self.quotas = QuotaBook(self.state, self.metrics.registry)
        self.quotas.on_freed = lambda quota: self.queue.on_event(QuotaFreed(quota))  # over-quota pods: wake_hints
        self.defrag = Defrag.build(config.defrag, self.state, self.budgets, self.queue, self.preemptor,
                                   self.metrics, self.recorder)
        self.defrag.policy, self.defrag.hold_s = self.cycle.policy, self.cycle.hold_s  # background consolidation
        self.defrag.profile = self.policies.profile.profile
        self.elastic = Elastic(config.elastic, self.state, self.queue,
                               ElasticWriter(self.state, api, self.queue, self.recorder),
                               self.metrics, self.cycle.policy)
        self.informers = Informers(api, self._watched_kinds(), registry=self.metrics.registry,
                                   consistency_check_s=config.consistency_check_s)
        self._writes: set[asyncio.Task[None]] = set()  # status writes in flight (kept referenced)
        self.decisions = 0
        self.idle = IdleReclaim(config.idle, self.state, self.quotas, self.gangs, self.budgets, self.preemptor,
                                self.recorder, self.metrics)
        self.scheduling = Scheduling(self.state, self.queue, self.cycle, self.quotas, self.gangs, self.budgets,
                                     self.binder, self.preemptor, self.recorder, self.metrics, self.pending,
                                     self.policies.observe, self.defrag, self.idle,
                                     elastic=self.elastic if config.elastic.enabled else None)
        self.statuses = StatusWriter(api)  # GpuQuota and PodGroup status
        self.gang_upkeep = GangUpkeep(self.state, self.gangs, self.statuses, self.preemptor, self.recorder,
                                      self.metrics, lambda: self.leader.is_leader, self.spawn, self._wake_gang,
                                      repair_s=config.gang_repair_s)
        self.gauges = Gauges(self.metrics, self.state, self.queue, lambda: self.leader.is_leader,
                             self.policies.profile.profile, config.memory_unit_mib)
        self.adoption = Adoption(self.state, self.queue, self.quotas, self.cycle.hold_s, self.defrag.started)
        self.housekeeping = Housekeeping(self)
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
            loop.create_task(self.housekeeping.run(), name="housekeeping"),
            loop.create_task(self.informers.run_checks(), name="consistency-check"),
        ]
        log.info("scheduler %s started in %.1f s: %d nodes, %d pods in the ledger, %d pending",
                 self.config.scheduler_name, time.monotonic() - began, len(self.state.nodes), len(self.state.pods),
                 len(self.queue))

    async def resync(self) -> None:
        """LIST every watched kind into the state, in dependency order (classes, budgets, groups, quotas
        and Jobs before the pods that name them; nodes before their pods)."""
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
            # which Jobs tolerate a disruption (their pods may move): only the consolidate action asks
            *([job_kind(self.defrag.movers)] if self.config.defrag.enabled else []),
            *(self.elastic.kinds() if self.config.elastic.enabled else []),  # elastic Deployments and their HPAs
            WatchedKind("nodes", "/api/v1/nodes", self.on_node),
            WatchedKind("pods", "/api/v1/pods", self.on_pod),
        ]

    async def stop(self) -> None:
        await stop_syncing(self.informers, self._tasks)
        await self.binder.drain()
        await self.preemptor.drain()
        await self.elastic.writer.drain()
        await self.idle.drain()
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
        info = PodInfo.of(obj)  # read once: the cache, the queue and the cycle carry it
        uid = info.uid
        update = self.state.apply_pod(info, deleted=kind == "DELETED")
        self.gang_upkeep.track(uid, obj, kind == "DELETED")
        self.defrag.observe(uid, obj, kind == "DELETED")
        self.elastic.observe(uid, obj, kind == "DELETED")
        if update.gone:
            self.pending.pop(uid, None)
            self.queue.delete(uid)
            self.defrag.forget(uid)
            if kind != "DELETED" and (info.obj.get("spec") or {}).get("nodeName"):
                self.elastic.bound(uid)  # bound, seen before the Binding's answer (lost, or late): a handover ends
            self.elastic.forget(uid)
            entry = self.state.pods.get(uid)
            if entry is not None and not entry.ours:
                self.policies.observe(uid, entry.request)
        if update.freed:
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if update.gate_released:
            self.binder.gate_released(update.gate_released)
        if update.pending_ours:
            log.debug("pod %s pending (%s)", info.key, kind)
            self.pending[uid] = info.follows(self.pending.get(uid))
            priority = obj.get("spec", {}).get("priority")
            if not isinstance(priority, int):
                priority = self.state.priority_classes.get(obj.get("spec", {}).get("priorityClassName") or "", 0)
            item = QueuedPod(uid=uid, key=info.key, priority=priority, created=_created(obj), payload=None,
                             revision=info.revision)
            self.queue.add(item)
            self.adoption.follow(info, priority)

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
                    await self.scheduling.schedule_one_offloaded(item)
                except Exception:  # nothing a pod says may stop the loop
                    log.exception("scheduling %s failed unexpectedly", item.key)
                    self.metrics.attempts.labels(result="error").inc()
                    self.queue.backoff(item)
                self.decisions += 1
                item = (self.queue.pop() if time.monotonic() < until and self.leader.is_leader
                        and not self.informers.stale else None)
            await asyncio.sleep(0)

    def schedule_one(self, item: QueuedPod) -> None:
        self.scheduling.schedule_one(item)

    def _bound(self, outcome: BindOutcome, item: QueuedPod) -> None:
        plan = outcome.plan
        if outcome.ok:
            self.queue.done(item.uid)
            self.defrag.placed(plan.uid)
            self.elastic.bound(plan.uid)
            self.recorder.scheduled(plan.namespace, plan.name, plan.uid, outcome.node)
        else:
            self.gang_upkeep.bind_failed(outcome)

    def _unbound(self, uid: str) -> None:
        """A pod read unbound after its Binding's outcome was unknown: back to the queue."""
        info = self.pending.get(uid)
        if info is not None:
            self.on_pod("MODIFIED", dict(info.obj))

    def _verify_unconfirmed(self) -> None:
        self.housekeeping.verify_unconfirmed()

    def _waiting_for_gpus(self) -> bool:
        return self.housekeeping.waiting_for_gpus()

    def spawn(self, coro: Any) -> None:
        """Run an API write on the loop, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    # ---- health ----------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        role = "leading" if self.leader.is_leader else "standing by"
        return caches_ready(self.synced, f"synced, {role}")

