"""Idle GPUs in the scheduler service (issue 20 §2, docs/idle-and-elastic.md): the pods the device plugins
list idle (`ClusterState.idle_pods`) under the policy of their namespace (a GpuQuota's `spec.idleReclaim`, else
the scheduler's `--idle-reclaim-*` default), the pure choice (framework/plugins/idle.py) asked for

* a pending pod (`victims`, the reclaim-idle action's candidates: reclaimWhenNeeded and reclaim), and
* the housekeeping tick (`tick`): the gauges on every replica; while leading, the `report` Events (once per
  idle spell) and the `reclaim` sweep (pods idle past idleAfter, within the hourly budget, through the
  Eviction API like every eviction of the scheduler: a PodDisruptionBudget that forbids it is respected).

The budget, the report marks and the sweep's holds-off live in this process: a failover or a restart starts
them afresh (documented)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpupool_sched.cache.entries import TERMINATING, Phase, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.gangs import Gangs
from gpupool_sched.framework.plugins.idle import (
    ACTIONS,
    NONE,
    RECLAIM,
    RECLAIMING,
    REPORT,
    IdleBudget,
    IdleCandidate,
    IdlePod,
    IdlePolicy,
    IdleReclaimConfig,
    describe_duration,
    idle_past,
    reclaimable,
)
from gpupool_sched.framework.plugins.quotas import QuotaBook
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, running_pods
from gpupool_sched.framework.session import IdleVictims
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.preemption import RunningPod
from gpupool_sched.writer.preemptor import IdleVictim, Preemptor
from gpupool_sched.writer.recorder import EventRecorder

log = logging.getLogger(__name__)

IDLE_WHY = "idle on their GPUs past their idleAfter"  # the preemptor's Events: why the victims go
BLOCKED_RETRY_S = 60.0  # a sweep eviction a PodDisruptionBudget refused is tried again after this
ACTIONS_SHOWN = ACTIONS  # the gauges' label values


def since_text(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class IdleReclaim:
    config: IdleReclaimConfig
    state: ClusterState
    quotas: QuotaBook
    gangs: Gangs
    budgets: DisruptionBudgets
    preemptor: Preemptor
    recorder: EventRecorder
    metrics: SchedulerMetrics
    now: Callable[[], float] = time.time  # wall clock: the plugins' since-times are UTC
    budget: IdleBudget = field(init=False)
    reported: set[tuple[str, float]] = field(default_factory=set)  # (uid, since) told once per idle spell
    over_budget: set[tuple[str, float]] = field(default_factory=set)  # counted blocked once per spell
    retry_at: dict[str, float] = field(default_factory=dict)  # uid -> when a refused sweep eviction retries
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.budget = IdleBudget(self.config.budget_per_hour, time.monotonic)
        self.state.on_idle_invalid = lambda node, problem: self.metrics.idle_annotation_invalid.inc()

    # ---- what the plain choice is given -----------------------------------------------------------
    def policy_of(self, namespace: str) -> IdlePolicy | None:
        policy = self.quotas.idle_policy(namespace)
        if policy is not None:
            return policy
        if self.config.action == NONE:
            return None
        return IdlePolicy(self.config.action, self.config.idle_after_s)

    def pods(self) -> list[IdlePod]:
        """The running pods their own node lists idle, not being evicted already."""
        out = []
        for node, listed in self.state.idle_pods.items():
            for uid, since in listed.items():
                entry = self.state.pods.get(uid)
                if (entry is None or entry.node != node or entry.phase not in (Phase.BOUND, Phase.CONFIRMED)
                        or not entry.applied or entry.evicting_for is not None):
                    continue
                out.append(IdlePod(uid, entry.key, node, since, entry.started, self.gpus(entry), entry.idle_never,
                                   self.gangs.member_of(uid), entry.request.priority))
        return out

    def gpus(self, entry: PodEntry) -> float:
        """The GPUs `entry` holds: whole ones, and a memory share as its fraction of the GPU's memory."""
        view = self.state.nodes.get(entry.node)
        total = 0.0
        for part in entry.placement.parts():
            for index in part.gpu_indices:
                if part.gpu_milli >= 1000:
                    total += 1.0
                elif part.gpu_memory_mib and view is not None and index < len(view.spec.gpus):
                    total += part.gpu_memory_mib / max(1, view.spec.gpus[index].memory_mib)
        return round(total, 3)

    def gang_members(self) -> dict[str, set[str]]:
        """Each PodGroup's members the ledger holds."""
        return {key: {u for u in members if u in self.state.pods} for key, members in self.gangs.members.items()}

    def _reclaimable(self, actions: Iterable[str], budget_left: int) -> list[IdleCandidate]:
        return reclaimable(self.pods(), self.policy_of, self.now(), actions=frozenset(actions),
                           gangs=self.gang_members(), start_grace_s=self.config.start_grace_s,
                           budget_left=budget_left)

    # ---- a pending pod (the reclaim-idle action) -------------------------------------------------
    def may_help(self) -> bool:
        """Cheap: some node lists an idle pod and the budget allows a reclaim."""
        return bool(self.state.idle_pods) and self.budget.left() > 0

    def victims(self, plans: list[PodPlan], priority: int, key: str) -> IdleVictims | None:
        """The idle pods `plans` (one job) may take: those idle past idleAfter under reclaimWhenNeeded or
        reclaim, within the budget; all of them when the job is within its GpuQuota's guarantee, else only
        those of lower priority than the job's."""
        chosen = self._reclaimable(RECLAIMING, self.budget.left())
        if not chosen:
            return None
        uids = {c.pod.uid for c in chosen}
        running = [p for p in running_pods(self.state, self.budgets) if p.uid in uids]
        quota = self.quotas.within_guarantee(plans)
        if quota is not None:
            entitled = f"within its guarantee of GpuQuota {quota}"
            plan_priority = max(p.priority for p in running) + 1 if running else priority
        else:
            running = [p for p in running if p.priority < priority]
            entitled = f"priority {priority} > " + (", ".join(sorted({str(p.priority) for p in running})) or "-")
            plan_priority = priority
        if not running:
            return None
        gangs = {c.pod.uid: c.pod.gang for c in chosen}
        members = self.gang_members()

        def whole(victims: Iterable[str]) -> bool:
            taken = set(victims)
            return all(members.get(g, set()) <= taken for u in taken if (g := gangs.get(u)) is not None)

        log.debug("pod %s may reclaim %d idle pod(s) (%s)", key, len(running), entitled)
        return IdleVictims(running, plan_priority, entitled, whole, {c.pod.uid: c.pod.idle_since for c in chosen},
                           self.metrics.idle_reclaims.labels(reason="needed", result="blocked").inc)

    def messages(self, key: str, found: IdleVictims, victims: Iterable[RunningPod]) -> dict[str, IdleVictim]:
        """The victims' Events: how long each was idle, where, and who needed its GPUs."""
        now = self.now()
        out = {}
        for victim in victims:
            entry = self.state.pods.get(victim.uid)
            since = found.idle_since.get(victim.uid)
            if entry is None or since is None:
                continue
            out[victim.uid] = IdleVictim(
                f"Idle for {describe_duration(now - since)} (since {since_text(since)}) on node {entry.node}; its "
                f"GPUs were needed by {key} ({found.entitled})", self.gpus(entry))
        return out

    def spent(self, n: int) -> None:
        self.budget.spend(n)

    # ---- housekeeping ----------------------------------------------------------------------------
    def tick(self, leading: bool) -> None:
        now = self.now()
        past = idle_past(self.pods(), self.policy_of, now)
        pods = dict.fromkeys(ACTIONS_SHOWN, 0)
        gpus = dict.fromkeys(ACTIONS_SHOWN, 0.0)
        for c in past:
            pods[c.policy.action] += 1
            gpus[c.policy.action] += c.pod.gpus
        for action in ACTIONS_SHOWN:
            self.metrics.idle_pods.labels(action=action).set(pods[action])
            self.metrics.idle_gpus.labels(action=action).set(round(gpus[action], 3))
        spells = {(c.pod.uid, c.pod.idle_since) for c in past}
        self.reported &= spells
        self.over_budget &= spells
        if not leading:
            return
        for c in past:
            if c.policy.action == REPORT and (c.pod.uid, c.pod.idle_since) not in self.reported:
                self.reported.add((c.pod.uid, c.pod.idle_since))
                self._report(c)
        self._sweep(now)

    def _report(self, c: IdleCandidate) -> None:
        namespace, _, name = c.pod.key.partition("/")
        where = "" if c.policy.source == "default" else f" of {c.policy.source}"
        since = since_text(c.pod.idle_since)
        self.recorder.record(namespace, name, c.pod.uid, "Normal", "IdleGPU",
                             f"Idle on its GPUs for {describe_duration(c.idle_s)} (since {since}) "
                             f"on node {c.pod.node}, past idleAfter {describe_duration(c.policy.idle_after_s)}; "
                             f"the idle policy{where} only reports: nothing is reclaimed")

    def _sweep(self, now: float) -> None:
        """Evict the pods idle past idleAfter under action reclaim, within the budget."""
        everything = self._reclaimable((RECLAIM,), 1 << 30)
        if not everything:
            return
        left = self.budget.left()
        chosen = self._reclaimable((RECLAIM,), left) if left > 0 else []
        picked = {c.pod.uid for c in chosen}
        for c in everything:
            spell = (c.pod.uid, c.pod.idle_since)
            if c.pod.uid not in picked and spell not in self.over_budget:
                self.over_budget.add(spell)
                self.metrics.idle_reclaims.labels(reason="policy", result="blocked").inc()
                log.info("pod %s: idle past idleAfter under action reclaim; the idle reclaim budget "
                         "(--idle-reclaim-budget) is spent this hour", c.pod.key)
        mono = time.monotonic()
        for c in chosen:
            if self.retry_at.get(c.pod.uid, 0.0) > mono:
                continue
            entry = self.state.pods.get(c.pod.uid)
            if entry is None or entry.evicting_for is not None:
                continue
            entry.evicting_for = TERMINATING  # never a victim or a candidate again while it goes
            self.budget.spend(1)
            task = asyncio.get_running_loop().create_task(self._evict(c, entry))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _evict(self, c: IdleCandidate, entry: PodEntry) -> None:
        namespace, _, name = c.pod.key.partition("/")
        try:
            await self.preemptor.evict_pod(namespace, name, c.pod.uid, None)
        except ApiError as exc:
            if exc.status == 404:
                return
            if entry.evicting_for == TERMINATING:
                entry.evicting_for = None
            self.budget.refund()
            self.retry_at[c.pod.uid] = time.monotonic() + BLOCKED_RETRY_S
            result = "blocked" if exc.status == 429 else "failed"
            self.metrics.idle_reclaims.labels(reason="policy", result=result).inc()
            why = "a PodDisruptionBudget forbids it now" if exc.status == 429 else str(exc)
            log.warning("pod %s: idle reclaim refused (%s); trying again in %.0f s", c.pod.key, why, BLOCKED_RETRY_S)
            return
        self.retry_at.pop(c.pod.uid, None)
        self.metrics.idle_reclaims.labels(reason="policy", result="evicted").inc()
        self.metrics.idle_reclaimed_gpus.labels(reason="policy").inc(c.pod.gpus)
        where = "" if c.policy.source == "default" else f" of {c.policy.source}"
        message = (f"Idle for {describe_duration(c.idle_s)} (since {since_text(c.pod.idle_since)}) on node "
                   f"{c.pod.node}; the idle policy{where} is reclaim: idle past idleAfter "
                   f"{describe_duration(c.policy.idle_after_s)}")
        log.info("pod %s reclaimed: %s", c.pod.key, message)
        self.recorder.record(namespace, name, c.pod.uid, "Warning", "IdleReclaimed", message)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))
