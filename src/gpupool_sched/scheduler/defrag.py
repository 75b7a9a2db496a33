"""The consolidate action's wiring in the scheduler service: which pods may move and the budgets
(framework/plugins/movers.py), carrying a migration out (writer/migrator.py), trying a blocked pod again
once it has waited long enough for pods to move for it, reservations that expired, and the metrics.

Background consolidation (`--defrag-background`, off by default) runs from the same housekeeping tick
(`background`): only while leading, only while no real pod waits for GPUs (a replacement of a move waits
for its reservation: that is no real pod), and then only in the window (`window`) or once no GPU pod has
waited for `background_quiet_s` (`idle`). One background migration at a time cluster-wide: the next is
planned once every tenant of the last was moved and every reservation it made ended; after a plan that
found nothing to gain, not before `BACKGROUND_RETRY_S`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpupool_sched.cache.reservations import Reservation
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.actions import background
from gpupool_sched.framework.plugins.defrag_config import DefragConfig, in_window
from gpupool_sched.framework.plugins.movers import BUDGET_REFRESH_S, Movers
from gpupool_sched.framework.plugins.victims import DisruptionBudgets
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube import migration_record
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.kube.migration_record import MIGRATION_ANNOTATION, MOVED_ANNOTATION
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.background import Gathering, gpus_vacated
from gpupool_sched.placement.consolidation import Consolidation
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import Policy
from gpupool_sched.writer.migrator import BACKGROUND, REASON, Migrator
from gpupool_sched.writer.preemptor import Preemptor
from gpupool_sched.writer.recorder import EventRecorder

log = logging.getLogger(__name__)

SURGES_LOOK_S = 30.0  # a leader looks for surges left unfinished this often (and on taking over)
SURGES_WAIT_S = 2.0  # ... and this often while one waits for its new replica to become Ready
BACKGROUND_RETRY_S = 30.0  # background consolidation plans again this long after a plan found nothing to gain
PURPOSE = BACKGROUND + "/"  # a background migration's id (the reservations' `blocked`): this and a serial


@dataclass(slots=True)
class Freeing:
    """What a migration under way will free: its GPUs count as freed once its last mover is replaced."""

    reason: str  # the migrations metric's: blocked or background
    gpus: int  # whole GPUs its moves free (`gpus_vacated`)
    left: int  # movers not replaced on their destinations yet


@dataclass
class Defrag:
    state: ClusterState
    queue: SchedulingQueue
    movers: Movers
    migrator: Migrator
    metrics: SchedulerMetrics
    due: dict[str, float] = field(default_factory=dict)  # blocked UID -> queue clock when pods may move for it
    started: dict[str, float] = field(default_factory=dict)  # blocked UID -> queue clock of its migration
    refreshed: float = float("-inf")  # queue clock of the default budget's last count of running GPU pods
    policy: Callable[[], Policy] | None = None  # background consolidation: the policy's filters place tenants
    profile: Callable[[], WorkloadProfile] | None = None  # ... and the FGD measure it must not raise
    hold_s: Callable[[Iterable[str]], float] | None = None  # how long a mover's eviction takes (its grace + slack)
    utcnow: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    quiet_since: float | None = None  # queue clock since which no real pod waited for GPUs (None: not yet ticked)
    waiting: bool = False  # a real pod waits for GPUs (as of the last tick)
    running: str | None = None  # the background migration under way, if any
    next_plan: float = float("-inf")  # queue clock before which background consolidation does not plan
    serial: int = 0
    freeing: dict[str, Freeing] = field(default_factory=dict)  # migration (blocked UID or background purpose)
    read: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # pod UID -> its marks read
    surges_at: float | None = None  # queue clock of the next look for unfinished surges (None: on leading)
    looking: bool = False  # a look for unfinished surges is under way

    @classmethod
    def build(cls, config: DefragConfig, state: ClusterState, budgets: DisruptionBudgets, queue: SchedulingQueue,
              preemptor: Preemptor, metrics: SchedulerMetrics, recorder: EventRecorder) -> Defrag:
        defrag = cls(state, queue, Movers(state, budgets, config, clock=queue.clock),
                     Migrator(state, preemptor, queue, metrics, recorder, surge_timeout_s=config.surge_timeout_s),
                     metrics)
        state.on_claimed = defrag._replaced
        defrag.migrator.on_refused = defrag.movers.refuse
        return defrag

    def wait(self, uid: str, first_seen: float | None, priority: int) -> None:
        """A lone pod fits nowhere and has not waited `after_s` yet: try it again then, if anything could
        move for it at all (a cluster without movable pods retries nothing)."""
        at = self.movers.wait_over_at(first_seen, priority) if first_seen is not None else None
        if at is not None:
            self.due.setdefault(uid, at)

    def held_back(self, uid: str) -> None:
        """Nothing moved for `uid` though pods may move for it: when pods left out by their cooldown may
        move again, or the spent budget allows a move again, it is tried again (not only at the next cluster
        event or the queue's flush)."""
        at = self.movers.held_until()
        if at is not None:
            self.due[uid] = min(self.due.get(uid, at), at)

    def observe(self, uid: str, obj: Mapping[str, Any], deleted: bool = False) -> None:
        """A pod's watch event: the moves it records (a blocked pod's `gpupool.io/migration`, a replacement's
        `gpupool.io/moved`) count on the budget and the cooldown here too, whoever made them (the budgets
        survive a restart and a failover). Each annotation is read once per value."""
        if deleted:
            self.read.pop(uid, None)
            return
        annotations = (obj.get("metadata") or {}).get("annotations")
        if not annotations:
            return
        record, moved = annotations.get(MIGRATION_ANNOTATION), annotations.get(MOVED_ANNOTATION)
        if record is None and moved is None:
            return
        seen = self.read.get(uid)
        if seen == (record, moved):
            return
        self.read[uid] = (record, moved)
        if isinstance(moved, str) and moved and (seen is None or seen[1] != moved):
            try:
                mark = migration_record.decode_moved(moved)
            except ValueError as exc:
                log.warning("pod %s: %s", uid, exc)
            else:
                self.state.replaced.setdefault(uid, mark.lineage)
                self.movers.remember(mark.mover, mark.lineage, mark.pod, mark.owner, mark.at)
        if isinstance(record, str) and record and (seen is None or seen[0] != record):
            try:
                found = migration_record.decode(record)
            except ValueError:
                return  # said where the holds are read (scheduler/adoption.py)
            for move in found.moves:
                self.movers.remember(move.mover, self.state.replaced.get(move.mover, move.mover), move.mover_key,
                                     move.owner, found.at)

    def planned(self, plan: PodPlan, migration: Consolidation) -> None:
        moves = migration.moves
        # the room held for the pod beside its movers is its own: counted as what the migration frees
        vacated = gpus_vacated(self.state.unheld_snapshot({plan.uid}), moves)
        self.freeing[plan.uid] = Freeing(REASON, vacated, len(moves))
        self.migrator.carry_out(plan, migration)
        self.movers.carried_out(m.pod.uid for m in migration.moves)
        self.started[plan.uid] = self.queue.clock()
        self.metrics.defrag_budget_remaining.set(self.movers.budget_left())

    def placed(self, uid: str) -> None:
        """`uid` was bound: the migration made for it, if any, is done."""
        began = self.started.pop(uid, None)
        if began is not None:
            self.metrics.migration_duration.observe(self.queue.clock() - began)

    def forget(self, uid: str) -> None:
        self.due.pop(uid, None)
        self.started.pop(uid, None)

    def tick(self) -> None:
        """Housekeeping: pods whose wait is over try again; expired reservations end."""
        now = self.queue.clock()
        if self.movers.config.per_hour is None and now - self.refreshed >= BUDGET_REFRESH_S:
            self.movers.refresh()  # a pass over every pod: an hourly budget needs no fresher count
            self.refreshed = now
        for uid in [u for u, at in self.due.items() if at <= now]:
            del self.due[uid]
            self.queue.retry(uid)
        if self.state.expire_reservations():
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if self.freeing:
            self._forget_stopped()
        self.metrics.defrag_budget_remaining.set(self.movers.budget_left())

    def _replaced(self, reservation: Reservation) -> None:
        reason = BACKGROUND if reservation.blocked.startswith(PURPOSE) else REASON
        self.metrics.migrations.labels(reason=reason, result="replaced").inc()
        freeing = self.freeing.get(reservation.blocked)
        if freeing is not None:
            freeing.left -= 1
            if freeing.left <= 0:
                del self.freeing[reservation.blocked]
                self.metrics.defrag_gpus_freed.labels(reason=freeing.reason).inc(freeing.gpus)

    def _forget_stopped(self) -> None:
        """Migrations that ended without every mover replaced (stopped, abandoned, expired) free nothing."""
        live = {r.blocked for r in self.state.reservations.values()}
        for key in [k for k in self.freeing if k not in live]:
            del self.freeing[key]

    # ---- background consolidation --------------------------------------------------------------------
    def background_allowed(self, leading: bool, waiting: bool) -> bool:
        """Called every housekeeping tick (`waiting`: a real pod waits for GPUs now): whether the mode lets
        a background move start now."""
        now = self.queue.clock()
        config = self.movers.config
        self.waiting = waiting
        if waiting or self.quiet_since is None:
            self.quiet_since = now
        if config.background == "off" or not leading or waiting:
            return False
        if config.background == "window":
            assert config.background_window is not None
            utc = self.utcnow()
            return in_window(config.background_window, utc.hour * 60 + utc.minute)
        return now - self.quiet_since >= config.background_quiet_s

    def background(self, leading: bool, waiting: bool) -> Gathering | None:
        """Housekeeping: start one background migration when the mode allows and none is under way; the
        gathering started, if any."""
        allowed = self.background_allowed(leading, waiting)
        self.metrics.defrag_background_allowed.set(1 if allowed else 0)
        if not allowed or self.policy is None or self.hold_s is None:
            return None
        if self.running is not None:
            if self.running in self.migrator.active or any(
                    r.blocked == self.running for r in self.state.reservations.values()):
                return None  # one at a time: its tenants are being moved, or their replacements awaited
            self.running = None
            self.next_plan = self.queue.clock()  # the last one done: the next may come at once
        if self.queue.clock() < self.next_plan:
            return None
        self.serial += 1
        purpose = f"{PURPOSE}{self.serial}"
        found = background.run(self.state, self.movers, self.policy(), self.profile() if self.profile else None,
                               purpose, self.hold_s)
        if found is None:
            self.next_plan = self.queue.clock() + BACKGROUND_RETRY_S
            return None
        self.running = purpose
        self.freeing[purpose] = Freeing(BACKGROUND, gpus_vacated(self.state.snapshot, found.moves), len(found.moves))
        self.migrator.carry_out_background(purpose, found, lambda: not self.waiting)
        self.movers.carried_out(m.pod.uid for m in found.moves)
        self.metrics.defrag_budget_remaining.set(self.movers.budget_left())
        return found

    def lead(self, leading: bool) -> None:
        """Housekeeping: a leader looks for surges left unfinished (a failover, a restart) when it takes
        over, and then now and then (a scale-down of its own that failed is tried again so)."""
        if not leading or not self.movers.config.enabled:
            self.surges_at = None  # the next time it leads, it looks at once
            return
        now = self.queue.clock()
        if self.looking or (self.surges_at is not None and now < self.surges_at):
            return
        self.looking = True
        self.surges_at = now + SURGES_LOOK_S
        self.migrator._spawn(self._look())

    async def _look(self) -> None:
        try:
            found = await self.migrator.surger.recover_all()
        except ApiError as exc:
            log.warning("looking for unfinished surges failed (%s); trying again later", exc)
            return
        finally:
            self.looking = False
        for record, outcome in found:
            if outcome.result == "waiting":
                soon = self.queue.clock() + SURGES_WAIT_S
                self.surges_at = soon if self.surges_at is None else min(self.surges_at, soon)
                continue
            if outcome.result != "left":
                self.metrics.migrations.labels(reason=REASON, result=_RESULTS.get(outcome.result,
                                                                                  outcome.result)).inc()
            if outcome.result == "rolled_back":
                self.movers.refuse(record.owner)
            self.queue.on_event(ClusterEvent.GPU_FREED)


_RESULTS = {"gone": "abandoned"}  # a recovered surge's outcome -> the migrations metric's result
