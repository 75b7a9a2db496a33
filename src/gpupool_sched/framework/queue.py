"""The scheduling queue: kube-scheduler's activeQ, backoffQ and unschedulable pods, for one event loop.

Every pending pod of ours waits in exactly one of three sets, keyed by its UID:

    active         ready to be tried: popped by priority, then creation time, then UID
    backoff        failed recently (bind error, or retried after being unschedulable): waits
                   initial_backoff_s * 2^(attempts-1), at most max_backoff_s, then goes active
    unschedulable  no node fits: waits for a cluster event that could change that (its hints), an
                   update of the pod, or the safety-net flush after unschedulable_flush_s

A popped pod is *in flight* until the cycle hands it back with exactly one of `park` (unschedulable),
`backoff` (retry later) or `done` (bound or dropped), or it is deleted. What happens meanwhile is
kept: an update of the pod replaces its payload, and cluster events are recorded, so that a pod found
unschedulable just after the event that would have made it fit goes to backoff instead of waiting for
the next such event (kube-scheduler's in-flight events). Heaps with lazy deletion keep every operation
O(log n); everything runs on one thread, so there are no locks. The hints: cache/events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpupool_sched.cache.events import ClusterEvent as ClusterEvent
from gpupool_sched.cache.events import Hint as Hint
from gpupool_sched.cache.events import QuotaFreed as QuotaFreed

ACTIVE, BACKOFF, UNSCHEDULABLE = "active", "backoff", "unschedulable"
_COMPACT_MIN = 1024  # stale heap entries tolerated before a rebuild (also at most the live count)


@dataclass(slots=True)
class QueuedPod:
    """A pending pod as the queue orders it; `payload` is the caller's (the queue never looks inside)."""

    uid: str
    key: str  # namespace/name, for logs
    priority: int
    created: float
    payload: Any = None
    attempts: int = 0  # times popped; drives the backoff
    # what decides the pod's schedulability (e.g. a hash of its spec); an update with an equal revision
    # is not a change of the pod (None: every update is one)
    revision: Hashable | None = None
    first_seen: float | None = None  # queue clock when first added (scheduling latency)


@dataclass(slots=True)
class _Entry:
    pod: QueuedPod
    where: str
    seq: int  # heap items with another seq are stale
    ready_at: float = 0.0  # end of the pod's backoff
    parked_at: float = 0.0
    hints: frozenset[Hint] = frozenset()
    flushable: bool = True


@dataclass(slots=True)
class _Flight:
    pod: QueuedPod
    events: set[Hint] = field(default_factory=set)
    changed: bool = False


def _changed(old: QueuedPod, new: QueuedPod) -> bool:
    return old.revision is None or new.revision is None or old.revision != new.revision


