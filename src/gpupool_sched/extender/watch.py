"""kopf wiring for the extender: watches of nodes, pods and PriorityClasses into its state, with the
scheduler's settings (no Events posted, standalone, no scans, no diff base, no writes to watched
objects; docs/scheduler.md explains each)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from gpupool_sched.scheduler.watch import NoDiffBase, connection_info

from .core import Extender


def build_registry(extender: Extender) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False
        settings.peering.standalone = True
        settings.scanning.disabled = True
        settings.queueing.worker_limit = None
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.reconnect_backoff = 0.5
        settings.networking.request_timeout = 60
        settings.persistence.diffbase_storage = NoDiffBase()
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
        extender.on_pod(event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.on_node(event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("scheduling.k8s.io", "v1", "priorityclasses", registry=registry)
    async def priority_class_event(event: kopf.RawEvent, **_: Any) -> None:
        extender.on_priority_class(event.get("type"), event["object"])  # type: ignore[arg-type]

    return registry


async def run_operator(extender: Extender, stop: asyncio.Event) -> None:
    for name in ("kopf.objects", "kopf.activities.startup", "kopf.activities.cleanup"):
        logging.getLogger(name).setLevel(logging.WARNING)
    await kopf.operator(registry=build_registry(extender), standalone=True, clusterwide=True, stop_flag=stop)
