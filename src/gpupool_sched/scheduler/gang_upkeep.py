"""What becomes of gangs after their decision: members joining and ending, a member's failed Binding, the
release of a gang still short after its timeout, and the PodGroup status the leader writes. The writes
themselves are the writer's: statuses through `StatusWriter`, evictions through the `Preemptor`'s path."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.gangs import GROUP, VERSION, Gangs, group_of
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.writer.binder import BindOutcome
from gpupool_sched.writer.preemptor import Preemptor
from gpupool_sched.writer.recorder import EventRecorder
from gpupool_sched.writer.status import StatusWriter

log = logging.getLogger(__name__)
POD_GROUP = (f"{GROUP}/{VERSION}", "PodGroup")


@dataclass
class GangUpkeep:
    state: ClusterState
    gangs: Gangs
    statuses: StatusWriter
    evictions: Preemptor  # the writer's eviction path
    recorder: EventRecorder
    metrics: SchedulerMetrics
    is_leader: Callable[[], bool]
    spawn: Callable[[Coroutine[Any, Any, None]], None]  # an API write in the background
    wake: Callable[[str], None]  # a gang's members try again
    repair_s: float = 60.0  # a committed gang short of a member for this long is released
    ended: dict[str, str] = field(default_factory=dict)  # UID -> Succeeded/Failed (PodGroup status)

    def track(self, uid: str, obj: dict[str, Any], deleted: bool) -> None:
        """A pod event: membership, and the phase of members that ended."""
        if deleted:
            self.gangs.untrack(uid)
            self.ended.pop(uid, None)
            return
        key, _ = group_of(obj)
        if key is None and self.gangs.member_of(uid) is None:
            return
        phase = (obj.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self.ended[uid] = phase
        joined = self.gangs.track(uid, key)
        if joined is not None:
            self.wake(joined)

    def bind_failed(self, outcome: BindOutcome) -> None:
        """A member's Binding failed: its gang is broken until the member is bound again."""
        plan = outcome.plan
        key = self.gangs.member_of(plan.uid)
        if key is None or plan.uid in self.state.pods:
            return  # not a gang member, or its outcome is still unknown (kept while it is read)
        group = self.gangs.broke(key)
        if group is None:
            return
        placed = len(self.gangs.placed(key, self.state))
        timeout = group.timeout_s or self.repair_s
        message = (f"member {plan.key}'s Binding to {outcome.node} failed ({outcome.error}): {placed} of the "
                   f"{group.min_member} members (minMember) are bound; the member is retried, and the bound "
                   f"ones are released if the gang is not whole again within {timeout:.0f} s")
        log.warning("PodGroup %s: %s", key, message)
        self.recorder.record_object(POD_GROUP, group.namespace, group.name, group.uid, "Warning", "GangBroken",
                                    message)
        group.last_message = message

    def write_status(self) -> None:
        """PodGroup status (phase, scheduled, running, ...) where it changed; only the leader writes."""
        if not self.is_leader():
            return
        phases: Counter[str] = Counter()
        for group in list(self.gangs.groups.values()):
            if self.gangs.overdue(group.key) is not None:
                self.recorder.record_object(
                    POD_GROUP, group.namespace, group.name, group.uid, "Warning", "ScheduleTimeout",
                    f"not placed within scheduleTimeoutSeconds ({group.timeout_s:.0f} s): {group.last_message}")
            status = self.gangs.status(group, self.state, self.ended)
            phases[status["phase"]] += 1
            if status == group.written:
                continue
            group.written = status
            self.spawn(self._patch_status(group.namespace, group.name, status))
        self.metrics.gangs.clear()
        for phase, n in phases.items():
            self.metrics.gangs.labels(phase=phase).set(n)

    def release_broken(self) -> None:
        """A committed gang that lost a member (its Binding failed) and is still short after its timeout:
        its bound members are evicted (their controller recreates them, and the gang is placed whole)."""
        if not self.is_leader():
            return
        for group in self.gangs.to_release(self.state, self.repair_s):
            bound = [self.state.pods[u] for u in sorted(self.gangs.placed(group.key, self.state))]
            bound = [e for e in bound if e.phase.value in ("bound", "confirmed")]
            message = (f"not whole again within {group.timeout_s or self.repair_s:.0f} s after a "
                       f"member's Binding failed: releasing its {len(bound)} bound member(s) "
                       f"({', '.join(e.key for e in bound) or 'none'}) so that it is placed whole again")
            log.warning("PodGroup %s: %s", group.key, message)
            self.recorder.record_object(POD_GROUP, group.namespace, group.name, group.uid, "Warning",
                                        "GangReleased", message)
            group.last_message = message
            for entry in bound:
                namespace, _, name = entry.key.partition("/")
                self.recorder.record(namespace, name, entry.uid, "Warning", "GangReleased",
                                     f"evicted: its PodGroup {group.key} is short of minMember ({message})")
                self.spawn(self._evict_member(group.key, namespace, name, entry.uid))

    async def _evict_member(self, key: str, namespace: str, name: str, uid: str) -> None:
        try:
            await self.evictions.release(namespace, name, uid)
        except ApiError as exc:
            log.warning("pod %s/%s: releasing it from its broken gang failed (%s); trying again after the "
                        "gang's timeout", namespace, name, exc)
            group = self.gangs.groups.get(key)
            if group is not None and group.broken_since is None:
                group.committed = True
                self.gangs.broke(key)

    async def _patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        if not await self.statuses.pod_group(namespace, name, status):
            group = self.gangs.groups.get(f"{namespace}/{name}")
            if group is not None:
                group.written = {}  # written again at the next housekeeping
