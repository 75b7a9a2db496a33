"""Events and PodScheduled conditions, written off the scheduling path.

Reports go into a bounded queue drained by a few workers, as kube-scheduler's event broadcaster
does: a burst of thousands of binds must not queue thousands of API calls in front of the next
Binding, and when the queue is full a report is dropped and counted rather than held in memory.
Scheduling never waits on a report.

A pod that stays unschedulable is tried again whenever the cluster changes in a way that could
help it, and each try ends in the same report. As client-go's event correlator does, a report
identical to one made for the same object within `series_window_s` joins the earlier Event: its
`count` and `lastTimestamp` are updated, at most once per `series_refresh_s`, instead of a new
Event being posted each time (`kubectl describe` then shows "x12 over 5m").

With `keep_scheduled` (`gpupool scheduler --scheduled-events all`), a Scheduled Event that finds its queue
full (half full: the other half stays for every other report) is not dropped: it waits in a backlog of
its own, at the lowest priority, and moves into the queues as they empty: every bound pod gets its Event,
late under a burst (the backlog costs ~0.5 KiB a pod).

A write that fails for want of an answer (no connection, a 5xx, 429: the API server restarting or
overloaded) is tried again every `retry_s`, up to `max_tries` times, as client-go's broadcaster does
(12 tries, 10 s apart): a pod reported unschedulable during an outage is still told once it ends. A
condition is written again only while the pod still waits (`waiting`), never over a later Binding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpupool_sched.kube.kubeapi import MAX_MESSAGE, ApiError, KubeApi
from gpupool_sched.metrics import SchedulerMetrics

log = logging.getLogger(__name__)

SERIES_WINDOW_S = 360.0  # client-go: an isomorphic event within 6 minutes joins the series
SERIES_REFRESH_S = 60.0
RETRY_S = 5.0
MAX_TRIES = 12
SERIES_CAPACITY = 20_000  # objects whose last report is remembered (least recently reported dropped)
MAX_NAME = 253


def says_unschedulable(pod: Mapping[str, Any], message: str) -> bool:
    """The pod's PodScheduled condition already is False / Unschedulable with this message."""
    for c in (pod.get("status") or {}).get("conditions") or ():
        if c.get("type") == "PodScheduled":
            return bool(c.get("status") == "False" and c.get("reason") == "Unschedulable"
                        and c.get("message") == message[:MAX_MESSAGE])
    return False


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
    event: str | None = None  # the Event object's name (None: the API server makes one up)
    count: int = 1  # > 1: update the count of the existing Event `event`
    post: bool = True  # False: the condition only (the Event is current)
    tries: int = 0  # earlier attempts that failed for want of an answer

    @property
    def series_key(self) -> tuple[str, str, str, str]:
        """Reports with the same key are one series: same object, reason and message."""
        return (self.uid, self.reason, self.message, self.involved[1])


@dataclass(slots=True)
class _Series:
    event: str
    count: int
    seen: float  # monotonic: the last identical report
    written: float  # monotonic: the last write of the Event


