"""A scripted Kubernetes API on 127.0.0.1 for the faults a real kube-apiserver cannot be told to make
(a Binding's answer lost after it committed, a watch gap at a chosen moment). It keeps objects by API
path, lists them with a resourceVersion, serves single pods, commits Bindings and answers as told. The
e2e fault tests (tests/e2e/test_faults.py) make the same faults against the real control plane."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from kubernetes import client

from gpupool_sched.kube.kubeapi import KubeApi
from tests.support.ports import free_port

PODS = "/api/v1/pods"
NODES = "/api/v1/nodes"


class ApiServer:
    """Objects by list path and namespace/name. POST .../bindings sets spec.nodeName (409 on a bound pod)
    and answers as `answer` says: "ok" (201), "lost" (the connection closed unanswered), or a status code;
    `commit=False` binds nothing but answers the same. A list path not stored answers `missing` (404)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {PODS: {}, NODES: {}}
        self.bindings: list[tuple[str, str]] = []  # (namespace/name, node) committed, in order
        self.answer: str | int = "ok"
        self.commit = True
        self.hold: asyncio.Event | None = None  # set: Bindings wait for it before anything happens
        self.arrivals: list[tuple[float, str, str]] = []  # (time.monotonic(), method, path) of every write
        self.written: list[tuple[str, str, dict[str, Any]]] = []  # (method, path, body) of every other write
        self.refuse: dict[str, int] = {}  # pod name -> the status its Bindings are refused with
        self.refuse_evictions: dict[str, int] = {}  # pod name -> the status its Evictions are refused with (429)
        self.partitioned = False  # True: requests are held undelivered (a black hole); dropped if the client goes
        self.reads = 0
        self.lists = 0
        self.pages: dict[str, tuple[list[dict[str, Any]], str]] = {}  # continue token -> the rest of a list
        self.page_requests = 0  # LIST requests, every page counted
        self.scale_answers: list[int] = []  # statuses the next scale PATCHes are answered with (then as usual)
        self.replicas: list[int] = []  # spec.replicas of every scale PATCH committed, in order
        self._rv = itertools.count(1000)

    def version(self) -> str:
        return str(next(self._rv))

    def _list_page(self, request: web.Request) -> dict[str, Any]:
        """One page of a LIST: `limit` and `continue` as the API server has them (a continued list is
        the snapshot its first page was cut from, at that page's resourceVersion)."""
        token = request.query.get("continue")
        if token:
            items, version = self.pages.pop(token)
        else:
            self.lists += 1
            items, version = list(self.objects[request.path].values()), self.version()
        meta: dict[str, Any] = {"resourceVersion": version}
        limit = int(request.query.get("limit") or 0)
        if 0 < limit < len(items):
            rest = f"page-{len(self.pages)}-{self.page_requests}"
            self.pages[rest] = (items[limit:], version)
            items, meta["continue"] = items[:limit], rest
        self.page_requests += 1
        return {"items": items, "metadata": meta}

    def put(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store `obj` (a copy, with a new resourceVersion) and return what is stored."""
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = self.version()
        meta = stored["metadata"]
        self.objects.setdefault(path, {})[f"{meta.get('namespace', '')}/{meta['name']}"] = stored
        return stored

    def delete(self, path: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        del self.objects[path][f"{meta.get('namespace', '')}/{meta['name']}"]
        self.version()

    async def route(self, request: web.Request) -> web.StreamResponse:
        while self.partitioned:
            await asyncio.sleep(0.05)
            if request.transport is None or request.transport.is_closing():
                return web.Response()  # the client gave up during the partition: never delivered
        parts = request.path.strip("/").split("/")
        if request.method != "GET":
            self.arrivals.append((time.monotonic(), request.method, request.path))
        if "leases" in parts:
            return await self._lease(request, parts)
        if request.method == "POST" and parts[-1] == "bindings":
            body = json.loads(await request.read())  # it reached the server: held or not, it commits
            if self.hold is not None:
                await self.hold.wait()
            return await self._bind(request, parts[3], body)
        if request.method != "GET":
            self.written.append((request.method, request.path, json.loads(await request.read() or b"{}")))
        if request.method == "POST" and parts[-1] == "eviction" and parts[-2] in self.refuse_evictions:
            return web.json_response({"kind": "Status", "reason": "TooManyRequests",
                                      "message": "Cannot evict pod as it would violate the pod's disruption budget."},
                                     status=self.refuse_evictions[parts[-2]])
        if (parts[0] == "apis" and len(parts) >= 6 and parts[3] == "namespaces"
                and (request.method == "GET" or parts[-1] == "scale"
                     or (request.method == "PATCH" and len(parts) == 7))):
            return await self._namespaced(request, parts)
        if request.method == "PATCH" and len(parts) == 6 and parts[4] == "pods":
            return await self._patch_pod(request, parts[3], parts[5])
        if request.method == "GET" and len(parts) == 6 and parts[4] == "pods":
            if self.hold is not None:  # a slow server: a read queues behind the held Binding
                await self.hold.wait()
            self.reads += 1
            pod = self.objects[PODS].get(f"{parts[3]}/{parts[5]}")
            if pod is None:
                return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
            return web.json_response(pod)
        if request.method == "GET":
            if request.path not in self.objects:
                return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
            return web.json_response(self._list_page(request))
        return web.json_response({}, status=201)  # Events, status patches

    async def _namespaced(self, request: web.Request, parts: list[str]) -> web.StreamResponse:
        """/apis/<group>/<version>/namespaces/<ns>/<plural>[/<name>[/scale]]: objects stored under the
        cluster-wide list path /apis/<group>/<version>/<plural>. GET one or the namespace's list; PATCH
        .../deployments/<name>/scale sets spec.replicas under the resourceVersion precondition (409 when
        it is stale; `scale_answers` answers the next ones as told first)."""
        store = self.objects.get("/" + "/".join([*parts[:3], parts[5]]))
        namespace = parts[4]
        if store is None:
            return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
        if request.method == "GET" and len(parts) == 6:
            self.lists += 1
            items = [o for o in store.values() if o["metadata"].get("namespace") == namespace]
            return web.json_response({"items": items, "metadata": {"resourceVersion": self.version()}})
        obj = store.get(f"{namespace}/{parts[6]}")
        if obj is None:
            return web.json_response({"kind": "Status", "reason": "NotFound", "message": "not found"}, status=404)
        if request.method == "GET" and len(parts) == 7:
            self.reads += 1
            return web.json_response(obj)
        if request.method == "PATCH" and len(parts) == 7:  # a merge patch of labels, annotations, spec fields
            body = self.written[-1][2]
            meta = (body.get("metadata") or {})
            if meta.get("resourceVersion") not in (None, obj["metadata"]["resourceVersion"]):
                return web.json_response({"kind": "Status", "reason": "Conflict", "message": "modified"}, status=409)
            patched = copy.deepcopy(obj)
            patched.setdefault("spec", {}).update(body.get("spec") or {})
            for field in ("annotations", "labels"):
                values = patched["metadata"].setdefault(field, {})
                for k, v in (meta.get(field) or {}).items():
                    if v is None:
                        values.pop(k, None)
                    else:
                        values[k] = v
            return web.json_response(self.put("/" + "/".join([*parts[:3], parts[5]]), patched))
        if request.method == "PATCH" and parts[5] == "deployments" and parts[7:] == ["scale"]:
            if self.scale_answers:
                status = self.scale_answers.pop(0)
                return web.json_response({"kind": "Status", "reason": "Told", "message": "as told"}, status=status)
            body = json.loads(await request.read())
            if body.get("metadata", {}).get("resourceVersion") not in (None, obj["metadata"]["resourceVersion"]):
                return web.json_response({"kind": "Status", "reason": "Conflict", "message": (
                    "the object has been modified; please apply your changes to the latest version")}, status=409)
            scaled = copy.deepcopy(obj)
            scaled["spec"]["replicas"] = body["spec"]["replicas"]
            scaled["metadata"]["generation"] = scaled["metadata"].get("generation", 1) + 1
            self.put("/" + "/".join([*parts[:3], parts[5]]), scaled)
            self.replicas.append(body["spec"]["replicas"])
            return web.json_response({"spec": {"replicas": body["spec"]["replicas"]}})
        return web.json_response({"kind": "Status", "reason": "MethodNotAllowed"}, status=405)

    async def _patch_pod(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        """A merge patch of a pod's annotations (the UID, when given, must be the pod's: it is immutable)."""
        pod = self.objects[PODS].get(f"{namespace}/{name}")
        if pod is None:
            return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
        meta = json.loads(await request.read()).get("metadata") or {}
        if meta.get("uid") not in (None, pod["metadata"]["uid"]):
            return web.json_response({"kind": "Status", "reason": "Invalid", "message": "uid: field is immutable"},
                                     status=422)
        patched = copy.deepcopy(pod)
        patched["metadata"].setdefault("annotations", {}).update(meta.get("annotations") or {})
        return web.json_response(self.put(PODS, patched))

    async def _lease(self, request: web.Request, parts: list[str]) -> web.StreamResponse:
        path = "/" + "/".join(parts[:6])
        leases = self.objects.setdefault(path, {})
        if request.method == "GET":
            lease = leases.get(f"{parts[4]}/{parts[6]}")
            if lease is None:
                return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
            return web.json_response(lease)
        body = json.loads(await request.read())
        body["metadata"]["namespace"] = parts[4]
        return web.json_response(self.put(path, body), status=201 if request.method == "POST" else 200)

    async def _bind(self, request: web.Request, namespace: str, body: dict) -> web.StreamResponse:
        key = f"{namespace}/{body['metadata']['name']}"
        pod = self.objects[PODS][key]
        if body["metadata"]["name"] in self.refuse:
            return web.json_response({"kind": "Status", "reason": "Forbidden", "message": "refused"},
                                     status=self.refuse[body["metadata"]["name"]])
        if pod["spec"].get("nodeName"):
            return web.json_response({"kind": "Status", "reason": "Conflict", "message": (
                f"pod {key} is already assigned to node \"{pod['spec']['nodeName']}\"")}, status=409)
        if self.commit:
            bound = copy.deepcopy(pod)
            bound["spec"]["nodeName"] = body["target"]["name"]
            if body["metadata"].get("annotations"):  # as kube-apiserver does: the Binding's land on the pod
                bound["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
            self.put(PODS, bound)
            self.bindings.append((key, body["target"]["name"]))
        if self.answer == "lost":
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never reaches the client
        if isinstance(self.answer, int):
            return web.json_response({"kind": "Status", "message": "gateway timeout"}, status=self.answer)
        return web.json_response({}, status=201)


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[ApiServer, KubeApi]]:
    """An ApiServer on a free port of 127.0.0.1 and a KubeApi talking to it, both closed afterwards."""
    server = ApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    api = KubeApi(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
    try:
        yield server, api
    finally:
        api.close()
        await runner.cleanup()


async def settle(service: Any, rounds: int = 50) -> None:
    """Schedule whatever is queued and let the binds (and their reads) finish."""
    for _ in range(rounds):
        while (item := service.queue.pop()) is not None:
            service.schedule_one(item)
        await asyncio.sleep(0.02)
        if not service.binder._tasks and not len(service.queue):
            return
