"""Events and PodScheduled conditions, written off the scheduling path.

Reports go into a bounded queue drained by a few workers, as kube-scheduler's event broadcaster
does: a burst of thousands of binds must not queue thousands of API calls in front of the next
Binding (the API client's threads are shared), and when the queue is full a report is dropped and
counted rather than held in memory. Scheduling never waits on a report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from gpupool_sched.scheduler.kubeapi import ApiError, KubeApi
from gpupool_sched.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Report:
    namespace: str
    name: str
    uid: str
    kind: str  # Normal | Warning
    reason: str
    message: str
    unschedulable: bool = False  # also set PodScheduled=False, reason Unschedulable
    involved: tuple[str, str] = ("v1", "Pod")  # apiVersion, kind of the object


class EventRecorder:
    def __init__(self, api: KubeApi, metrics: SchedulerMetrics, *, workers: int = 4, capacity: int = 1000) -> None:
        if workers < 1 or capacity < 1:
            raise ValueError("need at least one worker and room for one report")
        self.api = api
        self.metrics = metrics
        self.workers = workers
        self._queue: asyncio.Queue[Report] = asyncio.Queue(maxsize=capacity)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work(), name=f"events-{i}") for i in range(self.workers)]

    async def stop(self, flush_s: float = 2.0) -> None:
        """Post what is queued (for at most `flush_s`), then stop."""
        if self._tasks and not self._queue.empty():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), timeout=flush_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def scheduled(self, namespace: str, name: str, uid: str, node: str) -> None:
        self._put(Report(namespace, name, uid, "Normal", "Scheduled",
                         f"Successfully assigned {namespace}/{name} to {node}"))

    def unschedulable(self, namespace: str, name: str, uid: str, message: str) -> None:
        """A FailedScheduling Event and PodScheduled=False with reason Unschedulable."""
        self._put(Report(namespace, name, uid, "Warning", "FailedScheduling", message, unschedulable=True))

    def record(self, namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
        """Any other Event on a pod (preemption's Preempting, Preempted, PreemptionFailed)."""
        self._put(Report(namespace, name, uid, kind, reason, message))

    def record_object(self, involved: tuple[str, str], namespace: str, name: str, uid: str, kind: str, reason: str,
                      message: str) -> None:
        """An Event on another namespaced object (`involved`: apiVersion, kind), e.g. a PodGroup."""
        self._put(Report(namespace, name, uid, kind, reason, message, involved=involved))

    def _put(self, report: Report) -> None:
        try:
            self._queue.put_nowait(report)
        except asyncio.QueueFull:
            self.metrics.events.labels(reason=report.reason, outcome="dropped").inc()
            log.debug("event queue full; dropped %s on %s/%s", report.reason, report.namespace, report.name)

    async def _work(self) -> None:
        while True:
            report = await self._queue.get()
            try:
                await self._post(report)
            except Exception:  # a report never stops the worker
                log.exception("posting %s on %s/%s failed", report.reason, report.namespace, report.name)
            finally:
                self._queue.task_done()

    async def _post(self, r: Report) -> None:
        try:
            await self.api.post_event({"namespace": r.namespace, "name": r.name, "uid": r.uid},
                                      kind=r.kind, reason=r.reason, message=r.message, involved=r.involved)
            self.metrics.events.labels(reason=r.reason, outcome="posted").inc()
        except ApiError as exc:
            self.metrics.events.labels(reason=r.reason, outcome="failed").inc()
            if exc.status not in (404, 403):
                log.warning("event %s on %s/%s failed: %s", r.reason, r.namespace, r.name, exc)
        if not r.unschedulable:
            return
        try:
            await self.api.set_unschedulable(r.namespace, r.name, r.message)
        except ApiError as exc:
            if exc.status != 404:
                log.warning("pod %s/%s: setting PodScheduled=False failed: %s", r.namespace, r.name, exc)
