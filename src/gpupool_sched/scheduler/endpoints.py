"""`/metrics`, `/healthz` and `/readyz` on one port, served from the scheduler's event loop (aiohttp,
which kopf already brings)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpupool_sched.scheduler.service import SchedulerService


async def start_endpoints(service: SchedulerService, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        ready, why = service.readiness()
        return web.Response(text=why + "\n", status=200 if ready else 503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner
