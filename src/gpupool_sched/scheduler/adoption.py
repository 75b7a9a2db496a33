"""What another instance decided for a pending pod, mirrored from the pod itself: its nomination
(`status.nominatedNodeName`) and a migration carried out for it (the `gpupool.io/migration` record). A
standby, or this process after a restart, holds the same room as the instance that decided, so a failover
neither hands that room to lower priorities nor preempts or moves pods a second time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.quotas import QuotaBook
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube import migration_record
from gpupool_sched.kube.podinfo import PodInfo

log = logging.getLogger(__name__)


class Adoption:
    def __init__(self, state: ClusterState, queue: SchedulingQueue, quotas: QuotaBook,
                 hold_s: Callable[[set[str]], float], ours: Collection[str]) -> None:
        self.state, self.queue, self.quotas, self.hold_s = state, queue, quotas, hold_s
        self.ours = ours  # pods whose migration this process started (the state holds for them already)

    def follow(self, info: PodInfo, priority: int) -> None:
        """A pending pod's event: mirror its migration record and its nomination."""
        movers, until = self.follow_migration(info)
        self.follow_nomination(info, priority, movers)
        if until is not None:
            self.state.extend_adopted(info.uid, until)  # a surge extended the record: hold as long

    def follow_migration(self, info: PodInfo) -> tuple[frozenset[str], float | None]:
        """Each mover's destination stays held for its replacement, until the record's `until` (extended
        when a surge extends it). Returns the movers' UIDs (the pod's adopted nomination holds what they
        free) and that deadline (the state's clock)."""
        if info.uid in self.ours:
            return frozenset(), None
        try:
            record = migration_record.record_of(info.obj)
        except ValueError as exc:
            log.warning("pod %s: %s", info.key, exc)
            return frozenset(), None
        if record is None:
            return frozenset(), None
        deadline = self.state.clock() + (record.until - time.time())
        for move in record.moves:
            self.state.adopt_reservation(info.uid, move, record.at, deadline)
        return frozenset(m.mover for m in record.moves), deadline

    def follow_nomination(self, info: PodInfo, priority: int, movers: frozenset[str] = frozenset()) -> None:
        """Hold what the deciding instance's victims (or a migration's movers, whatever their priority)
        free for the pod; a nomination cleared frees that room."""
        node = (info.obj.get("status") or {}).get("nominatedNodeName")
        if isinstance(node, str) and node:
            quota = self.quotas.reclaimable_by(info)
            reclaims = quota if not movers else (
                lambda e: e.uid in movers or (quota is not None and quota(e)))
            self.state.adopt_nomination(info.uid, info.key, node, priority, self.hold_s, reclaims=reclaims)
        elif self.state.drop_adopted(info.uid):
            self.queue.on_event(ClusterEvent.GPU_FREED)
