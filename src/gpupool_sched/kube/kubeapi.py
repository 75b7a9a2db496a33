"""Every call the scheduler makes to the API server (the kopf watch aside).

Writes (Bindings, Events, status patches, evictions) go out from one thread of their own running an
aiohttp session (`apiwriter.py`): the cycle never waits on an API round trip, many writes are in
flight at once, and each costs a third of the CPU it did through the `kubernetes` client on a thread
pool (see docs/benchmarks.md). Reads (LISTs at start-up, leases) are few and stay on the client,
on a small thread pool, and skip its model objects (building them for thousands of pods costs more
than the calls themselves).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_sched.writer.apiwriter import ApiWriter, Fence, Fenced, Lane

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

log = logging.getLogger(__name__)
T = TypeVar("T")
REQUEST_TIMEOUT_S = 15
MAX_MESSAGE = 1024  # of an Event's or a condition's message
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # int32; a ReplicaSet removes lower costs first


class ApiError(Exception):
    """A failed API call: HTTP status (0: no answer) and the server's message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_body(cls, status: int, reason: str, raw: bytes | str | None) -> ApiError:
        """From an HTTP answer: the Status object's reason and message when the body is one."""
        message = reason
        try:
            body = json.loads(raw or b"{}")
            if isinstance(body, dict):
                message = body.get("message") or message
                reason = body.get("reason") or reason
        except ValueError:
            pass  # not a Status object: the HTTP reason says it
        return cls(status, reason or "Error", str(message))

    @classmethod
    def from_exception(cls, exc: Exception) -> ApiError:
        if isinstance(exc, ApiException):
            return cls.from_body(int(exc.status or 0), str(exc.reason or ""), exc.body)
        return cls(0, type(exc).__name__, str(exc))

    @property
    def kind(self) -> str:
        """A short label for metrics: conflict, not_found, forbidden, timeout, server, other."""
        return {409: "conflict", 404: "not_found", 403: "forbidden", 422: "invalid", 429: "throttled"}.get(
            self.status, "server" if self.status >= 500 else ("unreachable" if self.status == 0 else "other")
        )


