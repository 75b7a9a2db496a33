"""A real HTTP server on 127.0.0.1 that records every request the scheduler's write path sends (method, path,
headers, body) and answers from a script of canned (status, body) pairs, and the KubeApi that writes to it:
for the tests of KubeApi.write and of what is built on it (the Event recorder)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from kubernetes import client

from gpupool_sched.kube.kubeapi import KubeApi
from tests.support.ports import free_port


class RecordingServer:
    """Records every request; answers with the next canned (status, body), else 201 {}."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.delay_s = 0.0
        self.hold: asyncio.Event | None = None  # set: requests whose path has "bindings" wait for it
        self.on_wire = 0
        self.most_on_wire = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.on_wire += 1
        self.most_on_wire = max(self.most_on_wire, self.on_wire)
        try:
            await asyncio.sleep(self.delay_s)
            if self.hold is not None and "bindings" in request.raw_path:
                await self.hold.wait()
        finally:
            self.on_wire -= 1
        self.seen.append({"method": request.method, "path": request.raw_path, "headers": dict(request.headers),
                          "body": json.loads(await request.read())})
        status, body = self.answers.pop(0) if self.answers else (201, {})
        return web.json_response(body, status=status)


async def with_recording_server(test: Any, **api_args: Any) -> None:
    """Run `await test(api, server)`: a KubeApi (its token rotating on every refresh, as in-cluster) writing
    to a RecordingServer on a free port of 127.0.0.1; both closed afterwards."""
    server = RecordingServer()
    app = web.Application()
    async def route(request: web.Request) -> web.Response:
        return await server.handle(request)  # looked up per request: a test may replace it

    app.router.add_route("*", "/{tail:.*}", route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    refreshed: list[int] = []
    cfg = client.Configuration(host=f"http://127.0.0.1:{port}")
    cfg.api_key = {"BearerToken": "token-0"}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}

    def refresh(c: client.Configuration) -> None:  # a rotating token, as in-cluster
        refreshed.append(1)
        c.api_key["BearerToken"] = f"token-{len(refreshed)}"

    cfg.refresh_api_key_hook = refresh
    api = KubeApi(client.ApiClient(cfg), component="gpupool-test", **api_args)
    try:
        await test(api, server)
    finally:
        api.close()
        await runner.cleanup()
