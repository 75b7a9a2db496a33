"""kopf wiring for the extender: watches of nodes, pods, PriorityClasses, GpuQuotas and namespaces
into its state, with the scheduler's settings (no Events posted, standalone, no scans, no diff base,
no writes to watched objects; docs/scheduler.md explains each), through the extender's informers
(scheduler/informer.py: stale versions dropped, a re-list after a watch gap)."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from gpupool_sched.scheduler.quotas import GROUP as QUOTA_GROUP
from gpupool_sched.scheduler.quotas import PLURAL as QUOTA_PLURAL
from gpupool_sched.scheduler.quotas import VERSION as QUOTA_VERSION
from gpupool_sched.scheduler.watch import configure, connection_info, quiet_kopf_logs

from .core import Extender


def build_registry(extender: Extender) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)
        try:
            await extender.start()
        except Exception as exc:
            raise kopf.PermanentError(f"cannot start: {exc}") from exc

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await extender.stop()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(extender.api.api_client.configuration)

    @kopf.on.event("", "v1", "pods", registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.informers.watch("pods", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.informers.watch("nodes", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("scheduling.k8s.io", "v1", "priorityclasses", registry=registry)
    async def priority_class_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.informers.watch("priorityclasses", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event(QUOTA_GROUP, QUOTA_VERSION, QUOTA_PLURAL, registry=registry)
    async def quota_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.informers.watch(QUOTA_PLURAL, event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("", "v1", "namespaces", registry=registry)
    async def namespace_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.informers.watch("namespaces", event.get("type"), event["object"])  # type: ignore[arg-type]

    return registry


async def run_operator(extender: Extender, stop: asyncio.Event) -> None:
    quiet_kopf_logs()
    await kopf.operator(registry=build_registry(extender), standalone=True, clusterwide=True, stop_flag=stop)
