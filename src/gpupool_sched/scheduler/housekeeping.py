"""The scheduler's once-a-second upkeep (`SchedulerConfig.housekeeping_s`): backoffs flushed, Bindings of
unknown outcome verified, nominations expired, the background actions ticked (defragmentation, surges left
by a failover, elastic lending, idle reclaim), gang and quota status written, gauges set. Every step is
guarded: one failing never stops the others or the loop."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gpupool_sched.framework.queue import ClusterEvent
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.kube.pod_input import InvalidPod
from gpupool_sched.scheduler.defrag import PURPOSE as BACKGROUND_PURPOSE

if TYPE_CHECKING:
    from gpupool_sched.scheduler.service import SchedulerService

log = logging.getLogger(__name__)


class Housekeeping:
    def __init__(self, service: SchedulerService) -> None:
        self.s = service

    async def run(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.s.config.housekeeping_s)
            try:
                self.tick(tick)
            except Exception:
                log.exception("housekeeping failed")
            tick += 1

    def tick(self, tick: int) -> None:
        s = self.s
        leading = s.leader.is_leader
        s.queue.flush()
        self.verify_unconfirmed()
        self.expire_nominations()
        s.defrag.tick()
        if s.config.defrag.background != "off":
            s.defrag.background(leading and not s.informers.stale, self.waiting_for_gpus())
        s.defrag.lead(leading)  # surges a failover or a restart left unfinished
        if leading and s.state.abandon_unstarted():
            s.queue.on_event(ClusterEvent.GPU_FREED)  # a failed-over plan's unevicted movers stay
        if s.config.elastic.enabled:  # lend replicas on free GPUs (leader only), the tier gauges
            s.elastic.tick(leading and not s.informers.stale, self.waiting_for_gpus)
        s.idle.tick(leading and not s.informers.stale)  # gauges; reports, sweep
        s.gang_upkeep.write_status()
        s.gang_upkeep.release_broken()
        if leading:
            s.spawn(self.publish_quotas())
        s.gauges.set(full=tick % 5 == 0)

    def verify_unconfirmed(self) -> None:
        """Bindings whose outcome is still unknown past their confirmation TTL: read the pod back."""
        for entry in self.s.state.expire():
            namespace, _, name = entry.key.partition("/")
            self.s.binder.verify(entry.uid, entry.key, namespace, name, entry.node, None)

    def expire_nominations(self) -> None:
        s = self.s
        stale = s.state.expire_nominations()
        for nomination in stale:
            if not s.leader.is_leader:
                continue  # the leader clears the field; this replica only stops holding
            namespace, _, name = nomination.key.partition("/")
            s.preemptor.clear(namespace, name)
        if stale:
            s.queue.on_event(ClusterEvent.GPU_FREED)

    def waiting_for_gpus(self) -> bool:
        """A real pod of ours waits for GPUs: pending, not placed yet, asking for GPUs, and not the
        replacement of a background move (that one waits for the room held for it)."""
        s = self.s
        for uid in s.queue.uids():
            info = s.pending.get(uid)
            if info is None or uid in s.state.pods:
                continue
            try:
                plan = s.state.plan(info)
            except InvalidPod:
                continue
            if not plan.request.gpu_shapes():
                continue
            held = s.state.reservation_for(plan)
            if held is not None and held.blocked.startswith(BACKGROUND_PURPOSE):
                continue
            return True
        return False

    async def publish_quotas(self) -> None:
        try:
            await self.s.statuses.quotas(self.s.quotas)
        except ApiError as exc:
            log.warning("writing GpuQuota status failed: %s", exc)
