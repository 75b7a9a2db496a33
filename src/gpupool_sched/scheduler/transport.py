"""The scheduler's writes to the API server, as HTTP requests on the event loop (aiohttp).

The `kubernetes` client is synchronous: every Binding and Event crossed to a worker thread and back,
and a dozen worker threads fought the event loop for the GIL. On a busy node the loop then waited
for a worker that held the GIL but had no CPU. aiohttp (kopf's own HTTP library) sends the same
requests from the loop itself: no threads, no hand-offs, a bounded pool of keep-alive connections.

Credentials, CA and client certificates come from the kubernetes client's `Configuration`, so both
talk to the same server as the same user; a rotating bearer token (in-cluster, exec plugins) is asked
for per request through the configuration's refresh hook.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes import client

from gpupool_sched.scheduler.apierror import ApiError

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def path(*parts: str) -> str:
    """An API path from segments, each percent-encoded."""
    return "/" + "/".join(quote(p, safe="") for p in parts)


class AsyncTransport:
    """Requests with the credentials of a kubernetes client `Configuration`, at most `limit` at once
    (more wait for a free connection)."""

    def __init__(self, configuration: client.Configuration, *, limit: int = 16, timeout_s: float = 15.0,
                 user_agent: str = "gpupool") -> None:
        self.configuration = configuration
        self.limit = limit
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ssl(self) -> ssl.SSLContext | None:
        cfg = self.configuration
        if not str(cfg.host).startswith("https"):
            return None
        if cfg.verify_ssl:
            context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        else:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
        return context

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.limit, ssl=self._ssl() or False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
            self._loop = loop
        return self._session

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type, "Accept": JSON, "User-Agent": self.user_agent}
        auth = self.configuration.auth_settings().get("BearerToken")  # calls the token refresh hook
        if auth and auth.get("value"):
            headers[auth["key"]] = auth["value"]
        return headers

    async def request(self, method: str, api_path: str, body: Mapping[str, Any],
                      content_type: str = JSON) -> None:
        """Send one write; raises ApiError for any non-2xx answer or when no answer came."""
        cfg = self.configuration
        server_hostname = getattr(cfg, "tls_server_name", None) or None
        try:
            session = self._open()
            async with session.request(method, f"{cfg.host}{api_path}", data=json.dumps(body),
                                       headers=self._headers(content_type),
                                       server_hostname=server_hostname) as resp:
                raw = await resp.read()
                if 200 <= resp.status < 300:
                    return
                raise ApiError.from_body(resp.status, resp.reason or "", raw)
        except ApiError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError, ssl.SSLError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
