"""A fault-injecting HTTPS proxy on 127.0.0.1 between one API client (a scheduler replica) and kube-apiserver.

It terminates TLS with the apiserver's own serving certificate (issued by the dev cluster's CA for
127.0.0.1), so the client keeps its kubeconfig's CA and bearer token and only its `server` changes
(`FaultProxy.write_kubeconfig`). Each client connection gets one upstream TLS connection of its own; requests
are parsed (HTTP/1.1, keep-alive, Content-Length or chunked bodies both ways) and every response is streamed
through as it comes, so watches (long chunked responses) work for aiohttp (kopf, the scheduler's writer) and
urllib3 (the kubernetes client) alike.

Modes, switchable at run time from any thread:
  * `pass`: forward everything.
  * `cut`: every open connection is closed now, and new ones are closed as soon as they are accepted.
  * `blackhole`: a partition. Nothing is forwarded either way and nothing is answered: requests read from a
    client are held (new connections are accepted, their requests held too). When the mode goes back to `pass`, what is
    held moves on, as TCP's retransmissions would deliver it after a partition heals, except what a client
    gave up on meanwhile (closed its connection), which is dropped, as a reset connection drops its unsent
    data.
`freeze_after_bindings(count)` makes the proxy black-hole itself the moment Binding number `count + 1` arrives,
before forwarding it: exactly `count` Bindings reach the apiserver, whatever the client's speed (`frozen` is set).
Independently, `drop_binding_responses(fraction, seed)`: that fraction (seeded) of Bindings (POST `.../binding`)
is forwarded, its answer read from the apiserver, and the client connection closed without an answer.

Every request forwarded upstream is logged (`ProxyRecord`: wall-clock time it was sent upstream, method, path,
answer status, the proxy's `label`, whether the answer was dropped or the request had been held), in memory and
as JSON lines in `log_file`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

PASS, CUT, BLACKHOLE = "pass", "cut", "blackhole"
# a Binding: POST to the pod's subresource, or to the namespace's bindings collection
EVICTION = re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+/eviction$")
BINDING = re.compile(r"^/api/v1/namespaces/[^/]+/(pods/[^/]+/binding|bindings)$")
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_MAX_HEAD = 1 << 20


@dataclass(frozen=True)
class ProxyRecord:
    label: str
    sent_at: float  # wall clock (time.time()) when the request went upstream
    method: str
    path: str  # without the query
    query: str
    status: int  # 0: no answer came back (connection lost)
    answered_at: float  # wall clock of the answer's status line (0 when none)
    dropped: bool  # the answer was withheld from the client (drop_binding_responses)
    held: bool  # the request waited out a black hole before it was sent
    target: str = ""  # a Binding's target node
    pod: str = ""  # a Binding's pod
    gone: bool = False  # a watch answered 410 Gone (an ERROR event of code 410 in its stream, or the status)

    @property
    def is_write(self) -> bool:
        return self.method in WRITES


class _Closed(Exception):
    """The client or upstream connection ended."""


class _Reader:
    """An asyncio.StreamReader with one pushed-back chunk (what was read while watching for EOF)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.pending = b""

    async def readuntil(self, sep: bytes) -> bytes:
        if self.pending:
            at = self.pending.find(sep)
            if at >= 0:
                out, self.pending = self.pending[: at + len(sep)], self.pending[at + len(sep):]
                return out
            head, self.pending = self.pending, b""
            if len(head) > _MAX_HEAD:
                raise _Closed("header too long")
            return head + await self._until(sep)
        return await self._until(sep)

    async def _until(self, sep: bytes) -> bytes:
        try:
            return await self.reader.readuntil(sep)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError) as exc:
            raise _Closed(str(exc)) from None

    async def readexactly(self, n: int) -> bytes:
        take = self.pending[:n]
        self.pending = self.pending[n:]
        if len(take) == n:
            return take
        try:
            return take + await self.reader.readexactly(n - len(take))
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError) as exc:
            raise _Closed(str(exc)) from None

    async def read(self, n: int) -> bytes:
        if self.pending:
            take, self.pending = self.pending[:n], self.pending[n:]
            return take
        try:
            return await self.reader.read(n)
        except (ConnectionError, ssl.SSLError):
            return b""

    def push_back(self, data: bytes) -> None:
        self.pending = data + self.pending


def _headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0]
    fields = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields.append((name.strip(), value.strip()))
    return first, fields


def _binding(body: bytes) -> tuple[str, str]:
    """(target node, pod name) of a Binding's body."""
    try:
        document = json.loads(body)
        return str(document["target"]["name"]), str(document["metadata"]["name"])
    except (ValueError, KeyError, TypeError):
        return "?", "?"


def _get(fields: list[tuple[str, str]], name: str) -> str | None:
    name = name.lower()
    return next((v for k, v in fields if k.lower() == name), None)


class FaultProxy:
    """One listener on 127.0.0.1 forwarding to `upstream` (https://127.0.0.1:PORT); runs its own event loop
    on a thread. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, upstream: str, ca_file: Path, cert_file: Path, key_file: Path, *, label: str,
                 log_file: Path | None = None) -> None:
        match = re.match(r"^https://([^:/]+):(\d+)/?$", upstream)
        if not match:
            raise ValueError(f"upstream must be https://host:port, not {upstream!r}")
        self.upstream_host, self.upstream_port = match.group(1), int(match.group(2))
        self.label = label
        self.log_file = log_file
        self.records: list[ProxyRecord] = []
        self.mode = PASS
        self.port = 0
        self.dropped = 0  # answers withheld so far
        self.severed = 0  # connections closed by `cut`
        self._server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ctx.load_cert_chain(str(cert_file), str(key_file))
        self._client_ctx = ssl.create_default_context(cafile=str(ca_file))
        self._drop_fraction = 0.0
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._open: asyncio.Event | None = None  # set unless black-holed
        self._conns: dict[int, tuple[asyncio.StreamWriter, list[asyncio.StreamWriter]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._listeners: list[Callable[[ProxyRecord], None]] = []
        self._freeze_after: int | None = None
        self._bindings_seen = 0
        self._freeze_after_evictions: int | None = None
        self._evictions_seen = 0
        self.frozen = threading.Event()
        self.binding_statuses: list[int] = []  # the apiserver's answers to Bindings, withheld or not

    # ------------------------------------------------------------------ control (any thread)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._open = asyncio.Event()
            self._open.set()
            self._server = loop.run_until_complete(asyncio.start_server(
                self._accept, "127.0.0.1", 0, ssl=self._server_ctx, ssl_handshake_timeout=10))
            self.port = int(self._server.sockets[0].getsockname()[1])
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"faultproxy-{self.label}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(15)
            self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def set_mode(self, mode: str) -> None:
        if mode not in (PASS, CUT, BLACKHOLE):
            raise ValueError(mode)
        done = threading.Event()

        def switch() -> None:
            self.mode = mode
            assert self._open is not None
            if mode == BLACKHOLE:
                self._open.clear()
            else:
                self._open.set()
            if mode == CUT:
                for client, upstreams in list(self._conns.values()):
                    self.severed += 1
                    self._abort(client)
                    for up in upstreams:
                        self._abort(up)
            done.set()

        assert self._loop is not None
        self._loop.call_soon_threadsafe(switch)
        done.wait(5)

    def drop_binding_responses(self, fraction: float, seed: int = 0) -> None:
        with self._lock:
            self._drop_fraction = fraction
            self._rng = random.Random(seed)

    def freeze_after_bindings(self, count: int) -> None:
        """Black-hole everything (as `set_mode(BLACKHOLE)`) when Binding number `count + 1` arrives."""
        with self._lock:
            self._freeze_after = count
            self._bindings_seen = 0
        self.frozen.clear()

    def freeze_after_evictions(self, count: int) -> None:
        """Black-hole everything once the API server has answered Eviction number `count`: the eviction is
        done, and its answer, like every later request and watch event, never reaches the client."""
        with self._lock:
            self._freeze_after_evictions = count
            self._evictions_seen = 0
        self.frozen.clear()

    def on_record(self, listener: Callable[[ProxyRecord], None]) -> None:
        self._listeners.append(listener)

    def snapshot(self) -> list[ProxyRecord]:
        with self._lock:
            return list(self.records)

    def write_kubeconfig(self, source: Path, target: Path) -> Path:
        """A copy of kubeconfig `source` (CA, token) whose server is this proxy."""
        document: dict[str, Any] = yaml.safe_load(source.read_text())
        for cluster in document["clusters"]:
            cluster["cluster"]["server"] = self.url
        target.write_text(yaml.safe_dump(document, sort_keys=False))
        target.chmod(0o600)
        return target

    # ------------------------------------------------------------------ the loop's side

    @staticmethod
    def _abort(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            writer.transport.abort()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self.mode = CUT  # held requests and answers give up; every connection ends
        assert self._open is not None
        self._open.set()
        for client, upstreams in list(self._conns.values()):
            self._abort(client)
            for up in upstreams:
                self._abort(up)
        if self._tasks:
            _, left = await asyncio.wait(set(self._tasks), timeout=5)
            for task in left:
                task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._open is not None
        self._tasks.add(task)
        upstreams: list[asyncio.StreamWriter] = []
        self._conns[id(writer)] = (writer, upstreams)
        try:
            if self.mode == CUT:
                self.severed += 1
                self._abort(writer)
                return
            await self._serve(_Reader(reader), writer, upstreams)
        except (_Closed, ConnectionError, ssl.SSLError, OSError):
            pass
        finally:
            self._conns.pop(id(writer), None)
            self._abort(writer)
            for up in upstreams:
                self._abort(up)
            self._tasks.discard(task)

    async def _connect(self) -> tuple[_Reader, asyncio.StreamWriter]:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.upstream_host, self.upstream_port, ssl=self._client_ctx,
                                    server_hostname=self.upstream_host, limit=_MAX_HEAD),
            10,
        )
        return _Reader(reader), writer

    async def _hold(self, client: _Reader) -> bool:
        """Wait out a black hole; False when the client closed its connection meanwhile."""
        assert self._open is not None
        if self._open.is_set():
            return True
        opened = asyncio.ensure_future(self._open.wait())
        eof = asyncio.ensure_future(client.read(65536))
        done, _ = await asyncio.wait({opened, eof}, return_when=asyncio.FIRST_COMPLETED)
        if eof in done:
            data = eof.result()
            if not data:
                opened.cancel()
                return False
            client.push_back(data)  # pipelined bytes (HTTP/1.1 clients here do not pipeline)
            await opened
            return True
        eof.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await eof
        if not eof.cancelled():
            data = eof.result()
            if not data:
                return False
            client.push_back(data)
        return True

    async def _serve(self, client: _Reader, writer: asyncio.StreamWriter,
                     upstreams: list[asyncio.StreamWriter]) -> None:
        up_reader: _Reader | None = None
        up_writer: asyncio.StreamWriter | None = None
        while True:
            head = await client.readuntil(b"\r\n\r\n")
            request_line, fields = _headers(head)
            method, target, _version = request_line.split(" ", 2)
            path, _, query = target.partition("?")
            body = await self._read_body(client, fields, request=True)
            assert self._open is not None
            if method == "POST" and BINDING.match(path):
                self._count_binding()
            held = not self._open.is_set()
            if not await self._hold(client):
                return  # the client gave up during the partition: its request never arrives
            if self.mode == CUT:
                return
            if up_writer is None or up_writer.is_closing():
                up_reader, up_writer = await self._connect()
                upstreams.append(up_writer)
            assert up_reader is not None
            with self._lock:
                drop = (method == "POST" and BINDING.match(path) is not None
                        and self._drop_fraction > 0 and self._rng.random() < self._drop_fraction)
            target, bound = _binding(body) if method == "POST" and BINDING.match(path) else ("", "")
            sent_at = time.time()
            status = 0
            answered_at = 0.0
            seen: dict[str, bool] = {"gone": False}
            try:
                up_writer.write(head + body)
                await up_writer.drain()
                status_head = await up_reader.readuntil(b"\r\n\r\n")
                answered_at = time.time()
                status_line, status_fields = _headers(status_head)
                status = int(status_line.split(" ", 2)[1])
                if target:
                    with self._lock:
                        self.binding_statuses.append(status)
                if method == "POST" and EVICTION.match(path):
                    self._count_eviction()
                if drop:
                    await self._read_response_body(up_reader, status_fields, method, status, None)
                    self.dropped += 1
                    return  # the client's connection closes without an answer
                await self._gate()
                writer.write(status_head)
                await writer.drain()
                keep = await self._read_response_body(up_reader, status_fields, method, status, writer, seen)
            finally:
                self._log(ProxyRecord(self.label, sent_at, method, path, query, status, answered_at, drop, held,
                                      target, bound, seen["gone"] or status == 410))
            connection = (_get(fields, "Connection") or "").lower()
            if not keep or connection == "close" or (_get(status_fields, "Connection") or "").lower() == "close":
                return

    def _count_binding(self) -> None:
        """On the loop: freeze (black-hole) before the Binding past `freeze_after_bindings`'s count."""
        assert self._open is not None
        with self._lock:
            self._bindings_seen += 1
            freeze = self._freeze_after is not None and self._bindings_seen > self._freeze_after
        if freeze and self._open.is_set():
            self.mode = BLACKHOLE
            self._open.clear()
            self.frozen.set()

    def _count_eviction(self) -> None:
        """On the loop, with the API server's answer in hand: freeze at `freeze_after_evictions`'s count."""
        assert self._open is not None
        with self._lock:
            self._evictions_seen += 1
            freeze = (self._freeze_after_evictions is not None
                      and self._evictions_seen >= self._freeze_after_evictions)
        if freeze and self._open.is_set():
            self.mode = BLACKHOLE
            self._open.clear()
            self.frozen.set()

    async def _gate(self) -> None:
        """Answers wait out a black hole too."""
        assert self._open is not None
        await self._open.wait()
        if self.mode == CUT:
            raise _Closed("cut")

    async def _read_body(self, src: _Reader, fields: list[tuple[str, str]], *, request: bool) -> bytes:
        """A request body, whole (requests are small)."""
        length = _get(fields, "Content-Length")
        if length is not None:
            return await src.readexactly(int(length))
        if (_get(fields, "Transfer-Encoding") or "").lower() == "chunked":
            out = bytearray()
            while True:
                size_line = await src.readuntil(b"\r\n")
                out += size_line
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        line = await src.readuntil(b"\r\n")
                        out += line
                        if line == b"\r\n":
                            return bytes(out)
                out += await src.readexactly(size + 2)
        return b""

    async def _read_response_body(self, src: _Reader, fields: list[tuple[str, str]], method: str, status: int,
                                  dst: asyncio.StreamWriter | None, seen: dict[str, bool] | None = None) -> bool:
        """Stream a response body to `dst` (None: discard) as it comes; says whether the connection may be
        kept. `seen["gone"]` is set when a watch event says 410 Gone."""

        async def put(data: bytes) -> None:
            if seen is not None and b'"code":410' in data:
                seen["gone"] = True
            if dst is not None:
                await self._gate()
                dst.write(data)
                await dst.drain()

        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return True
        length = _get(fields, "Content-Length")
        if length is not None:
            left = int(length)
            while left:
                chunk = await src.read(min(left, 65536))
                if not chunk:
                    raise _Closed("upstream ended mid-body")
                left -= len(chunk)
                await put(chunk)
            return True
        if (_get(fields, "Transfer-Encoding") or "").lower() == "chunked":
            while True:
                size_line = await src.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    tail = bytearray(size_line)
                    while True:
                        line = await src.readuntil(b"\r\n")
                        tail += line
                        if line == b"\r\n":
                            break
                    await put(bytes(tail))
                    return True
                data = await src.readexactly(size + 2)
                await put(size_line + data)
        while True:  # until the upstream closes
            chunk = await src.read(65536)
            if not chunk:
                return False
            await put(chunk)

    def _log(self, record: ProxyRecord) -> None:
        with self._lock:
            self.records.append(record)
        if self.log_file is not None:
            with self.log_file.open("a") as out:
                out.write(json.dumps(asdict(record)) + "\n")
        for listener in self._listeners:
            listener(record)


def proxy_for(cluster_pki_folder: Path, server: str, *, label: str, log_file: Path | None = None) -> FaultProxy:
    """A proxy in front of the dev cluster's apiserver `server`, serving its certificate (pki folder of the
    cluster: ca.crt, apiserver.crt, apiserver.key)."""
    return FaultProxy(server, cluster_pki_folder / "ca.crt", cluster_pki_folder / "apiserver.crt",
                      cluster_pki_folder / "apiserver.key", label=label, log_file=log_file)
