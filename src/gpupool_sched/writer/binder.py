"""Carries out committed statements: one asyncio task per placement, many in flight at once.

Per placement: build the handshake assignment, wait at the node's per-shape gate while an
unacknowledged pod of the same shape is pending there (docs/handshake.md rule 4; only on nodes whose
plugin cannot tell same-shape pods apart by the kubelet's PodResources), take the gate, and
POST the Binding with the assignment in its annotations.

A failed Binding frees the pod's resources only when the answer is definite (`definitely_unbound`):
a 4xx other than 409, or a write that was never sent (node gone, not the leader). A timeout, a 5xx, a
lost answer or a 409 may hide a Binding that landed: the ledger keeps the pod's devices and `verify`
reads the pod until it is seen bound (kept), unbound (forgotten, retried) or gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpupool_common.handshake import assignment_annotations
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import QueuedPod
from gpupool_sched.kube.assignment import build_assignment
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.migration_record import MOVED_ANNOTATION
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.model.decision import Placement

log = logging.getLogger(__name__)


NOT_SENT = ("NodeGone", "NotLeader")  # reasons of writes that never left this process
VERIFY_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # between reads of a pod whose Binding's outcome is unknown


def definitely_unbound(exc: ApiError) -> bool:
    """Whether a failed Binding certainly did not bind: refused by the API server (4xx but 409, which
    says the pod is bound already), or never sent. Everything else (no answer, 5xx) may have landed."""
    if exc.reason in NOT_SENT:
        return True
    return 400 <= exc.status < 500 and exc.status != 409


@dataclass(frozen=True, slots=True)
class BindOutcome:
    plan: PodPlan
    node: str
    ok: bool
    error: ApiError | None = None


class PodQueue(Protocol):
    """What the Binder tells the queue a pod was popped from (the scheduler's SchedulingQueue): bound
    (`done`), gone (`delete`), or to be tried again after its backoff (`backoff`)."""

    def done(self, uid: str) -> None: ...

    def delete(self, uid: str) -> None: ...

    def backoff(self, pod: QueuedPod) -> None: ...


class NoQueue:
    """No queue of ours (the extender): kube-scheduler keeps the pods and retries them itself."""

    def done(self, uid: str) -> None:
        return None

    def delete(self, uid: str) -> None:
        return None

    def backoff(self, pod: QueuedPod) -> None:
        return None


class Binder:
    def __init__(
        self,
        state: ClusterState,
        api: KubeApi,
        queue: PodQueue | None,
        metrics: SchedulerMetrics,
        *,
        is_leader: Callable[[], bool],
        on_bound: Callable[[BindOutcome, QueuedPod], None] | None = None,
        on_unbound: Callable[[str], None] | None = None,
        on_read: Callable[[dict[str, Any]], object] | None = None,
    ) -> None:
        self.state = state
        self.api = api
        self.queue: PodQueue = queue if queue is not None else NoQueue()
        self.metrics = metrics
        self.is_leader = is_leader
        self.on_bound = on_bound
        self.on_unbound = on_unbound  # a pod read unbound after an unknown outcome, with no queue item at hand
        # a pod read as the watch would show it
        self.on_read: Callable[[dict[str, Any]], object] = on_read or (lambda obj: state.apply_pod(obj))
        self._verifying: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._gates: dict[str, asyncio.Event] = {}
        state.on_gate_release = self.gate_released

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

    async def bind_one(self, plan: PodPlan, placement: Placement, item: QueuedPod, popped_at: float) -> None:
        """`submit`, in the caller's task: the extender's bind verb answers with its outcome (`on_bound`).
        Cancelled, it forgets the assumed pod, as a cancelled bind task does."""
        await self._bind(plan, placement, item, popped_at)

    async def _bind(self, plan: PodPlan, placement: Placement, item: QueuedPod, popped_at: float) -> None:
        node = placement.node
        spec = self.state.node_spec(node)
        annotations: dict[str, str] = {}
        shapes: frozenset[tuple[str, int]] = frozenset()
        sent = False
        try:
            if spec is None:
                raise ApiError(404, "NodeGone", f"node {node} disappeared before the bind")
            if any(c.gpus or c.memory_units or c.mig for c in plan.containers):
                assignment = build_assignment(plan, placement, spec)
                annotations = assignment_annotations(assignment)
                if self.state.needs_gate(node):
                    shapes = frozenset(assignment.shapes())
                    await self._pass_gate(plan, node, shapes)
            mark = self.state.marks.get(plan.uid)
            if mark is not None:  # a migration's replacement: its move outlives this process (gpupool.io/moved)
                annotations = {**annotations, MOVED_ANNOTATION: mark}
            if plan.uid not in self.state.pods:
                return  # deleted while waiting at the gate
            if not self.is_leader():
                raise ApiError(0, "NotLeader", "lost leadership before the bind")
            if shapes:
                self.state.hold_gate(plan.uid, shapes)
            sent = True
            await self.api.bind(plan.namespace, plan.name, plan.uid, node, annotations)
        except ApiError as exc:
            self._failed(plan, node, item, exc)
            return
        except asyncio.CancelledError:
            if sent:  # it may be on the wire: kept until a read says (the extender's timeout)
                self.state.mark_uncertain(plan.uid)
                self.verify(plan.uid, plan.key, plan.namespace, plan.name, node, item)
            else:
                self.state.forget(plan.uid)
            raise
        self._succeeded(plan, node, item, popped_at)

    def _succeeded(self, plan: PodPlan, node: str, item: QueuedPod, popped_at: float) -> None:
        self.state.mark_bound(plan.uid)
        self.state.marks.pop(plan.uid, None)
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
        reason = exc.kind if exc.reason not in NOT_SENT else exc.reason
        self.metrics.bind_failures.labels(reason=reason).inc()
        entry = self.state.pods.get(plan.uid)
        if entry is not None and entry.node == node and entry.phase.value == "confirmed":
            log.info("pod %s: its Binding's answer was lost (%s), but the watch shows it bound to %s", plan.key,
                     exc, node)
            self._succeeded(plan, node, item, time.monotonic())
            return
        if not definitely_unbound(exc) and entry is not None:
            log.warning("pod %s: the outcome of its Binding to %s is unknown (%s); keeping its devices until "
                        "a read of the pod says", plan.key, node, exc)
            self.state.mark_uncertain(plan.uid)
            self.metrics.bind_unknown.inc()
            self.verify(plan.uid, plan.key, plan.namespace, plan.name, node, item)
            if self.on_bound is not None:
                self.on_bound(BindOutcome(plan, node, False, exc), item)
            return
        self.state.forget(plan.uid)
        self.metrics.attempts.labels(result="error").inc()
        if self.state.is_gone(plan.uid) or (exc.status == 404 and exc.reason != "NodeGone"):
            self.queue.delete(plan.uid)
            log.info("pod %s: gone before its bind to %s", plan.key, node)
        else:
            log.warning("pod %s: bind to %s failed (%s); retrying with backoff", plan.key, node, exc)
            self.queue.backoff(item)
        if self.on_bound is not None:
            self.on_bound(BindOutcome(plan, node, False, exc), item)

    # ---- unknown outcomes -------------------------------------------------------------------------
    def verify(self, uid: str, key: str, namespace: str, name: str, node: str, item: QueuedPod | None) -> None:
        """Read the pod until its Binding's outcome is known (a task of its own; once per pod)."""
        if uid in self._verifying:
            return
        self._verifying.add(uid)
        task = asyncio.get_running_loop().create_task(self._verify(uid, key, namespace, name, node, item))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        task.add_done_callback(lambda _: self._verifying.discard(uid))

    async def _verify(self, uid: str, key: str, namespace: str, name: str, node: str,
                      item: QueuedPod | None) -> None:
        attempt = 0
        while True:
            entry = self.state.pods.get(uid)
            if entry is None or not entry.uncertain:
                return  # the watch (or a re-list) settled it meanwhile
            try:
                obj = await self.api.read_pod(namespace, name)
            except ApiError as exc:
                if exc.status != 404:
                    await asyncio.sleep(VERIFY_BACKOFF_S[min(attempt, len(VERIFY_BACKOFF_S) - 1)])
                    attempt += 1
                    continue
                obj = None
            entry = self.state.pods.get(uid)
            if entry is None or not entry.uncertain:
                return
            meta = (obj or {}).get("metadata") or {}
            bound_to = ((obj or {}).get("spec") or {}).get("nodeName")
            if obj is None or meta.get("uid") != uid:
                log.info("pod %s: gone while the outcome of its Binding was unknown", key)
                self.state.forget(uid)
                self.queue.delete(uid)
                self.metrics.bind_verified.labels(outcome="gone").inc()
            elif bound_to:
                log.info("pod %s: read bound to %s (assumed %s); its Binding had landed", key, bound_to, node)
                self.on_read(obj)  # as a watch event: confirmed where the API server says
                self.metrics.bind_verified.labels(outcome="bound" if bound_to == node else "elsewhere").inc()
                self.queue.done(uid)
            else:
                log.info("pod %s: read unbound; its Binding to %s did not land, retrying it", key, node)
                self.state.forget(uid)
                self.metrics.bind_verified.labels(outcome="unbound").inc()
                if item is not None:
                    self.queue.backoff(item)
                elif self.on_unbound is not None:
                    self.on_unbound(uid)
            return
