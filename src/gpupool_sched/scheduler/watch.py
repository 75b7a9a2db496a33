"""kopf wiring: the watches that feed the scheduler, and nothing that writes to watched objects.

Only `@kopf.on.event` handlers are used: they store nothing on the objects (no finalizers, no
last-handled-configuration annotations, unlike on.create/update, daemons and timers). The handlers
are coroutines: kopf runs plain functions on its thread pool, and the state, the queue and the
binder's gates belong to the event loop's thread alone. kopf runs standalone (no peering objects),
posts no Events of its own, and keeps no diff base (the handlers take the raw event). The service's
own loops start from `on.startup`, after a full LIST has rebuilt the state. Every event goes through
the service's informers (scheduler/informer.py), which drop stale versions and, when kopf lists again
after a watch gap, re-list to find what was deleted meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import kopf

from gpupool_sched.scheduler.quotas import GROUP as QUOTA_GROUP
from gpupool_sched.scheduler.quotas import PLURAL as QUOTA_PLURAL
from gpupool_sched.scheduler.quotas import VERSION as QUOTA_VERSION
from gpupool_sched.scheduler.service import SchedulerService

log = logging.getLogger(__name__)


def build_registry(service: SchedulerService) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)
        try:
            await service.start()
        except Exception as exc:  # kopf would retry the activity forever; a scheduler that cannot start exits
            raise kopf.PermanentError(f"cannot start: {exc}") from exc

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await service.stop()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(service.api.api_client.configuration)

    @kopf.on.event("", "v1", "pods", registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("pods", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("nodes", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("scheduling.k8s.io", "v1", "priorityclasses", registry=registry)
    async def priority_class_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("priorityclasses", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("policy", "v1", "poddisruptionbudgets", registry=registry)
    async def pdb_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("poddisruptionbudgets", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("scheduling.x-k8s.io", "v1alpha1", "podgroups", registry=registry)
    async def pod_group_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("podgroups", event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event(QUOTA_GROUP, QUOTA_VERSION, QUOTA_PLURAL, registry=registry)
    async def quota_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch(QUOTA_PLURAL, event.get("type"), event["object"])  # type: ignore[arg-type]

    @kopf.on.event("", "v1", "namespaces", registry=registry)
    async def namespace_event(event: kopf.RawEvent, **_: Any) -> None:
        service.informers.watch("namespaces", event.get("type"), event["object"])  # type: ignore[arg-type]

    return registry


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: `on.event` handlers get the raw event, so kopf's per-event deep copy of every
    watched object into an "essence" (for on.update diffs) is pure cost, a third of the event loop's
    time at 1,000 nodes. Nothing is stored on the objects either way."""

    def build(self, *, body: Any, extra_fields: Any = None) -> None:  # type: ignore[override]
        return None

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


class ReconnectBackoff:
    """kopf's delays between failed API requests: 0.5 s, 1 s, then 2 s for ever. kopf's default
    (1, 1, 2, 3, 5, 8, 13, 21) gives up after 54 s, which ends a watch for good when the API server is
    away that long, and waits up to 8 s after it is back (the watch-gap e2e took 9.1 s of its 10 s).
    Iterable anew for each request, and not Sized: kopf then retries without a limit."""

    def __iter__(self) -> Iterator[float]:
        return itertools.chain((0.5, 1.0), itertools.repeat(2.0))


def configure(settings: kopf.OperatorSettings) -> None:
    """What the scheduler and the extender ask of kopf: watch only, nothing written to objects."""
    settings.posting.enabled = False
    settings.peering.standalone = True
    settings.scanning.disabled = True  # no CRD/namespace scans: RBAC stays what the scheduler uses
    settings.queueing.worker_limit = None
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.reconnect_backoff = 0.5
    settings.networking.error_backoffs = ReconnectBackoff()
    settings.networking.request_timeout = 60
    settings.persistence.diffbase_storage = NoDiffBase()


def quiet_kopf_logs() -> None:
    """kopf logs every handled event and activity at INFO; the scheduler logs what matters itself."""
    for name in ("kopf.objects", "kopf.activities.startup", "kopf.activities.cleanup"):
        logging.getLogger(name).setLevel(logging.WARNING)


def connection_info(cfg: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from the kubernetes client's configuration (whatever file or in-cluster
    account it was loaded from), so both talk to the same server as the same user."""
    if getattr(cfg, "refresh_api_key_hook", None) is not None:
        cfg.refresh_api_key_hook(cfg)  # in-cluster: the projected service-account token rotates
    auth = (cfg.api_key or {}).get("BearerToken") or (cfg.api_key or {}).get("authorization")
    token = auth.split(" ", 1)[1] if auth and auth.lower().startswith("bearer ") else auth
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


async def run_operator(service: SchedulerService, stop: asyncio.Event) -> None:
    """kopf's operator, cluster-wide, until `stop` is set."""
    quiet_kopf_logs()
    await kopf.operator(
        registry=build_registry(service),
        standalone=True,
        clusterwide=True,
        stop_flag=stop,
    )