class SchedulingQueue:
    def __init__(
        self,
        *,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 10.0,
        unschedulable_flush_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if initial_backoff_s < 0 or max_backoff_s < initial_backoff_s or unschedulable_flush_s < 0:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s and unschedulable_flush_s >= 0")
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.unschedulable_flush_s = unschedulable_flush_s
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._flight: dict[str, _Flight] = {}
        self._active: list[tuple[int, float, str, int]] = []  # (-priority, created, uid, seq)
        self._backoff: list[tuple[float, int, str]] = []  # (ready_at, seq, uid)
        self._parked: dict[str, None] = {}  # flushable unschedulable pods, oldest parked first
        self._by_hint: dict[Hint, set[str]] = {}
        self._counts: Counter[tuple[str, int]] = Counter()  # (set, priority) -> pods
        self._sizes: Counter[str] = Counter()  # set -> pods
        self._seq = 0
        self._wake = asyncio.Event()

    # ---- the caller's side ---------------------------------------------------------------------
    def add(self, pod: QueuedPod) -> None:
        """A new or updated pending pod. New: active. Updated: takes the new payload; an unschedulable
        pod that changed moves to backoff (still backing off) or active; in flight: kept for its return."""
        now = self.clock()
        flight = self._flight.get(pod.uid)
        if flight is not None:
            _inherit(pod, flight.pod)
            flight.changed |= _changed(flight.pod, pod)
            flight.pod = pod
            return
        entry = self._entries.get(pod.uid)
        if entry is None:
            if pod.first_seen is None:
                pod.first_seen = now
            self._entries[pod.uid] = entry = _Entry(pod, ACTIVE, 0)
            self._enter(entry, ACTIVE, now)
            return
        _inherit(pod, entry.pod)
        changed = _changed(entry.pod, pod)
        if entry.where == ACTIVE and (pod.priority, pod.created) != (entry.pod.priority, entry.pod.created):
            self._leave(entry)
            entry.pod = pod
            self._enter(entry, ACTIVE, now)
        elif entry.where == UNSCHEDULABLE and changed:
            self._leave(entry)
            entry.pod = pod
            self._requeue(entry, now)
        else:
            self._counts[(entry.where, entry.pod.priority)] -= 1
            self._counts[(entry.where, pod.priority)] += 1
            entry.pod = pod  # active with the same order, or backing off: only the payload changes

    def pop(self) -> QueuedPod | None:
        """The next pod to schedule (it is then in flight), or None. Expired backoffs count as active."""
        self._flush_backoff(self.clock())
        while self._active:
            _, _, uid, seq = heapq.heappop(self._active)
            entry = self._entries.get(uid)
            if entry is None or entry.seq != seq or entry.where != ACTIVE:
                continue
            self._leave(entry)
            del self._entries[uid]
            entry.pod.attempts += 1
            self._flight[uid] = _Flight(entry.pod)
            return entry.pod
        return None

    def take(self, uid: str) -> QueuedPod | None:
        """The waiting pod `uid` (from any set), now in flight as if popped: a gang's members are
        decided with the member that was popped. None when it is not waiting (in flight, or unknown)."""
        entry = self._entries.get(uid)
        if entry is None:
            return None
        self._leave(entry)
        del self._entries[uid]
        entry.pod.attempts += 1
        self._flight[uid] = _Flight(entry.pod)
        return entry.pod

    async def wait(self, timeout: float) -> None:
        """Until a pod may be poppable (one became active, or the earliest backoff expires) or `timeout`."""
        if self._sizes[ACTIVE]:
            return
        delay = timeout
        ready = self._next_ready()
        if ready is not None:
            delay = min(delay, max(0.0, ready - self.clock()))
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=delay)

    def delete(self, uid: str) -> None:
        """The pod is gone, bound (by anyone) or no longer ours: forget it, in flight or waiting."""
        self._flight.pop(uid, None)
        entry = self._entries.pop(uid, None)
        if entry is not None:
            self._leave(entry)

    def park(self, pod: QueuedPod, hints: Collection[Hint], *, flush: bool = True) -> None:
        """The popped `pod` fits no node: wait for one of `hints` (empty: only for a change of the pod
        and, with `flush`, the safety-net flush). If the pod changed or one of `hints` happened while it
        was in flight, it goes to backoff instead. Ignored unless `pod` is in flight (deleted meanwhile)."""
        flight = self._flight.pop(pod.uid, None)
        if flight is None:
            return
        now = self.clock()
        entry = _Entry(flight.pod, UNSCHEDULABLE, 0, ready_at=now + self.backoff_s(flight.pod.attempts))
        self._entries[pod.uid] = entry
        if flight.changed or flight.events.intersection(hints):
            self._requeue(entry, now)
            return
        entry.parked_at = now
        entry.hints = frozenset(hints)
        entry.flushable = flush
        self._enter(entry, UNSCHEDULABLE, now)

    def backoff(self, pod: QueuedPod) -> None:
        """The popped `pod` failed for a passing reason (bind error, conflict): retry after its backoff.
        Ignored unless `pod` is in flight."""
        flight = self._flight.pop(pod.uid, None)
        if flight is None:
            return
        now = self.clock()
        entry = _Entry(flight.pod, BACKOFF, 0, ready_at=now + self.backoff_s(flight.pod.attempts))
        self._entries[pod.uid] = entry
        self._requeue(entry, now)

    def retry(self, uid: str) -> None:
        """A parked pod gets another try after its backoff (kube-scheduler's Activate, with backoff):
        e.g. its preemption failed. In flight: it is requeued rather than parked when it returns."""
        flight = self._flight.get(uid)
        if flight is not None:
            flight.changed = True
            return
        entry = self._entries.get(uid)
        if entry is None or entry.where != UNSCHEDULABLE:
            return
        self._leave(entry)
        self._requeue(entry, self.clock())

    def done(self, uid: str) -> None:
        """The popped pod needs no more scheduling (bound, or handed elsewhere)."""
        self._flight.pop(uid, None)

    def on_event(self, event: Hint) -> int:
        """Unschedulable pods waiting for `event` go to backoff or active; returns how many moved."""
        for flight in self._flight.values():
            flight.events.add(event)
        uids = self._by_hint.pop(event, set())
        now = self.clock()
        for uid in uids:
            entry = self._entries[uid]
            self._leave(entry)
            self._requeue(entry, now)
        return len(uids)

    def flush(self) -> int:
        """Expired backoffs go active; pods unschedulable for longer than unschedulable_flush_s go to
        backoff or active (kube-scheduler's flushUnschedulablePodsLeftover). Returns how many moved."""
        now = self.clock()
        moved = self._flush_backoff(now)
        cutoff = now - self.unschedulable_flush_s
        while self._parked:
            entry = self._entries[next(iter(self._parked))]
            if entry.parked_at > cutoff:
                break
            self._leave(entry)
            self._requeue(entry, now)
            moved += 1
        return moved

    def backoff_s(self, attempts: int) -> float:
        """kube-scheduler's backoff: initial * 2^(attempts-1), capped."""
        exponent = min(max(attempts, 1) - 1, 64)
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0**exponent)

    # ---- views ---------------------------------------------------------------------------------
    def __contains__(self, uid: object) -> bool:
        """Waiting in one of the three sets, or in flight."""
        return uid in self._entries or uid in self._flight

    def __len__(self) -> int:
        """Pods waiting (in flight not counted)."""
        return len(self._entries)

    def uids(self) -> Iterator[str]:
        """The pods waiting or in flight (no order)."""
        yield from self._entries
        yield from self._flight

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def where(self, uid: str) -> str | None:
        """active, backoff, unschedulable, in-flight, or None."""
        entry = self._entries.get(uid)
        if entry is not None:
            return entry.where
        return "in-flight" if uid in self._flight else None

    def lengths_by_priority(self) -> dict[int, int]:
        """Waiting pods per priority."""
        out: Counter[int] = Counter()
        for (_, priority), n in self._counts.items():
            out[priority] += n
        return {p: n for p, n in sorted(out.items()) if n}

    def lengths(self) -> dict[tuple[str, int], int]:
        """Waiting pods per (set, priority)."""
        return {k: n for k, n in sorted(self._counts.items()) if n}

    def oldest_created_by_priority(self) -> dict[int, float]:
        """Per priority, the earliest `created` of the pods waiting or in flight (pods with no creation
        time, `created` <= 0, are left out). O(pods): for the metrics, not the hot path."""
        oldest: dict[int, float] = {}
        pods = [e.pod for e in self._entries.values()] + [f.pod for f in self._flight.values()]
        for pod in pods:
            if pod.created > 0 and pod.created < oldest.get(pod.priority, float("inf")):
                oldest[pod.priority] = pod.created
        return oldest

    def pending_counts(self) -> dict[str, int]:
        """Waiting pods per set: active, backoff, unschedulable."""
        return {where: self._sizes[where] for where in (ACTIVE, BACKOFF, UNSCHEDULABLE)}

    # ---- internals -----------------------------------------------------------------------------
    def _enter(self, entry: _Entry, where: str, now: float) -> None:
        self._seq += 1
        entry.seq, entry.where = self._seq, where
        uid = entry.pod.uid
        if where == ACTIVE:
            heapq.heappush(self._active, (-entry.pod.priority, entry.pod.created, uid, entry.seq))
            self._compact_if_needed(self._active)
            self._wake.set()
        elif where == BACKOFF:
            heapq.heappush(self._backoff, (entry.ready_at, entry.seq, uid))
            self._compact_if_needed(self._backoff)
        else:
            for hint in entry.hints:
                self._by_hint.setdefault(hint, set()).add(uid)
            if entry.flushable:
                self._parked[uid] = None
        self._counts[(where, entry.pod.priority)] += 1
        self._sizes[where] += 1

    def _leave(self, entry: _Entry) -> None:
        """Take the entry out of its set (heap items go stale through the seq)."""
        uid = entry.pod.uid
        if entry.where == UNSCHEDULABLE:
            for hint in entry.hints:
                waiting = self._by_hint.get(hint)
                if waiting is not None:
                    waiting.discard(uid)
            self._parked.pop(uid, None)
        key = (entry.where, entry.pod.priority)
        self._counts[key] -= 1
        if not self._counts[key]:
            del self._counts[key]
        self._sizes[entry.where] -= 1
        entry.seq = -1

    def _requeue(self, entry: _Entry, now: float) -> None:
        entry.hints = frozenset()
        self._enter(entry, BACKOFF if entry.ready_at > now else ACTIVE, now)

    def _flush_backoff(self, now: float) -> int:
        moved = 0
        while self._backoff and self._backoff[0][0] <= now:
            _, seq, uid = heapq.heappop(self._backoff)
            entry = self._entries.get(uid)
            if entry is None or entry.seq != seq or entry.where != BACKOFF:
                continue
            self._leave(entry)
            self._enter(entry, ACTIVE, now)
            moved += 1
        return moved

    def _next_ready(self) -> float | None:
        while self._backoff:
            ready, seq, uid = self._backoff[0]
            entry = self._entries.get(uid)
            if entry is not None and entry.seq == seq and entry.where == BACKOFF:
                return ready
            heapq.heappop(self._backoff)
        return None

    def _compact_if_needed(self, heap: list[Any]) -> None:
        """Drop stale items once they outnumber the live ones (and _COMPACT_MIN)."""
        live = self._sizes[ACTIVE if heap is self._active else BACKOFF]
        if len(heap) - live <= max(_COMPACT_MIN, live):
            return
        if heap is self._active:
            heap[:] = [item for item in heap if self._live(item[2], item[3], ACTIVE)]
        else:
            heap[:] = [item for item in heap if self._live(item[2], item[1], BACKOFF)]
        heapq.heapify(heap)

    def _live(self, uid: str, seq: int, where: str) -> bool:
        entry = self._entries.get(uid)
        return entry is not None and entry.seq == seq and entry.where == where


def _inherit(new: QueuedPod, old: QueuedPod) -> None:
    """An update keeps the queue's own bookkeeping of the pod."""
    new.attempts = old.attempts
    new.first_seen = old.first_seen
