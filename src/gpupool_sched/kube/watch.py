"""kopf wiring: the watches that feed a component (the scheduler service or the extender), and
nothing that writes to watched objects.

One handler per kind the component's informers follow (kube/informer.py), so the scheduler and
the extender differ only by the kinds they list. Only `@kopf.on.event` handlers are used: they store
nothing on the objects (no finalizers, no last-handled-configuration annotations, unlike
on.create/update, daemons and timers). The handlers are coroutines: kopf runs plain functions on its
thread pool, and the state, the queue and the binder's gates belong to the event loop's thread alone.
kopf runs standalone (no peering objects), posts no Events of its own, and keeps no diff base (the
handlers take the raw event). The component's own loops start from `on.startup`, after a full LIST has
rebuilt its state. Every event goes through the component's informers, which drop stale versions and,
when kopf lists again after a watch gap, re-list to find what was deleted meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import kopf

from gpupool_sched.kube.informer import Informers
from gpupool_sched.kube.kubeapi import KubeApi


class Watching(Protocol):
    """What the operator needs of a component: its API client, its informers (the kinds it watches)
    and its start-up (after the first LIST) and shutdown."""

    api: KubeApi
    informers: Informers

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def api_resource(path: str) -> tuple[str, str, str]:
    """(group, version, plural) of a list path: `/api/v1/nodes` or `/apis/<group>/<version>/<plural>`."""
    parts = path.strip("/").split("/")
    if len(parts) == 3 and parts[0] == "api":
        return "", parts[1], parts[2]
    if len(parts) == 4 and parts[0] == "apis":
        return parts[1], parts[2], parts[3]
    raise ValueError(f"not a cluster-wide list path: {path!r}")


def build_registry(component: Watching) -> kopf.OperatorRegistry:
    """kopf's handlers for `component`: start-up, cleanup, login, and one watch per informer kind."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)
        try:
            await component.start()
        except Exception as exc:  # kopf would retry the activity forever; a component that cannot start exits
            raise kopf.PermanentError(f"cannot start: {exc}") from exc

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await component.stop()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(component.api.api_client.configuration)

    for name, kind in component.informers.kinds.items():
        group, version, plural = api_resource(kind.path)
        kopf.on.event(group, version, plural, id=f"{name}_event", registry=registry)(_forward(component, name))
    return registry


def _forward(component: Watching, name: str) -> Callable[..., Awaitable[None]]:
    async def event_handler(event: kopf.RawEvent, **_: Any) -> None:
        component.informers.watch(name, event.get("type"), event["object"])  # type: ignore[arg-type]

    return event_handler


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


async def run_operator(component: Watching, stop: asyncio.Event) -> None:
    """kopf's operator, cluster-wide, until `stop` is set."""
    quiet_kopf_logs()
    await kopf.operator(
        registry=build_registry(component),
        standalone=True,
        clusterwide=True,
        stop_flag=stop,
    )
