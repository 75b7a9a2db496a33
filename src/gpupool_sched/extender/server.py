"""The extender's HTTP server (aiohttp, on the event loop that also runs the watch): POST /filter,
/prioritize, /bind, /preempt; GET /healthz, /readyz, /metrics.

Bad requests never reach the core and never take the server down: a body over `max_body_bytes` gets
413, one that does not arrive within `read_timeout_s` 408, malformed JSON or a body that is not the
verb's arguments 400, a request before the state is built 503, an unexpected failure 500 (logged);
each with a one-line message and counted in gpupool_extender_request_errors_total."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gpupool_sched.kube.endpoints import health_routes

from .core import Extender, NotReady
from .protocol import BadRequest, parse_binding_args, parse_extender_args, parse_preemption_args

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
READ_TIMEOUT_S = 10.0

Verb = Callable[[Any], Awaitable[Any]]


def build_app(extender: Extender, *, max_body_bytes: int = MAX_BODY_BYTES,
              read_timeout_s: float = READ_TIMEOUT_S) -> web.Application:
    metrics = extender.metrics

    def error(verb: str, status: int, reason: str, message: str) -> web.Response:
        metrics.errors.labels(verb=verb, reason=reason).inc()
        return web.json_response({"Error": message}, status=status)

    def endpoint(verb: str, call: Verb) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            started = time.perf_counter()
            try:
                return await _serve(request, verb, call)
            finally:
                metrics.latency.labels(verb=verb).observe(time.perf_counter() - started)

        return handle

    async def _serve(request: web.Request, verb: str, call: Verb) -> web.Response:
        if request.content_length is not None and request.content_length > max_body_bytes:
            return error(verb, 413, "too_large", f"request body of {request.content_length} bytes is over the "
                         f"limit of {max_body_bytes} bytes")
        try:
            body = await asyncio.wait_for(request.read(), read_timeout_s)
        except TimeoutError:
            return error(verb, 408, "timeout", f"request body not received within {read_timeout_s:g}s")
        except web.HTTPRequestEntityTooLarge:
            return error(verb, 413, "too_large", f"request body is over the limit of {max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(verb, 400, "malformed", f"request body is not JSON: {exc}")
        try:
            answer = await call(data)
        except BadRequest as exc:
            return error(verb, 400, "invalid", f"bad {verb} request: {exc}")
        except NotReady as exc:
            return error(verb, 503, "not_ready", str(exc))
        except Exception as exc:
            log.exception("%s failed", verb)
            return error(verb, 500, "internal", f"{verb} failed: {type(exc).__name__}: {exc}")
        if isinstance(answer, dict) and answer.get("Error"):
            metrics.errors.labels(verb=verb, reason="result").inc()
            log.info("%s: %s", verb, answer["Error"])
        return web.json_response(answer)

    async def filter_verb(data: Any) -> Any:
        return extender.filter(parse_extender_args(data))

    async def prioritize_verb(data: Any) -> Any:
        return extender.prioritize(parse_extender_args(data))

    async def bind_verb(data: Any) -> Any:
        return await extender.bind(parse_binding_args(data))

    async def preempt_verb(data: Any) -> Any:
        return extender.preempt(parse_preemption_args(data))

    # aiohttp's own limit stops a chunked body that never says its length; ours answers the declared one
    app = web.Application(client_max_size=max_body_bytes)
    app.add_routes([
        web.post("/filter", endpoint("filter", filter_verb)),
        web.post("/prioritize", endpoint("prioritize", prioritize_verb)),
        web.post("/bind", endpoint("bind", bind_verb)),
        web.post("/preempt", endpoint("preempt", preempt_verb)),
        *health_routes(metrics.registry, extender.readiness),
    ])
    return app


def observability_app(extender: Extender) -> web.Application:
    """/metrics, /healthz and /readyz alone, for a separate --metrics-port."""
    app = web.Application()
    app.add_routes(health_routes(extender.metrics.registry, extender.readiness))
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Listen on host:port (0: any free port; read it back with `bound_port`)."""
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=75.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("the server listens on no TCP port")
