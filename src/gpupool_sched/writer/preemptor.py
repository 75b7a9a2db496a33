"""Carrying out a preemption: the cycle decided (`plan_preemption`, pure) and marked the victims and the
nomination in the state; this evicts them through the Eviction API (so PodDisruptionBudgets hold), sets
the preemptor's status.nominatedNodeName and posts the Events that say who preempted whom and why.

Like the binder it runs as asyncio tasks off the cycle. A victim already gone (404) is fine; any other
failure (429: a PDB forbids it) aborts the preemption: victims not yet evicted are spared, the holds of
the gone ones are released, the nomination is cleared and the preemptor retried after its backoff.
The one eviction path of the scheduler: a broken gang's members are released through `release` too.
Which pods may preempt, which are candidates and how long a nomination holds: framework/plugins/victims.py.
docs/preemption.md tells the whole story.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gpupool_sched.cache.entries import CHECKPOINT_GRACE
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.victims import (
    BY_PRIORITY,
    DEFAULT_MAX_CHECKPOINT_GRACE_S,
    asks,
    checkpoint_grace_s,
)
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.preemption import Preemption
from gpupool_sched.writer.recorder import EventRecorder

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class IdleVictim:
    """An idle pod reclaimed for a pending pod (reclaim-idle): its Event's message and the GPUs it holds."""

    message: str
    gpus: float


@dataclass(frozen=True, slots=True)
class Target:
    uid: str
    namespace: str
    name: str
    priority: int
    grace_s: int | None  # the eviction's gracePeriodSeconds (None: the pod's own)
    asked_s: int | None = None  # the checkpoint annotation, when the cap clamped it


