"""Carrying out a migration: the consolidate action decided (`plan_consolidation`, pure) and held everything
in the state (the blocked pod nominated on the node its movers leave, each mover's destination reserved
for its replacement); this sets the blocked pod's status.nominatedNodeName, evicts the movers through the
Eviction API (PodDisruptionBudgets hold; the checkpoint annotation is the eviction's grace) and posts the
Events that tell the story on both sides. A mover whose Deployment is annotated `gpupool.io/migrate: surge`
is moved make-before-break instead (writer/surge.py), before any eviction of the same migration; a surge
that does not complete stops the migration as a refused eviction does.

A mover already gone (404) is fine. Any other refusal (429: a budget) stops the migration: movers not yet
evicted are spared and their reservations end, the nomination ends, and the blocked pod is retried after
its backoff. When the blocked pod goes away meanwhile, the movers not yet evicted are spared (abandoned).

Background consolidation (`carry_out_background`, placement/background.py) moves tenants the same way with
no blocked pod: nothing is nominated and no migration record is written (a failover drops its holds, see
docs/defragmentation.md); each tenant gets a "Consolidating" Event saying where and why before it goes and
"Moved" after, the metric's reason is "background", and when a real pod starts waiting for GPUs the tenants
not moved yet are spared ("abandoned"; an eviction or a surge already sent completes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from gpupool_sched.cache.entries import CHECKPOINT_GRACE
from gpupool_sched.cache.reservations import reservation_uid
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.victims import asks, checkpoint_grace_s
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube import migration_record
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.kube.migration_record import MIGRATION_ANNOTATION, MigrationRecord, RecordedMove
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.placement.background import Gathering
from gpupool_sched.placement.consolidation import Consolidation, Move
from gpupool_sched.writer.preemptor import Preemptor, Target
from gpupool_sched.writer.recorder import EventRecorder
from gpupool_sched.writer.surge import Surger
from gpupool_sched.writer.surge_record import DEFAULT_SURGE_TIMEOUT_S, MIGRATE, SURGE, Deployment

log = logging.getLogger(__name__)
REASON = "blocked"  # the migrations metric's reason: for a pod that fit nowhere
BACKGROUND = "background"  # ... and for background consolidation (placement/background.py)


class Migrator:
    def __init__(self, state: ClusterState, preemptor: Preemptor, queue: SchedulingQueue,
                 metrics: SchedulerMetrics, recorder: EventRecorder, *,
                 surge_timeout_s: float = DEFAULT_SURGE_TIMEOUT_S) -> None:
        self.state = state
        self.preemptor = preemptor  # the writer's eviction path and nominatedNodeName
        self.queue = queue
        self.metrics = metrics
        self.recorder = recorder
        self.surger = Surger(state, preemptor.api, timeout_s=surge_timeout_s)
        self.surger.on_extended = self._extended
        self.records: dict[str, tuple[PodPlan, MigrationRecord]] = {}  # blocked UID -> its record as written
        # a controller not to surge again within the cooldown (refused, or rolled back), and the mover whose
        # move is refunded (refused: nothing was disturbed) or None
        self.on_refused: Callable[[str, str | None], None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.active: set[str] = set()  # background migrations whose tenants are still being moved

    def _targets(self, moves: tuple[Move, ...]) -> list[tuple[Move, Target]]:
        """Who to evict, with the eviction's grace (the checkpoint annotation honoured, capped)."""
        targets = []
        for move in moves:
            entry = self.state.pods[move.pod.uid]
            namespace, _, name = entry.key.partition("/")
            grace = checkpoint_grace_s(entry, self.preemptor.max_checkpoint_grace_s)
            targets.append((move, Target(move.pod.uid, namespace, name, move.pod.priority, grace,
                                         entry.grace_s if entry.grace_s != grace else None)))
        return targets

    def carry_out(self, plan: PodPlan, migration: Consolidation) -> None:
        """Start moving `migration`'s pods for `plan` (already nominated, destinations reserved)."""
        targets = self._targets(migration.moves)
        self.metrics.migrations.labels(reason=REASON, result="planned").inc(len(targets))
        log.info("pod %s: moving %d pod(s) off %s: %s", plan.key, len(targets), migration.node,
                 ", ".join(f"{t.namespace}/{t.name} -> {m.destination.node}" for m, t in targets))
        self._spawn(self._run(plan, migration, targets))

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def record(self, migration: Consolidation) -> MigrationRecord:
        """What the state holds for `migration`, as the blocked pod's annotation carries it."""
        moves, deadline = [], 0.0
        for move in migration.moves:
            reservation = self.state.reservations.get(reservation_uid(move.pod.uid))
            entry = self.state.pods.get(move.pod.uid)
            if reservation is None or entry is None:
                continue
            deadline = max(deadline, reservation.deadline)
            moves.append(RecordedMove(move.pod.uid, entry.key, entry.owner, entry.request, move.destination))
        now = time.time()
        return MigrationRecord(migration.node, now, now + max(0.0, deadline - self.state.clock()), tuple(moves))

    async def _extended(self, blocked: str) -> None:
        """A surge extended the holds of the migration for `blocked`: its record's `until` follows (a
        standby, and the leader after a failover, would otherwise let go of them too early)."""
        written = self.records.get(blocked)
        if written is None:
            return
        plan, record = written
        now, clock = time.time(), self.state.clock()
        deadlines = [r.deadline for m in record.moves
                     if (r := self.state.reservations.get(reservation_uid(m.mover))) is not None]
        nomination = self.state.nominations.get(blocked)
        if nomination is not None:
            deadlines.append(nomination.deadline)
        until = now + max(0.0, max(deadlines, default=clock) - clock)
        if until <= record.until + 1.0:
            return
        record = dataclasses.replace(record, until=until)
        self.records[blocked] = (plan, record)
        try:
            await self.preemptor.api.annotate_pod(plan.namespace, plan.name,
                                                  {MIGRATION_ANNOTATION: migration_record.encode(record)})
        except ApiError as exc:
            log.warning("pod %s: extending the migration record failed (%s); a failover would end its holds "
                        "early", plan.key, exc)

    async def _run(self, plan: PodPlan, migration: Consolidation, targets: list[tuple[Move, Target]]) -> None:
        try:
            await self._carry_out(plan, migration, targets)
        finally:
            self.records.pop(plan.uid, None)

    async def _carry_out(self, plan: PodPlan, migration: Consolidation, targets: list[tuple[Move, Target]]) -> None:
        api = self.preemptor.api
        record = self.record(migration)
        self.records[plan.uid] = (plan, record)
        try:  # the holds first, where a standby and the next leader read them, then the nomination
            await api.annotate_pod(plan.namespace, plan.name, {MIGRATION_ANNOTATION: migration_record.encode(record)})
        except ApiError as exc:
            if exc.status == 404:  # the blocked pod is gone: move nobody
                self._stop(plan, [t for _, t in targets], "abandoned", None)
                return
            log.warning("pod %s: recording the migration's holds failed (%s); a failover would lose them",
                        plan.key, exc)
        try:
            await api.set_nominated_node(plan.namespace, plan.name, migration.node)
        except ApiError as exc:
            if exc.status == 404:  # the blocked pod is gone: move nobody
                self._stop(plan, [t for _, t in targets], "abandoned", None)
                return
            log.warning("pod %s: setting nominatedNodeName failed (%s); moving anyway", plan.key, exc)
        # which movers surge (their Deployment says so): read before anything moves, and moved first (a surge
        # that fails disturbs nothing, so no eviction goes out for a migration that then stops)
        surges, unread = await self._surges(targets)
        if unread is not None:
            self._stop(plan, [t for _, t in targets], "failed", unread)
            return
        targets = sorted(targets, key=lambda mt: mt[1].uid not in surges)
        names = ", ".join(f"{t.namespace}/{t.name} (to {m.destination.node}{', by surge' if t.uid in surges else ''})"
                          for m, t in targets)
        self.recorder.record(plan.namespace, plan.name, plan.uid, "Normal", "Consolidating",
                             f"Moving {len(targets)} pod(s) off node {migration.node} to make room, each with "
                             f"its destination held: {names}")
        what = asks(plan.request)
        for i, (move, target) in enumerate(targets):
            if plan.uid not in self.state.nominations:  # placed, deleted or expired meanwhile
                self._stop(plan, [t for _, t in targets[i:]], "abandoned", None)
                return
            deployment = surges.get(target.uid)
            if deployment is not None:
                stopped = await self._surge(plan, migration, move, target, deployment, what)
                if stopped is not None:
                    self._stop(plan, [t for _, t in targets[i:]], *stopped)
                    return
                continue
            evicted, refused = await self._evict(target)
            if refused is not None:
                self._stop(plan, [t for _, t in targets[i:]], "failed", refused)
                return
            if not evicted:
                continue  # already gone: what it held is free (or held, if the watch saw it go)
            self.metrics.migrations.labels(reason=REASON, result="evicted").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Normal", "Moved",
                f"Moved off node {migration.node} to make room for {plan.key} ({what}); its replacement has "
                f"room held on node {move.destination.node}"
                + (f"; checkpoint grace {target.grace_s}s" if target.grace_s is not None else "")
                + (f" ({CHECKPOINT_GRACE} asks {target.asked_s}s; capped at {target.grace_s}s)"
                   if target.asked_s is not None else ""))

    async def _surges(self, targets: list[tuple[Move, Target]]) -> tuple[dict[str, Deployment], str | None]:
        """The movers whose Deployment says surge (mover UID -> it), read before anything moves; with why
        not when a read failed (the migration then stops)."""
        surges: dict[str, Deployment] = {}
        for _, target in targets:
            entry = self.state.pods.get(target.uid)
            try:
                found = await self.surger.deployment_of(entry) if entry is not None else None
            except ApiError as exc:
                return surges, f"reading the Deployment of {target.namespace}/{target.name} failed: {exc}"
            if found is not None:
                surges[target.uid] = found
        return surges, None

    async def _evict(self, target: Target) -> tuple[bool, str | None]:
        """Evict one mover: (evicted, why it was refused). Already gone (404) is (False, None)."""
        try:
            await self.preemptor.evict_pod(target.namespace, target.name, target.uid, target.grace_s)
        except ApiError as exc:
            if exc.status == 404:
                return False, None
            blocked = "a PodDisruptionBudget forbids it" if exc.status == 429 else str(exc)
            return False, f"evicting {target.namespace}/{target.name} failed: {blocked}"
        return True, None

    def carry_out_background(self, purpose: str, gathering: Gathering, live: Callable[[], bool]) -> None:
        """Start moving `gathering`'s tenants (background consolidation; each marked as moving for `purpose`
        and its destination reserved). `live()` False (a real pod waits for GPUs) spares those not moved yet."""
        targets = self._targets(gathering.moves)
        self.metrics.migrations.labels(reason=BACKGROUND, result="planned").inc(len(targets))
        log.info("background consolidation %s: freeing GPU %d of %s (whole free GPUs %d -> %d): %s", purpose,
                 gathering.gpu, gathering.node, gathering.free_gpus_before, gathering.free_gpus_after,
                 ", ".join(f"{t.namespace}/{t.name} -> {m.destination.node}" for m, t in targets))
        self.active.add(purpose)
        self._spawn(self._run_background(purpose, gathering, targets, live))

    async def _run_background(self, purpose: str, gathering: Gathering, targets: list[tuple[Move, Target]],
                              live: Callable[[], bool]) -> None:
        try:
            await self._move_background(purpose, gathering, targets, live)
        finally:
            self.active.discard(purpose)

    async def _move_background(self, purpose: str, gathering: Gathering, targets: list[tuple[Move, Target]],
                               live: Callable[[], bool]) -> None:
        why = (f"background consolidation: GPU {gathering.gpu} of node {gathering.node} comes free whole "
               f"(whole free GPUs {gathering.free_gpus_before} -> {gathering.free_gpus_after}"
               + (f", node {gathering.node} free" if gathering.node_freed else "")
               + (f"; fragmentation {gathering.fragmentation_before / 1000:.2f} -> "
                  f"{gathering.fragmentation_after / 1000:.2f} GPUs"
                  if gathering.fragmentation_before is not None and gathering.fragmentation_after is not None else "")
               + ")")
        surges, unread = await self._surges(targets)
        if unread is not None:
            self._stop_background(purpose, [t for _, t in targets], "failed", unread)
            return
        targets = sorted(targets, key=lambda mt: mt[1].uid not in surges)
        for i, (move, target) in enumerate(targets):
            if not live():
                self._stop_background(purpose, [t for _, t in targets[i:]], "abandoned",
                                      "a pod waits for GPUs: background moves stop")
                return
            where = f"node {move.destination.node} GPU {','.join(map(str, move.destination.gpu_indices))}"
            self.recorder.record(target.namespace, target.name, target.uid, "Normal", "Consolidating",
                                 f"Moving off node {move.pod.node} GPU "
                                 f"{','.join(map(str, move.pod.placement.gpu_indices))} to {where}, held for its "
                                 f"replacement{' (by surge)' if target.uid in surges else ''}: {why}")
            deployment = surges.get(target.uid)
            if deployment is not None:
                stopped = await self._surge_background(purpose, move, target, deployment)
                if stopped is not None:
                    self._stop_background(purpose, [t for _, t in targets[i:]], *stopped)
                    return
                continue
            evicted, refused = await self._evict(target)
            if refused is not None:
                self._stop_background(purpose, [t for _, t in targets[i:]], "failed", refused)
                return
            if not evicted:
                continue
            self.metrics.migrations.labels(reason=BACKGROUND, result="evicted").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Normal", "Moved",
                f"Moved off node {move.pod.node} by background consolidation; its replacement has room held on "
                f"node {move.destination.node}"
                + (f"; checkpoint grace {target.grace_s}s" if target.grace_s is not None else ""))

    async def _surge_background(self, purpose: str, move: Move, target: Target,
                                deployment: Deployment) -> tuple[str, str] | None:
        """One tenant moved make-before-break for background consolidation; when it stops, the result and why."""
        entry = self.state.pods.get(target.uid)
        if entry is None:
            return None
        replicas = await self.surger.may_surge(deployment)
        if isinstance(replicas, int):
            self.recorder.record_object(
                ("apps/v1", "Deployment"), deployment.namespace, deployment.name, deployment.uid, "Normal",
                "Surging", f"Scaling {replicas} -> {replicas + 1} to move {target.namespace}/{target.name} off node "
                f"{move.pod.node} (background consolidation, {MIGRATE}: {SURGE}); back to {replicas} once the new "
                "replica is Ready")
            outcome = await self.surger.move(purpose, entry, deployment, replicas, move.destination.node,
                                             live=lambda: True)  # started: it completes or times out
        else:
            outcome = replicas
        if outcome.result == "gone":
            return None
        if outcome.result == "surged":
            self.metrics.migrations.labels(reason=BACKGROUND, result="surged").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Normal", "Moved",
                f"Moved by surge off node {move.pod.node} by background consolidation: its new replica "
                f"{outcome.new} became Ready on node {outcome.node}")
            return None
        if outcome.result in ("refused", "rolled_back") and self.on_refused is not None:
            self.on_refused(move.owner, move.pod.uid if outcome.result == "refused" else None)
        self.recorder.record(target.namespace, target.name, target.uid, "Normal", "NotMoved",
                             f"Not moved off node {move.pod.node} by background consolidation: {outcome.why}")
        return outcome.result, f"moving {target.namespace}/{target.name} by surge: {outcome.why}"

    def _stop_background(self, purpose: str, remaining: list[Target], result: str, why: str) -> None:
        """Spare the tenants not moved yet and end their reservations (counted under `result`)."""
        self.metrics.migrations.labels(reason=BACKGROUND, result=result).inc(len(remaining))
        self.state.spare(purpose, (t.uid for t in remaining))
        freed = False
        for target in remaining:
            freed |= self.state.end_reservation(reservation_uid(target.uid))
        if freed:
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if remaining:
            log.log(logging.INFO if result == "abandoned" else logging.WARNING,
                    "background consolidation %s stopped, %d tenant(s) not moved: %s", purpose, len(remaining), why)

    async def _surge(self, plan: PodPlan, migration: Consolidation, move: Move, target: Target,
                     deployment: Deployment, what: str) -> tuple[str, str] | None:
        """Move one mover by surge (writer/surge.py); when the migration stops, the metric's result and why."""
        entry = self.state.pods.get(target.uid)
        if entry is None:
            return None  # gone already: its room is free
        replicas = await self.surger.may_surge(deployment)
        if isinstance(replicas, int):
            self.recorder.record_object(
                ("apps/v1", "Deployment"), deployment.namespace, deployment.name, deployment.uid, "Normal",
                "Surging", f"Scaling {replicas} -> {replicas + 1} to move {target.namespace}/{target.name} off node "
                f"{migration.node} for {plan.key} (make-before-break, {MIGRATE}: {SURGE}); back to {replicas} once "
                "the new replica is Ready")
            outcome = await self.surger.move(plan.uid, entry, deployment, replicas, move.destination.node)
        else:
            outcome = replicas
        if outcome.result == "gone":
            return None
        if outcome.result == "surged":
            self.metrics.migrations.labels(reason=REASON, result="surged").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Normal", "Moved",
                f"Moved by surge off node {migration.node} to make room for {plan.key} ({what}): Deployment "
                f"{deployment.key} was scaled to {outcome.replicas + 1}, its new replica {outcome.new} became Ready "
                f"on node {outcome.node}, then back to {outcome.replicas} with this pod's deletion cost lowest")
            self.recorder.record_object(
                ("apps/v1", "Deployment"), deployment.namespace, deployment.name, deployment.uid, "Normal",
                "Surged", f"Back to {outcome.replicas} replicas: {outcome.new} is Ready on node {outcome.node}, "
                f"{target.namespace}/{target.name} goes")
            return None
        if outcome.result in ("refused", "rolled_back") and self.on_refused is not None:
            # a rolled back surge disturbed: it counts
            self.on_refused(move.owner, move.pod.uid if outcome.result == "refused" else None)
        self.recorder.record(target.namespace, target.name, target.uid, "Normal", "NotMoved",
                             f"Not moved off node {migration.node} for {plan.key}: {outcome.why}")
        return outcome.result, f"moving {target.namespace}/{target.name} by surge: {outcome.why}"

    def _stop(self, plan: PodPlan, remaining: list[Target], result: str, why: str | None) -> None:
        """Spare the movers not moved yet and end their reservations (counted under `result`); unless the
        blocked pod went away ("abandoned"), the nomination ends too and the blocked pod tries again after
        its backoff, told `why`."""
        self.metrics.migrations.labels(reason=REASON, result=result).inc(len(remaining))
        self.state.spare(plan.uid, (t.uid for t in remaining))
        freed = False
        for target in remaining:
            freed |= self.state.end_reservation(reservation_uid(target.uid))
        if result == "abandoned":
            if freed:
                self.queue.on_event(ClusterEvent.GPU_FREED)
            return
        log.warning("pod %s: migration stopped (%s); retrying later", plan.key, why)
        if self.state.end_nomination(plan.uid) or freed:
            self.queue.on_event(ClusterEvent.GPU_FREED)
        self.recorder.record(plan.namespace, plan.name, plan.uid, "Warning", "ConsolidationFailed",
                             f"Moving pods stopped: {why}")
        self.preemptor.clear(plan.namespace, plan.name)
        self._spawn(self._forget_record(plan))
        self.queue.retry(plan.uid)

    async def _forget_record(self, plan: PodPlan) -> None:
        """The migration stopped: its record goes too, so that no standby keeps holding for it."""
        try:
            await self.preemptor.api.annotate_pod(plan.namespace, plan.name, {MIGRATION_ANNOTATION: None})
        except ApiError as exc:
            log.info("pod %s: removing the migration record failed (%s); its holds expire", plan.key, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
