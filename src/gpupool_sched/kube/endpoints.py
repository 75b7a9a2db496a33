"""`/metrics`, `/healthz` and `/readyz` on one port, served from a front end's event loop (aiohttp, which
kopf already brings)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def health_routes(registry: CollectorRegistry, readiness: Callable[[], tuple[bool, str]]) -> list[web.RouteDef]:
    """`/metrics` of `registry`, `/healthz` (the process answers), `/readyz` (200 when `readiness()` says so)."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        ready, why = readiness()
        return web.Response(text=why + "\n", status=200 if ready else 503)

    return [web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/readyz", readyz)]


async def start_endpoints(registry: CollectorRegistry, readiness: Callable[[], tuple[bool, str]], port: int,
                          host: str = "0.0.0.0") -> web.AppRunner:
    app = web.Application()
    app.add_routes(health_routes(registry, readiness))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner
