"""API writes from one thread of their own: an asyncio loop with an aiohttp session.

Bindings, Events and status patches used to go through the `kubernetes` client on 80 threads. Each
write then cost 1.1-1.4 ms of the scheduler's CPU in a 1,000-node burst (urllib3 and the client in
Python, and 80 threads handing the GIL around), as much as the event loop spent deciding. On one loop
that only sends and reads, aiohttp's C parser does the same write for a third of that, and only two
threads (the scheduler's loop and this one) share the GIL. The scheduler's loop never runs a write
itself: that was tried (docs/benchmarks.md) and the writes then took the loop's time.

The writer thread needs the GIL for a moment at each step of a write (wake-up, send, answer). With
CPython's default switch interval (5 ms) a loop thread that gives the GIL up only briefly, as an
asyncio loop does between callbacks, can keep it from the writer indefinitely: a test loop that runs
2 ms callbacks back to back starved every write into its 15 s timeout, through this writer and
through the old client threads alike (`tune_switch_interval`, called by the CLIs, sets 1 ms).

Concurrency is bounded per caller (`Lane`): Bindings and reports each have their own limit, so a
burst of one never queues the other, and a write's timeout starts when its turn comes, not while it
waits for one.

Fencing: a lane may be given a write window (`Fence`), the seconds for which this process may still
write (a leader: until its lease could pass to another replica). A write waits for its turn at most
that long, is refused (`Fenced`, never sent) when the window has closed by its turn, and is cut off on
the wire when the window closes (its outcome is then unknown to the caller).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import ssl
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.001  # CPython: 0.005


def tune_switch_interval() -> None:
    """A thread waiting for the GIL gets it within 1 ms: call once, at process start."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class Fenced(Exception):
    """The write window closed before the write's turn: it was not sent."""


@dataclass(slots=True)
class Fence:
    """Shared by a client and its lanes: `window()` gives the seconds writes may still reach the API
    server (<= 0: none may); None: no limit."""

    window: Callable[[], float] | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """The status line and body of a write's answer."""

    status: int
    reason: str
    body: bytes


def ssl_context(cfg: Any) -> ssl.SSLContext | bool:
    """TLS as the `kubernetes` client's configuration asks for it (CA file or data, client
    certificate, verification switched off, a server name other than the host's)."""
    if not str(cfg.host).startswith("https"):
        return False
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None, cadata=getattr(cfg, "ca_cert_data", None))
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif cfg.assert_hostname is False:
        ctx.check_hostname = False
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    return ctx


def proxy_for(cfg: Any) -> str | None:
    """The client's proxy for its API server, unless the server's host is in the client's `no_proxy`
    (the kubernetes client's rule; its configuration reads both from the environment too)."""
    proxy = getattr(cfg, "proxy", None)
    if not proxy:
        return None
    no_proxy = getattr(cfg, "no_proxy", None)
    host = urllib.parse.urlsplit(str(cfg.host)).netloc
    # the stdlib rule behind urllib's own no_proxy (suffixes, ports, "*"); typeshed does not list it
    if no_proxy and urllib.request.proxy_bypass_environment(host, {"no": str(no_proxy)}):  # type: ignore[attr-defined]
        return None
    return str(proxy)


class ApiWriter:
    """One daemon thread running an event loop and an aiohttp session to the configured API server."""

    def __init__(self, configuration: Any, user_agent: str | None = None) -> None:
        self.cfg = configuration
        self.host = str(configuration.host).rstrip("/")
        self.user_agent = user_agent
        self.proxy = proxy_for(configuration)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._failed: Exception | None = None

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise ConnectionError("the API writer is closed")
            if self._failed is not None:
                raise ConnectionError(f"cannot set up the API writer: {self._failed}")
            if self._loop is None:
                ready = threading.Event()
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run, args=(loop, ready), name="kubeapi-writer",
                                                daemon=True)
                self._thread.start()
                ready.wait()
                if self._failed is not None:
                    raise ConnectionError(f"cannot set up the API writer: {self._failed}")
                self._loop = loop
            return self._loop

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._open())
        except Exception as exc:  # e.g. an unreadable client certificate: every write says so
            self._failed = exc
            loop.close()
            return
        finally:
            ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shut())
            loop.close()

    async def _open(self) -> None:
        # no limit on the pool itself: each lane's semaphore bounds what is on the wire
        connector = aiohttp.TCPConnector(limit=0, ssl=ssl_context(self.cfg), keepalive_timeout=60)
        self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))

    async def _shut(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        try:
            loop = self._ensure_started()
        except ConnectionError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def lane(self, limit: int) -> Lane:
        return Lane(self, limit)

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if self.user_agent:
            headers["User-Agent"] = self.user_agent
        # asked per request, as the client does: its refresh hook rotates an in-cluster token
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers

    async def request(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str,
                    timeout_s: float) -> Answer:
        assert self._session is not None
        data = json.dumps(body, separators=(",", ":")).encode()
        headers = self._headers(content_type)
        async with asyncio.timeout(timeout_s):
            async with self._session.request(
                method, self.host + api_path, data=data, headers=headers,
                proxy=self.proxy, server_hostname=getattr(self.cfg, "tls_server_name", None) or None,
            ) as resp:
                raw = await resp.read()  # read whole: the connection goes back to the pool
                return Answer(resp.status, resp.reason or "", raw)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(timeout_s)


class Lane:
    """At most `limit` of this caller's writes on the wire at once; the rest wait their turn."""

    def __init__(self, writer: ApiWriter, limit: int) -> None:
        if limit < 1:
            raise ValueError("a lane needs room for one write")
        self.writer = writer
        self.limit = limit
        self._sem: asyncio.Semaphore | None = None  # made on the writer's loop, used only there

    async def send(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str,
                   timeout_s: float, window: Callable[[], float] | None = None) -> Answer:
        """Awaited from any event loop; the request itself runs on the writer's. `window`: see `Fence`."""
        return await asyncio.wrap_future(self.writer.submit(self._turn(method, api_path, body, content_type,
                                                                       timeout_s, window)))

    async def _turn(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str,
                    timeout_s: float, window: Callable[[], float] | None) -> Answer:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        if window is None:
            async with self._sem:
                return await self.writer.request(method, api_path, body, content_type, timeout_s)
        left = window()
        if left <= 0:
            raise Fenced(f"write window closed {-left:.1f}s ago")
        try:
            async with asyncio.timeout(left):
                await self._sem.acquire()
        except TimeoutError:
            raise Fenced("write window closed while the write waited for its turn") from None
        try:
            left = window()  # renewed meanwhile, or lost
            if left <= 0:
                raise Fenced(f"write window closed {-left:.1f}s ago")
            return await self.writer.request(method, api_path, body, content_type, min(timeout_s, left))
        finally:
            self._sem.release()