def _half_full(queue: asyncio.Queue[Report]) -> bool:
    return queue.qsize() >= max(1, queue.maxsize // 2)


class EventRecorder:
    def __init__(self, api: KubeApi, metrics: SchedulerMetrics, *, workers: int = 4, capacity: int = 1000,
                 series_window_s: float = SERIES_WINDOW_S, series_refresh_s: float = SERIES_REFRESH_S,
                 retry_s: float = RETRY_S, max_tries: int = MAX_TRIES,
                 waiting: Callable[[str], bool] | None = None, keep_scheduled: bool = False) -> None:
        if workers < 1 or capacity < 1:
            raise ValueError("need at least one worker and room for one report")
        self.api = api
        self.metrics = metrics
        self.workers = workers
        self.series_window_s = series_window_s
        self.series_refresh_s = series_refresh_s
        self.retry_s = retry_s
        self.max_tries = max_tries
        self.waiting = waiting  # UID -> the pod still waits to be scheduled (its condition may be written)
        self._retries: set[asyncio.TimerHandle] = set()
        # one queue per worker, chosen by the object's UID: one pod's reports are written in the order
        # they were made (a later condition is never overwritten by an earlier one still in flight)
        room = max(1, capacity // workers)
        self._queues: list[asyncio.Queue[Report]] = [asyncio.Queue(maxsize=room) for _ in range(workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._series: OrderedDict[tuple[str, str, str, str], _Series] = OrderedDict()
        self.keep_scheduled = keep_scheduled
        self._backlog: deque[Report] = deque()  # Scheduled reports the full queues could not take (keep_scheduled)
        self._moved = 0  # reports moved from the backlog into the queues

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work(q), name=f"events-{i}") for i, q in enumerate(self._queues)]

    async def stop(self, flush_s: float = 2.0) -> None:
        """Post what is queued (for at most `flush_s`), then stop."""
        if self._tasks and self.queued:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), timeout=flush_s)
        for handle in self._retries:
            handle.cancel()
        self._retries.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @property
    def queued(self) -> int:
        return sum(q.qsize() for q in self._queues) + len(self._backlog)

    async def flush(self) -> None:
        """Until every report queued so far is written (or failed), the backlog included."""
        while True:
            moved = self._moved
            await asyncio.gather(*(q.join() for q in self._queues))
            if self._backlog:
                self._refill()
            elif self._moved == moved:  # nothing came out of the backlog while the queues drained
                return

    def scheduled(self, namespace: str, name: str, uid: str, node: str) -> None:
        self._put(Report(namespace, name, uid, "Normal", "Scheduled",
                         f"Successfully assigned {namespace}/{name} to {node}"))

    def unschedulable(self, namespace: str, name: str, uid: str, message: str, *, condition: bool = True) -> None:
        """A FailedScheduling Event and PodScheduled=False with reason Unschedulable (`condition`
        False: the pod's condition already says so, as kube-scheduler skips an unchanged one)."""
        self._put(Report(namespace, name, uid, "Warning", "FailedScheduling", message, unschedulable=condition))

    def record(self, namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
        """Any other Event on a pod (preemption's Preempting, Preempted, PreemptionFailed)."""
        self._put(Report(namespace, name, uid, kind, reason, message))

    def record_object(self, involved: tuple[str, str], namespace: str, name: str, uid: str, kind: str, reason: str,
                      message: str) -> None:
        """An Event on another namespaced object (`involved`: apiVersion, kind), e.g. a PodGroup."""
        self._put(Report(namespace, name, uid, kind, reason, message, involved=involved))

    def _put(self, report: Report) -> None:
        if report.kind != "Warning":  # Scheduled, Preempting: once per pod, never a series
            self._enqueue(report)
            return
        key = report.series_key
        now = time.monotonic()
        series = self._series.get(key)
        if series is not None and now - series.seen < self.series_window_s:
            series.count += 1
            series.seen = now
            self._series.move_to_end(key)
            if now - series.written < self.series_refresh_s:
                self.metrics.events.labels(reason=report.reason, outcome="aggregated").inc()
                if report.unschedulable:  # the Event is current enough; the condition is not
                    self._enqueue(replace(report, post=False))
                return
            if self._enqueue(replace(report, event=series.event, count=series.count)):
                series.written = now
            return
        event = f"{report.name[:MAX_NAME - 17]}.{time.time_ns():x}"  # as client-go names them
        if self._enqueue(replace(report, event=event)):
            self._series[key] = _Series(event, 1, now, now)
            self._series.move_to_end(key)
            while len(self._series) > SERIES_CAPACITY:
                self._series.popitem(last=False)

    def _enqueue(self, report: Report) -> bool:
        queue = self._queues[hash(report.uid) % len(self._queues)]
        if self.keep_scheduled and report.reason == "Scheduled" and (self._backlog or _half_full(queue)):
            self._backlog.append(report)  # lowest priority: the other half of the queue stays for the rest
            return True
        try:
            queue.put_nowait(report)
            return True
        except asyncio.QueueFull:
            self.metrics.events.labels(reason=report.reason, outcome="dropped").inc()
            log.debug("event queue full; dropped %s on %s/%s", report.reason, report.namespace, report.name)
            return False

    def _refill(self) -> None:
        """Backlogged Scheduled reports into the queues, while they have room (lowest priority: only then)."""
        while self._backlog:
            queue = self._queues[hash(self._backlog[0].uid) % len(self._queues)]
            if _half_full(queue):
                return
            queue.put_nowait(self._backlog.popleft())
            self._moved += 1

    async def _work(self, queue: asyncio.Queue[Report]) -> None:
        while True:
            report = await queue.get()
            try:
                await self._post(report)
            except Exception:  # a report never stops the worker
                log.exception("posting %s on %s/%s failed", report.reason, report.namespace, report.name)
            finally:
                queue.task_done()
                if self._backlog:
                    self._refill()

    async def _post(self, r: Report) -> None:
        posted = await self._write_event(r) if r.post else True
        conditioned = True
        if r.unschedulable and (self.waiting is None or self.waiting(r.uid)):
            try:
                await self.api.set_unschedulable(r.namespace, r.name, r.message)
            except ApiError as exc:
                conditioned = not _retryable(exc)
                if conditioned and exc.status != 404:
                    log.warning("pod %s/%s: setting PodScheduled=False failed: %s", r.namespace, r.name, exc)
        if posted and conditioned:
            return
        if r.tries + 1 >= self.max_tries:
            log.warning("%s on %s/%s: given up after %d tries", r.reason, r.namespace, r.name, r.tries + 1)
            return
        again = replace(r, tries=r.tries + 1, post=r.post and not posted,
                        unschedulable=r.unschedulable and not conditioned)
        self.metrics.events.labels(reason=r.reason, outcome="retried").inc()
        handle: asyncio.TimerHandle | None = None

        def due() -> None:
            if handle is not None:
                self._retries.discard(handle)
            self._enqueue(again)

        handle = asyncio.get_running_loop().call_later(self.retry_s, due)
        self._retries.add(handle)

    async def _write_event(self, r: Report) -> bool:
        """False when it failed for want of an answer (worth another try)."""
        try:
            if r.count > 1 and r.event:
                await self.api.update_event_count(r.namespace, r.event, r.count)
                self.metrics.events.labels(reason=r.reason, outcome="updated").inc()
            else:
                await self.api.post_event({"namespace": r.namespace, "name": r.name, "uid": r.uid}, kind=r.kind,
                                          reason=r.reason, message=r.message, involved=r.involved, event=r.event)
                self.metrics.events.labels(reason=r.reason, outcome="posted").inc()
        except ApiError as exc:
            if exc.status == 409 and r.tries:  # an earlier try landed after all (its answer was lost)
                return True
            self.metrics.events.labels(reason=r.reason, outcome="failed").inc()
            if r.count > 1 and exc.status == 404:  # the Event expired (the API server's TTL): start anew
                series = self._series.get(r.series_key)
                if series is not None and series.event == r.event:
                    del self._series[r.series_key]
            elif _retryable(exc):
                log.info("event %s on %s/%s: no answer (%s); trying again in %.0f s", r.reason, r.namespace,
                         r.name, exc, self.retry_s)
                return False
            elif exc.status not in (404, 403):
                log.warning("event %s on %s/%s failed: %s", r.reason, r.namespace, r.name, exc)
        return True


def _retryable(exc: ApiError) -> bool:
    """No answer, or the API server could not take it now (not a refusal, and not a deposed leader's)."""
    if exc.reason == "NotLeader":
        return False
    return exc.status == 0 or exc.status >= 500 or exc.status == 429