class Preemptor:
    def __init__(self, state: ClusterState, api: KubeApi, queue: SchedulingQueue, metrics: SchedulerMetrics,
                 recorder: EventRecorder, *, max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> None:
        self.max_checkpoint_grace_s = max_checkpoint_grace_s
        self.state = state
        self.api = api
        self.queue = queue
        self.metrics = metrics
        self.recorder = recorder
        self._tasks: set[asyncio.Task[None]] = set()

    def carry_out(self, plan: PodPlan, preemption: Preemption, why: str = BY_PRIORITY,
                  idle: Mapping[str, IdleVictim] | None = None) -> None:
        """Start evicting `preemption`'s victims for `plan` (already nominated in the state); `why` the
        victims go, for the Events (quota reclaim evicts pods whatever their priority). `idle`: the victims
        are idle pods reclaimed for it (their Event is IdleReclaimed, with this message)."""
        targets = []
        for victim in preemption.victims:
            entry = self.state.pods[victim.uid]
            namespace, _, name = entry.key.partition("/")
            grace = checkpoint_grace_s(entry, self.max_checkpoint_grace_s)
            asked = entry.grace_s if entry.grace_s != grace else None
            if asked is not None:
                log.warning("pod %s/%s asks %s=%d; capped at %d s (--max-checkpoint-grace)",
                            namespace, name, CHECKPOINT_GRACE, asked, grace)
            targets.append(Target(victim.uid, namespace, name, victim.priority, grace, asked))
        self.metrics.preemption_attempts.labels(result="planned").inc()
        log.info("pod %s (priority %d) preempts %d pod(s) on %s: %s", plan.key, plan.priority, len(targets),
                 preemption.node, ", ".join(f"{t.namespace}/{t.name}" for t in targets))
        task = asyncio.get_running_loop().create_task(self._run(plan, preemption.node, targets, why, idle or {}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def clear(self, namespace: str, name: str) -> None:
        """Clear a pod's status.nominatedNodeName (its nomination expired)."""
        task = asyncio.get_running_loop().create_task(self._clear(namespace, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, namespace: str, name: str, uid: str) -> None:
        """Evict a pod outside a preemption, with its own grace period: a member of a broken gang released
        (scheduler/gang_upkeep.py). ApiError when it fails (404 included: the caller decides)."""
        await self.evict_pod(namespace, name, uid, None)

    async def evict_pod(self, namespace: str, name: str, uid: str, grace_s: int | None) -> None:
        """The scheduler's one call of the Eviction API (preemption, migration, a broken gang's release)."""
        await self.api.evict(namespace, name, uid, grace_s)

    async def _clear(self, namespace: str, name: str) -> None:
        try:
            await self.api.set_nominated_node(namespace, name, None)
        except ApiError as exc:
            if exc.status != 404:
                log.warning("pod %s/%s: clearing nominatedNodeName failed: %s", namespace, name, exc)

    async def _run(self, plan: PodPlan, node: str, targets: list[Target], why: str = BY_PRIORITY,
                   idle: Mapping[str, IdleVictim] | None = None) -> None:
        idle = idle or {}
        try:
            await self.api.set_nominated_node(plan.namespace, plan.name, node)
        except ApiError as exc:
            if exc.status == 404:  # the preemptor is gone: evict nobody
                self._abort(plan, targets, exc, clear=False)
                return
            log.warning("pod %s: setting nominatedNodeName failed (%s); evicting anyway", plan.key, exc)
        names = ", ".join(f"{t.namespace}/{t.name}" for t in targets)
        self.recorder.record(plan.namespace, plan.name, plan.uid, "Normal", "Preempting",
                             f"Preempting {len(targets)} pod(s) {why} on node {node}: {names}")
        what = asks(plan.request)
        for i, target in enumerate(targets):
            if plan.uid not in self.state.nominations:  # placed, deleted or expired meanwhile
                self.state.spare(plan.uid, (t.uid for t in targets[i:]))
                return
            try:
                await self.evict_pod(target.namespace, target.name, target.uid, target.grace_s)
            except ApiError as exc:
                if exc.status == 404:
                    continue  # already gone: what it held is free (or held, if the watch saw it go)
                if target.uid in idle:
                    result = "blocked" if exc.status == 429 else "failed"
                    self.metrics.idle_reclaims.labels(reason="needed", result=result).inc()
                self._abort(plan, targets[i:], exc, clear=True)
                return
            if (reclaimed := idle.get(target.uid)) is not None:
                self.metrics.preemption_victims.labels(reason="idle").inc()
                self.metrics.idle_reclaims.labels(reason="needed", result="evicted").inc()
                self.metrics.idle_reclaimed_gpus.labels(reason="needed").inc(reclaimed.gpus)
                self.recorder.record(target.namespace, target.name, target.uid, "Warning", "IdleReclaimed",
                                     reclaimed.message)
                continue
            self.metrics.preemption_victims.labels(reason="priority" if why == BY_PRIORITY else "quota").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Warning", "Preempted",
                f"Preempted by {plan.key} (priority {plan.priority}) on node {node} to make room for {what}"
                + ("" if why == BY_PRIORITY else f": pod(s) {why}")
                + (f"; checkpoint grace {target.grace_s}s" if target.grace_s is not None else "")
                + (f" ({CHECKPOINT_GRACE} asks {target.asked_s}s; capped at {target.grace_s}s)"
                   if target.asked_s is not None else ""))

    def _abort(self, plan: PodPlan, remaining: list[Target], exc: ApiError, *, clear: bool) -> None:
        blocked = "a PodDisruptionBudget forbids it" if exc.status == 429 else str(exc)
        log.warning("pod %s: preemption aborted at %s (%s); retrying later",
                    plan.key, f"{remaining[0].namespace}/{remaining[0].name}" if remaining else "-", blocked)
        self.metrics.preemption_attempts.labels(result="failed").inc()
        self.state.spare(plan.uid, (t.uid for t in remaining))
        if self.state.end_nomination(plan.uid):
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if clear:
            self.recorder.record(plan.namespace, plan.name, plan.uid, "Warning", "PreemptionFailed",
                                 f"Preemption stopped: evicting {remaining[0].namespace}/{remaining[0].name} "
                                 f"failed: {blocked}")
            self.clear(plan.namespace, plan.name)
            self.queue.retry(plan.uid)