def now_rfc3339(micro: bool = False) -> str:
    t = datetime.now(UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


DEFAULT_WORKERS = 16  # writes on the wire at once, and threads for reads


class KubeApi:
    def __init__(self, api_client: client.ApiClient, *, workers: int = DEFAULT_WORKERS,
                 component: str = "gpupool") -> None:
        """`workers`: writes on the wire at once (more wait their turn), and threads for reads."""
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.component = component
        self.identity = component
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kubeapi")
        self._writer = ApiWriter(api_client.configuration, getattr(api_client, "user_agent", None))
        self._lane: Lane = self._writer.lane(workers)
        self.fence = Fence()  # shared with every lane: a leader's write window (scheduler/leader.py)
        self._owner = True

    def lane(self, workers: int) -> KubeApi:
        """The same client and credentials with a write limit of its own: writes made through the
        lane never queue behind this one's (Events and status reports behind a burst of Bindings)."""
        other = copy.copy(self)
        other._lane = self._writer.lane(workers)
        other._owner = False
        return other

    def close(self) -> None:
        if not self._owner:
            return
        self._writer.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` (a blocking call through the `kubernetes` client) on the read threads."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except ApiError:
            raise
        except (ApiException, OSError, ValueError) as exc:
            raise ApiError.from_exception(exc) from None
        except Exception as exc:  # urllib3 errors and the like
            raise ApiError.from_exception(exc) from None

    async def write(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str = JSON) -> None:
        """A write whose answer is not needed; ApiError on failure (status 0: no answer; reason NotLeader:
        not sent, the write window had closed). Its timeout counts from when its turn on the lane comes,
        and ends at the latest when the write window closes."""
        try:
            answer = await self._lane.send(method, api_path, body, content_type, REQUEST_TIMEOUT_S,
                                           self.fence.window)
        except Fenced as exc:
            raise ApiError(0, "NotLeader", f"not sent: {exc}") from None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from None
        if not 200 <= answer.status < 300:
            raise ApiError.from_body(answer.status, answer.reason, answer.body)

    # ---- reads ---------------------------------------------------------------------------------
    def list_raw_sync(
        self, path: str, page: int = 500, params: tuple[tuple[str, str], ...] = ()
    ) -> tuple[list[dict[str, Any]], str]:
        """All objects at `path` (paginated) and the list's resourceVersion; `params`: further query
        parameters, e.g. (("labelSelector", "pool=a"),)."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        version = ""
        while True:
            query: list[tuple[str, Any]] = [("limit", page), *params]
            if cont:
                query.append(("continue", cont))
            body = self._get(path, query, timeout_s=60)
            items.extend(body.get("items") or ())
            meta = body.get("metadata") or {}
            version = meta.get("resourceVersion", version)
            cont = meta.get("continue")
            if not cont:
                return items, version

    async def list_raw(self, path: str) -> tuple[list[dict[str, Any]], str]:
        return await self.call(self.list_raw_sync, path)

    async def list_pages(self, path: str, page: int = 500) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        """The objects at `path` a page at a time, each with the list's resourceVersion (every page of
        one list has the first page's): client-go's pager, so that a caller that needs each object once
        never holds the whole list (10,000 pods are ~100 MiB as parsed JSON)."""
        cont: str | None = None
        while True:
            query: list[tuple[str, Any]] = [("limit", page)]
            if cont:
                query.append(("continue", cont))
            body = await self.call(self._get, path, query, timeout_s=60)
            meta = body.get("metadata") or {}
            yield body.get("items") or [], str(meta.get("resourceVersion") or "")
            cont = meta.get("continue")
            if not cont:
                return

    async def read_pod(self, namespace: str, name: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """The pod as the API server has it now (ApiError 404: it is gone)."""
        return await self.call(self._get, path("api", "v1", "namespaces", namespace, "pods", name), [],
                               timeout_s=timeout_s)

    async def read_object(self, api_path: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """One object (or one namespace's list) at `api_path` as the API server has it now (ApiError 404:
        not there, or the kind is not served). `deployment_path` and friends build the paths."""
        return await self.call(self._get, api_path, [], timeout_s=timeout_s)

    def server_version_sync(self, timeout_s: float = 5.0) -> str:
        return str(self._get("/version", [], timeout_s=timeout_s).get("gitVersion", "?"))

    def _get(self, path: str, query: list[tuple[str, Any]], *, timeout_s: float) -> dict[str, Any]:
        """GET `path` as JSON, without the client's model decoding."""
        method, url, headers, body, post = self.api_client.param_serialize(
            method="GET", resource_path=path, query_params=query,
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        )
        resp = self.api_client.call_api(method, url, header_params=headers, body=body, post_params=post,
                                        _request_timeout=timeout_s)
        resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp)
        return json.loads(resp.data)

    # ---- writes --------------------------------------------------------------------------------
    async def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None:
        """POST the Binding; its annotations land on the pod in the same write as spec.nodeName. The
        UID makes the API server refuse a pod that was replaced by a namesake meanwhile."""
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": dict(annotations)},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self.write("POST", path("api", "v1", "namespaces", namespace, "bindings"), body)

    async def post_event(
        self, pod: Mapping[str, str], *, kind: str, reason: str, message: str, action: str = "Scheduling",
        involved: tuple[str, str] = ("v1", "Pod"), event: str | None = None,
    ) -> None:
        """A core/v1 Event on the pod (or on the namespaced object of `involved`: apiVersion, kind), as
        kube-scheduler writes them; `event` names it (else the API server makes up a name)."""
        now = now_rfc3339()
        api_version, object_kind = involved
        meta = {"name": event} if event else {"generateName": f"{pod['name']}."}
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {**meta, "namespace": pod["namespace"]},
            "involvedObject": {"apiVersion": api_version, "kind": object_kind, "namespace": pod["namespace"],
                               "name": pod["name"], "uid": pod["uid"]},
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "type": kind,
            "action": action,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.identity,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self.write("POST", path("api", "v1", "namespaces", pod["namespace"], "events"), body)

    async def update_event_count(self, namespace: str, event: str, count: int) -> None:
        """The Event's `count` and `lastTimestamp`: the same report happened again."""
        await self.write("PATCH", path("api", "v1", "namespaces", namespace, "events", event),
                         {"count": count, "lastTimestamp": now_rfc3339()}, MERGE_PATCH)

    async def set_unschedulable(self, namespace: str, name: str, message: str) -> None:
        """PodScheduled=False, reason Unschedulable: what `kubectl describe` and autoscalers read."""
        patch = {"status": {"conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": message[:MAX_MESSAGE], "lastTransitionTime": now_rfc3339(),
        }]}}
        await self.write("PATCH", _pod_path(namespace, name, "status"), patch, STRATEGIC_MERGE_PATCH)

    async def evict(self, namespace: str, name: str, uid: str, grace_s: int | None) -> None:
        """POST a policy/v1 Eviction (a 429 ApiError: a PodDisruptionBudget forbids it now). The UID
        precondition spares a namesake that replaced the pod; `grace_s` None keeps the pod's own."""
        options: dict[str, Any] = {"preconditions": {"uid": uid}}
        if grace_s is not None:
            options["gracePeriodSeconds"] = grace_s
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace}, "deleteOptions": options}
        await self.write("POST", _pod_path(namespace, name, "eviction"), body)

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        """Merge-patch a pod's annotations (None removes one), e.g. a migration's record of its holds."""
        await self.write("PATCH", path("api", "v1", "namespaces", namespace, "pods", name),
                         {"metadata": {"annotations": dict(annotations)}}, MERGE_PATCH)

    async def set_nominated_node(self, namespace: str, name: str, node: str | None) -> None:
        """status.nominatedNodeName (None clears it), by a merge patch of the status."""
        await self.write("PATCH", _pod_path(namespace, name, "status"), {"status": {"nominatedNodeName": node}},
                         MERGE_PATCH)

    async def scale_deployment(self, namespace: str, name: str, replicas: int, resource_version: str) -> None:
        """A Deployment's spec.replicas, through its scale subresource (as `kubectl scale` and the HPA
        write it), only if the Deployment is still at `resource_version` (a 409 ApiError: it changed since
        it was read; read it again and decide again)."""
        await self.write("PATCH", deployment_path(namespace, name) + "/scale",
                         {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}},
                         MERGE_PATCH)

    async def set_autoscaler_max(self, namespace: str, name: str, max_replicas: int, resource_version: str) -> None:
        """A HorizontalPodAutoscaler's spec.maxReplicas (elastic inference lends room through it), only if
        the HPA is still at `resource_version` (409 otherwise)."""
        await self.write("PATCH", autoscalers_path(namespace) + "/" + quote(name, safe=""),
                         {"metadata": {"resourceVersion": resource_version}, "spec": {"maxReplicas": max_replicas}},
                         MERGE_PATCH)

    async def mark_replica_set(self, namespace: str, name: str, annotations: Mapping[str, str | None],
                               labels: Mapping[str, str | None]) -> None:
        """Merge-patch a ReplicaSet's annotations and labels (None removes one), e.g. a surge's record (on
        the ReplicaSet, not its Deployment: a Deployment's annotations bump its generation, a ReplicaSet's
        do not)."""
        await self.write("PATCH", replica_set_path(namespace, name),
                         {"metadata": {"annotations": dict(annotations), "labels": dict(labels)}}, MERGE_PATCH)

    async def set_deletion_cost(self, namespace: str, name: str, uid: str, cost: int) -> None:
        """The pod's `controller.kubernetes.io/pod-deletion-cost` annotation: its ReplicaSet removes pods
        of lower cost first when it scales down (among pods equally placed, running and ready). The UID
        makes the API server refuse a namesake that replaced the pod (the UID is immutable)."""
        await self.write("PATCH", path("api", "v1", "namespaces", namespace, "pods", name),
                         {"metadata": {"uid": uid, "annotations": {DELETION_COST: str(cost)}}}, MERGE_PATCH)

    async def patch_custom_status(
        self, group: str, version: str, plural: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """Merge-patch the status subresource of a namespaced custom object (e.g. a PodGroup)."""
        await self.write("PATCH", path("apis", group, version, "namespaces", namespace, plural, name, "status"),
                         {"status": dict(status)}, MERGE_PATCH)

    async def patch_cluster_custom_status(
        self, group: str, version: str, plural: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """Merge-patch the status subresource of the cluster-scoped custom resource `name` (lists in
        `status` replace the stored ones whole)."""
        await self.write("PATCH", path("apis", group, version, plural, name, "status"), {"status": dict(status)},
                         MERGE_PATCH)

    # ---- leases (leader election) ---------------------------------------------------------------
    def read_lease_sync(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = self.coordination.read_namespaced_lease(name, namespace, _preload_content=False,
                                                           _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def write_lease_sync(self, namespace: str, lease: dict[str, Any], create: bool) -> dict[str, Any]:
        name = lease["metadata"]["name"]
        if create:
            resp = self.coordination.create_namespaced_lease(namespace, lease, _preload_content=False,
                                                             _request_timeout=REQUEST_TIMEOUT_S)
        else:
            resp = self.coordination.replace_namespaced_lease(name, namespace, lease, _preload_content=False,
                                                              _request_timeout=REQUEST_TIMEOUT_S)
        return json.loads(resp.data)


def deployment_path(namespace: str, name: str) -> str:
    return path("apis", "apps", "v1", "namespaces", namespace, "deployments", name)


def replica_set_path(namespace: str, name: str) -> str:
    return path("apis", "apps", "v1", "namespaces", namespace, "replicasets", name)


def autoscalers_path(namespace: str) -> str:
    """The namespace's HorizontalPodAutoscalers (autoscaling/v2)."""
    return path("apis", "autoscaling", "v2", "namespaces", namespace, "horizontalpodautoscalers")


def _pod_path(namespace: str, name: str, subresource: str) -> str:
    return path("api", "v1", "namespaces", namespace, "pods", name, subresource)


def path(*parts: str) -> str:
    """An API path from segments, each percent-encoded."""
    return "/" + "/".join(quote(p, safe="") for p in parts)
