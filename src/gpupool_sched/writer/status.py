"""The status of the scheduler's own objects, written for the plugins that say what it should be: GpuQuota
status (framework/plugins/quotas.py, `QuotaBook.status_updates`) and PodGroup status
(framework/plugins/gangs.py, handed over by scheduler/gang_upkeep.py).

Each is a merge patch of the object's status subresource through the KubeApi it is given, so the
leader's write window fences it as it does Bindings (`KubeApi.fence`; a write after the window closed is
refused as NotLeader, never sent). Only what changed is handed over; a failed write is logged and comes
back at the next housekeeping (a quota's because it is not marked sent, a PodGroup's because the caller
forgets what it wrote); a GpuQuota gone meanwhile (404) is not worth a word.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpupool_sched.framework.plugins import gangs, quotas
from gpupool_sched.framework.plugins.quotas import QuotaBook
from gpupool_sched.kube.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)


class StatusWriter:
    def __init__(self, api: KubeApi) -> None:
        self.api = api

    async def quotas(self, book: QuotaBook) -> int:
        """Write the status of every quota whose status changed (`book.status_updates`, which also sets the
        gauges), one after another; returns how many were written."""
        written = 0
        for update in book.status_updates():
            try:
                await self.api.patch_cluster_custom_status(quotas.GROUP, quotas.VERSION, quotas.PLURAL, update.name,
                                                           update.status)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("GpuQuota %s: writing its status failed: %s", update.name, exc)
                continue
            book.sent(update)
            written += 1
        return written

    async def pod_group(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Write a PodGroup's status; False when the write failed (logged)."""
        try:
            await self.api.patch_custom_status(gangs.GROUP, gangs.VERSION, gangs.PLURAL, namespace, name, status)
        except ApiError as exc:
            log.warning("PodGroup %s/%s: writing its status failed: %s", namespace, name, exc)
            return False
        return True
