"""Carries out committed statements: one asyncio task per placement, many in flight at once.

Per placement: build the handshake assignment, wait at the node's per-shape gate while an
unacknowledged pod of the same shape is pending there (docs/handshake.md rule 4; only on nodes whose
plugin cannot tell same-shape pods apart by the kubelet's PodResources), take the gate, and
POST the Binding with the assignment in its annotations. On failure the state forgets the pod
and the queue retries it with backoff, or drops it when the pod is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpupool_common.handshake import assignment_annotations
from gpupool_sched.model.decision import Placement
from gpupool_sched.scheduler.assignment import build_assignment
from gpupool_sched.scheduler.kubeapi import ApiError, KubeApi
from gpupool_sched.scheduler.metrics import SchedulerMetrics
from gpupool_sched.scheduler.podspec import PodPlan
from gpupool_sched.scheduler.queue import QueuedPod, SchedulingQueue
from gpupool_sched.scheduler.state import ClusterState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BindOutcome:
    plan: PodPlan
    node: str
    ok: bool
    error: ApiError | None = None


class Binder:
    def __init__(
        self,
        state: ClusterState,
        api: KubeApi,
        queue: SchedulingQueue,
        metrics: SchedulerMetrics,
        *,
        is_leader: Callable[[], bool],
        on_bound: Callable[[BindOutcome, QueuedPod], None] | None = None,
    ) -> None:
        self.state = state
        self.api = api
        self.queue = queue
        self.metrics = metrics
        self.is_leader = is_leader
        self.on_bound = on_bound
        self._tasks: set[asyncio.Task[None]] = set()
        self._gates: dict[str, asyncio.Event] = {}
        state.on_gate_release = self.gate_released

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def gate_released(self, node: str) -> None:
        event = self._gates.pop(node, None)
        if event is not None:
            event.set()

    def submit(self, plan: PodPlan, placement: Placement, item: QueuedPod, popped_at: float) -> None:
        task = asyncio.get_running_loop().create_task(self._bind(plan, placement, item, popped_at))
        self._tasks.add(task)
        self.metrics.binds_in_flight.set(len(self._tasks))
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.metrics.binds_in_flight.set(len(self._tasks))
        if not task.cancelled() and task.exception() is not None:
            log.error("bind task failed", exc_info=task.exception())

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.drain()

    async def bind_one(self, plan: PodPlan, placement: Placement, item: QueuedPod, popped_at: float) -> None:
        """`submit`, in the caller's task: the extender's bind verb answers with its outcome (`on_bound`).
        Cancelled, it forgets the assumed pod, as a cancelled bind task does."""
        await self._bind(plan, placement, item, popped_at)

    async def _bind(self, plan: PodPlan, placement: Placement, item: QueuedPod, popped_at: float) -> None:
        node = placement.node
        spec = self.state.node_spec(node)
        annotations: dict[str, str] = {}
        shapes: frozenset[tuple[str, int]] = frozenset()
        try:
            if spec is None:
                raise ApiError(404, "NodeGone", f"node {node} disappeared before the bind")
            if any(c.gpus or c.memory_units or c.mig for c in plan.containers):
                assignment = build_assignment(plan, placement, spec)
                annotations = assignment_annotations(assignment)
                if self.state.needs_gate(node):
                    shapes = frozenset(assignment.shapes())
                    await self._pass_gate(plan, node, shapes)
            if plan.uid not in self.state.pods:
                return  # deleted while waiting at the gate
            if not self.is_leader():
                raise ApiError(0, "NotLeader", "lost leadership before the bind")
            if shapes:
                self.state.hold_gate(plan.uid, shapes)
            await self.api.bind(plan.namespace, plan.name, plan.uid, node, annotations)
        except ApiError as exc:
            self._failed(plan, node, item, exc)
            return
        except asyncio.CancelledError:
            self.state.forget(plan.uid)
            raise
        self.state.mark_bound(plan.uid)
        now = time.time()
        self.metrics.attempts.labels(result="scheduled").inc()
        self.metrics.attempt_latency.observe(time.monotonic() - popped_at)
        if plan.created:
            self.metrics.e2e_latency.observe(max(0.0, now - plan.created))
        if self.on_bound is not None:
            self.on_bound(BindOutcome(plan, node, True), item)

    async def _pass_gate(self, plan: PodPlan, node: str, shapes: frozenset[tuple[str, int]]) -> None:
        waited = False
        while (blocker := self.state.gate_blocker(plan.uid, node, shapes)) is not None:
            if not waited:
                waited = True
                self.metrics.gate_waits.inc()
                log.debug("pod %s waits for %s on %s (same shape, not yet acknowledged)", plan.key, blocker.key, node)
            event = self._gates.setdefault(node, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=max(0.05, self.state.gate_deadline(blocker)))
            self.metrics.gate_timeouts.set(self.state.gate_timeouts)

    def _failed(self, plan: PodPlan, node: str, item: QueuedPod, exc: ApiError) -> None:
        self.state.forget(plan.uid)
        reason = exc.kind if exc.reason not in ("NodeGone", "NotLeader") else exc.reason
        self.metrics.bind_failures.labels(reason=reason).inc()
        self.metrics.attempts.labels(result="error").inc()
        if self.state.is_gone(plan.uid) or (exc.status == 404 and exc.reason != "NodeGone"):
            self.queue.delete(plan.uid)
            log.info("pod %s: gone before its bind to %s", plan.key, node)
        elif exc.status == 409 and "already assigned" in exc.message:
            self.queue.delete(plan.uid)  # bound by someone else; the watch will account it
            log.info("pod %s: already bound elsewhere", plan.key)
        else:
            log.warning("pod %s: bind to %s failed (%s); retrying with backoff", plan.key, node, exc)
            self.queue.backoff(item)
        if self.on_bound is not None:
            self.on_bound(BindOutcome(plan, node, False, exc), item)
