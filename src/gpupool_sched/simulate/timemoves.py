"""The time simulator's migrations (`--defrag on`): the consolidate action as the scheduler service runs it,
for the timeline (simulate/timeline.py) whose part this is.

Who may move and when is the service's own plugin, `framework.plugins.movers.Movers`, on the simulator's
clock: a lone pod waits `after_s` before pods move for it (before that the action only looks, and a move
it finds holds preemption back, `Movers.offer`), the hourly budget (1 % of the running GPU pods, at least
1, recounted every `BUDGET_REFRESH_S`), the cooldowns, `min_runtime_s`, no gang members, only pods that
hold GPUs; at most one migration per node at a time (`ClusterState.migrating_nodes`). What the API would
tell the plugin the simulator knows: every trace pod is owned by a ReplicaSet of its own
(`ReplicaSet/sim/<trace pod name>`), so every trace pod is movable, and a pod's start time is its
simulated start on a wall clock that reads `EPOCH` at simulated time 0.

A migration is carried out as in the cluster, at one instant: the cycle's statement nominated the blocked
pod where its movers leave and reserved each mover's destination; the movers leave through the watch's
deletion path (what they held becomes holds for the blocked pod), the blocked pod is scheduled again and
takes the room, and each mover's replacement (a new pod of the same ReplicaSet: same request, same
priority, the mover's remaining lifetime) is scheduled through the normal cycle, which finds its
reservation by owner and request (`ClusterState.reservation_for`). A replacement that does not land where
reserved is counted (`TimeStats.misplaced`) and waits like any pod. A pod is retried when its wait
reaches `after_s` (the service's `Defrag.wait`), when a cooldown or the spent budget lets a move happen
again (`Defrag.held_back`), and, while the budget has moves left, when a departure frees GPUs: the
service wakes every unschedulable pod then; here one waiting pod per departure is tried, and only for
the consolidate action (allocate and preempt are retried by count, see timeline.py), which bounds the
simulator's cost."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpupool_sched.cache.reservations import reservation_uid
from gpupool_sched.framework.cycle import CycleResult
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.movers import BUDGET_REFRESH_S, Movers, Offer
from gpupool_sched.framework.session import drive
from gpupool_sched.placement.preemption import RunningPod

if TYPE_CHECKING:
    from gpupool_sched.simulate.timeline import Job, Timeline

EPOCH = 1_700_000_000.0  # wall-clock seconds at simulated time 0 (pods' start times must be positive)
# a pod a departure woke is tried again after its back-off, at most this (the service queue's max_backoff_s)
WOKEN_RETRY_S = 10.0


def owner_of(namespace: str, name: str) -> str:
    """The controller every attempt of the trace pod `name` has: a ReplicaSet of its own (movable, and its
    replacement is recognised by it)."""
    return f"ReplicaSet/{namespace}/{name}"


class Moves:
    def __init__(self, timeline: Timeline, config: DefragConfig) -> None:
        self.timeline = timeline
        self.movers = Movers(timeline.state, timeline.budgets, config, clock=lambda: timeline.now,
                             wall=lambda: EPOCH + timeline.now)
        self.refreshed = float("-inf")
        self.due: dict[str, float] = {}  # waiting pod UID -> when it is tried again (the service's Defrag.due)
        self.woken: dict[str, float] = {}  # waiting pod UID -> when a departure last had it tried for a move

    def offer(self, job: Job) -> Offer:
        """What may move for `job` now (the budget's base recounted as the service's housekeeping does)."""
        now = self.timeline.now
        if self.movers.config.per_hour is None and now - self.refreshed >= BUDGET_REFRESH_S:
            self.movers.refresh()
            self.refreshed = now
        return self.movers.offer(now - job.since, job.plan.priority)

    def decide(self, job: Job, running: Callable[[], list[RunningPod]] | None) -> tuple[CycleResult, Offer]:
        """One cycle for `job` with the movers the plugin offers it now (the service's `Cycle.decide`)."""
        offer = self.offer(job)
        return self._decide(job, running, offer), offer

    def _decide(self, job: Job, running: Callable[[], list[RunningPod]] | None, offer: Offer) -> CycleResult:
        result = drive(self.timeline.cycle.decide([job.plan], 1, gang=False, running=running,
                                                  movable=offer.candidates, max_movers=offer.most,
                                                  moves_later=offer.later))
        assert isinstance(result, CycleResult)
        return result

    def not_placed(self, job: Job, result: CycleResult, offer: Offer) -> bool:
        """`job` was not placed and nothing was preempted for it: a migration to carry out (True when the
        job runs after it), or when to try it again (the service's `Defrag.wait` / `Defrag.held_back`)."""
        if result.migration is not None:
            return self._migrate(job, result)
        movers = self.movers
        if result.deferred is not None or ((offer.candidates is None or offer.later) and offer.why_not is None):
            self._due(job, movers.wait_over_at(job.since, job.plan.priority), first=True)
        elif result.preemption is None:
            self._due(job, movers.held_until(), first=False)
        return False

    def _due(self, job: Job, at: float | None, *, first: bool) -> None:
        t = self.timeline
        if at is None or at <= t.now:
            return
        uid = job.plan.uid
        held = self.due.get(uid)
        if held is not None and (first or held <= at):
            return
        self.due[uid] = at
        t.call_at(at, lambda: self._wake(job, at))

    def _wake(self, job: Job, at: float) -> None:
        uid = job.plan.uid
        if self.due.get(uid) != at:
            return  # superseded by an earlier retry
        del self.due[uid]
        if job.queued:
            self.timeline.retry_job(job)

    def freed(self) -> None:
        """A departure freed GPUs: while the budget has moves left, one waiting pod past `after_s` (a group's
        head, most important first, then the longest waiting, not tried this way within `WOKEN_RETRY_S`) is
        tried for a migration."""
        t = self.timeline
        if not t.queue_len or self.movers.budget_left() <= 0:
            return
        now, after = t.now, self.movers.config.after_s
        if len(self.woken) > 4 * t.queue_len + 64:
            self.woken = {uid: at for uid, at in self.woken.items() if now - at < WOKEN_RETRY_S}
        heads = [j for group in t.groups.values() if now - (j := next(iter(group.values()))).since >= after
                 and now - self.woken.get(j.plan.uid, float("-inf")) >= WOKEN_RETRY_S]
        if not heads:
            return
        head = min(heads, key=lambda j: (-j.plan.priority, j.seq))
        self.woken[head.plan.uid] = now
        offer = self.offer(head)
        if offer.candidates is None:
            return  # the budget is spent (or pods may not move now)
        result = self._decide(head, None, offer)
        t.stats.cycle_seconds += result.seconds
        placed = result.statement is not None and bool(result.statement.placements)
        if not placed and result.migration is None:
            return
        t.dequeue_job(head)
        if placed:
            assert result.statement is not None
            t.placed_job(head, result.statement.placements[0][1])
        elif not self._migrate(head, result):
            t.enqueue_back(head)

    def _expire(self, node: str) -> None:
        if self.timeline.state.expire_reservations():
            self.timeline.retry_node(node)

    def _migrate(self, job: Job, result: CycleResult) -> bool:
        """Carry out the migration the cycle committed for `job`; True when `job` runs after it."""
        t = self.timeline
        migration = result.migration
        assert migration is not None
        movers = [t.jobs[m.pod.uid] for m in migration.moves]
        self.movers.carried_out(m.plan.uid for m in movers)
        t.stats.migrations += len(movers)
        t.stats.migrated_for += 1
        t.record_migration(job, migration.node, [(m, move.destination) for m, move in
                                                  zip(movers, migration.moves, strict=True)])
        remaining = [m.end - t.now for m in movers]
        placed = t.evict_and_take(job, movers)  # the movers' room becomes holds for the blocked pod, taken now
        for mover, move, left in zip(movers, migration.moves, remaining, strict=True):
            # its ReplicaSet's replacement: same request and priority, the rest of the mover's lifetime
            redo = t.new_job(dataclasses.replace(mover.pod, lifetime_s=left), t.now, moved=True)
            ran = t.try_job(redo)
            entry = t.state.pods.get(redo.plan.uid)
            if not ran or entry is None or entry.node != move.destination.node:
                t.stats.misplaced += 1
            if not ran:
                t.enqueue_job(redo)
                held = t.state.reservations.get(reservation_uid(mover.plan.uid))
                if held is not None:  # the service's housekeeping ends it at its deadline
                    t.call_at(held.deadline, functools.partial(self._expire, move.destination.node))
        t.retry_node(migration.node)
        return placed
