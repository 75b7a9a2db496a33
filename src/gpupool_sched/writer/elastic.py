"""Elastic inference's writes (docs/idle-and-elastic.md#elastic-inference): a replica lent (the Deployment's
count up by one, or its HPA's maxReplicas), and borrowed replicas given back for a waiting pod.

A give-back never goes through the Eviction API: the ReplicaSet would recreate the replica at once. The
chosen replicas get the lowest `controller.kubernetes.io/pod-deletion-cost` first, then the count goes down
to the replicas that stay, so that the ReplicaSet removes exactly them (among running, ready replicas it
removes the lowest cost first; an unscheduled replica of the Deployment goes before any, and is one fewer
to keep). With an HPA on the Deployment its maxReplicas goes down to that count first (the HPA would clamp
to it anyway), then the count. Every count write is a read-modify-write under the object's
resourceVersion; a conflict is read and decided again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube.kubeapi import ApiError, KubeApi, autoscalers_path, deployment_path
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.writer.recorder import EventRecorder
from gpupool_sched.writer.surge_record import LOWEST_COST

log = logging.getLogger(__name__)

DEPLOYMENT = ("apps/v1", "Deployment")
CONFLICT_RETRIES = 5


@dataclass(frozen=True, slots=True)
class Loan:
    """A borrowed replica chosen to go back."""

    uid: str
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Borrowed replicas of one Deployment given back for `plan`, nominated on `node`."""

    namespace: str
    deployment: str
    loans: tuple[Loan, ...]
    keep: int  # running replicas that stay: the count it is scaled down to
    hpa: str | None  # the HPA that scales it, if any


class ElasticWriter:
    def __init__(self, state: ClusterState, api: KubeApi, queue: SchedulingQueue, recorder: EventRecorder) -> None:
        self.state = state
        self.api = api
        self.queue = queue
        self.recorder = recorder
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # ---- lending ------------------------------------------------------------------------------------
    async def scale(self, namespace: str, name: str, replicas: Callable[[int], int | None]) -> int | None:
        """Set the Deployment's count to `replicas(now)` (None: leave it); the count written, or None."""
        for _ in range(CONFLICT_RETRIES):
            deployment = await self.api.read_object(deployment_path(namespace, name))
            meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
            now = spec.get("replicas", 1)
            target = replicas(int(now)) if isinstance(now, int) else None
            if target is None or target == now:
                return None
            try:
                await self.api.scale_deployment(namespace, name, target, str(meta.get("resourceVersion", "")))
            except ApiError as exc:
                if exc.status == 409:
                    continue
                raise
            return target
        return None

    async def set_hpa_max(self, namespace: str, name: str,
                          max_replicas: Callable[[int, int], int | None]) -> int | None:
        """Set the HPA's maxReplicas to `max_replicas(now, its minReplicas)` (None: leave it)."""
        for _ in range(CONFLICT_RETRIES):
            hpa = await self.api.read_object(autoscalers_path(namespace) + "/" + name)
            meta, spec = hpa.get("metadata") or {}, hpa.get("spec") or {}
            now, low = spec.get("maxReplicas"), spec.get("minReplicas", 1)
            if not isinstance(now, int) or not isinstance(low, int):
                return None
            target = max_replicas(now, low)
            if target is None or target == now:
                return None
            try:
                await self.api.set_autoscaler_max(namespace, name, target, str(meta.get("resourceVersion", "")))
            except ApiError as exc:
                if exc.status == 409:
                    continue
                raise
            return target
        return None

    def event(self, namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
        self.recorder.record_object(DEPLOYMENT, namespace, name, uid, kind, reason, message)

    # ---- giving back --------------------------------------------------------------------------------
    async def give_back(self, plan: PodPlan, node: str, back: GiveBack, deployment_uid: str) -> bool:
        """Carry `back` out for `plan` (nominated on `node`, the loans marked as evicted for it). False when
        it failed: the loans are spared and the nomination ended (the pod tries again)."""
        try:
            await self.api.set_nominated_node(plan.namespace, plan.name, node)
        except ApiError as exc:
            if exc.status == 404:
                self._abort(plan, back, "the pod is gone")
                return False
            log.warning("pod %s: setting nominatedNodeName failed (%s); giving back anyway", plan.key, exc)
        try:
            for loan in back.loans:
                try:
                    await self.api.set_deletion_cost(loan.namespace, loan.name, loan.uid, LOWEST_COST)
                except ApiError as exc:
                    if exc.status not in (404, 422):  # gone already (or replaced): nothing to mark
                        raise
            if back.hpa is not None:
                await self.set_hpa_max(back.namespace, back.hpa, lambda _now, low: max(back.keep, low))
            await self.scale(back.namespace, back.deployment, lambda now: min(now, back.keep))
        except ApiError as exc:
            self._abort(plan, back, str(exc))
            return False
        names = ", ".join(loan.name for loan in back.loans)
        self.event(back.namespace, back.deployment, deployment_uid, "Normal", "ElasticGaveBack",
                   f"Gave back {len(back.loans)} borrowed replica(s) ({names}) for {plan.key}, which needs their "
                   f"GPUs on {node}; {back.keep} replica(s) stay")
        self.recorder.record(plan.namespace, plan.name, plan.uid, "Normal", "Preempting",
                             f"Taking back {len(back.loans)} borrowed replica(s) of Deployment "
                             f"{back.namespace}/{back.deployment} on node {node}: {names}")
        return True

    def _abort(self, plan: PodPlan, back: GiveBack, why: str) -> None:
        log.warning("pod %s: giving back replicas of %s/%s failed (%s); retrying later", plan.key, back.namespace,
                    back.deployment, why)
        self.state.spare(plan.uid, (loan.uid for loan in back.loans))
        if self.state.end_nomination(plan.uid):
            self.queue.on_event(ClusterEvent.GPU_FREED)
        self.queue.retry(plan.uid)
