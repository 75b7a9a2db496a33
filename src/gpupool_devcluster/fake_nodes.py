"""Fake GPU nodes for kwok: Node objects whose capacity, labels and inventory annotation are exactly what
the gpupool device plugin publishes for the same fake NVML profile.

The numbers come from `gpupool_deviceplugin.publication.node_publication_for_profile`, the device plugin's
own code: there is no second copy of a profile here. kwok then plays the kubelet of every node annotated
`kwok.x-k8s.io/node: fake` (see kwok-stages.yaml).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.raw import discard, read_json

if TYPE_CHECKING:
    from gpupool_deviceplugin.publication import NodePublication

FAKE_NODE_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}
PROFILE_LABEL = "gpupool.io/fake-node-profile"
FAKE_LABEL = "gpupool.io/fake-node"
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,200})?$")

Progress = Callable[[int, int], None]  # (done, total)


def publication_for_profile(
    profile: str, node_name: str | None = None, *, pod_identity: bool = True
) -> NodePublication:
    """What the device plugin publishes on a `profile` machine called `node_name` (the name seeds the
    GPU and MIG UUIDs, so a plugin later started for that node agrees on every ID)."""
    from gpupool_deviceplugin.publication import node_publication_for_profile

    try:
        return node_publication_for_profile(profile, node_name=node_name, pod_identity=pod_identity)
    except (ValueError, LookupError, FileNotFoundError) as exc:  # the plugin's ProfileError is a ValueError
        raise DevClusterError(str(exc)) from None


def available_profiles() -> list[str]:
    """The fake NVML profiles shipped with the device plugin."""
    from gpupool_deviceplugin.nvml.profile import profile_names

    return sorted(profile_names())


def fake_node_manifest(name: str, profile: str, publication: NodePublication) -> dict[str, Any]:
    """A Node as the kubelet + device plugin of a `profile` machine would register it, marked for kwok."""
    resources = {**publication.host_capacity, **publication.capacity}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                FAKE_LABEL: "true",
                PROFILE_LABEL: profile,
                **publication.labels,
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **publication.annotations, **FAKE_NODE_ANNOTATION},
        },
        # no taint: every node of the dev cluster is fake, so ordinary pods may land on them
        "spec": {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def next_free_names(core: client.CoreV1Api, prefix: str, count: int) -> list[str]:
    """`count` names `<prefix><index>` after the highest index already used with this prefix."""
    if count <= 0:
        raise DevClusterError(f"--count must be at least 1, not {count}")
    if not _PREFIX.match(prefix):
        raise DevClusterError(f"bad node name prefix {prefix!r}: use lowercase letters, digits, '-' and '.'")
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    used = [int(m.group(1)) for name in list_node_names(core) if (m := pattern.match(name))]
    first = max(used, default=-1) + 1
    width = max(4, len(str(first + count - 1)))
    return [f"{prefix}{index:0{width}d}" for index in range(first, first + count)]


def list_node_names(core: client.CoreV1Api, label_selector: str = "") -> list[str]:
    listing = read_json(core.list_node(label_selector=label_selector, _preload_content=False))
    return [item["metadata"]["name"] for item in listing["items"]]


def create_fake_nodes(
    core: client.CoreV1Api, profile: str, names: list[str], *, concurrency: int = 32, progress: Progress | None = None
) -> None:
    """Create one fake `profile` node per name, concurrently. Each worker builds its node's publication
    (a few ms of CPU) while others wait on the apiserver; responses are not decoded, which is where
    the Python client would otherwise spend its time."""
    publication_for_profile(profile)  # an unknown profile fails here, before anything is created

    def create(name: str) -> None:
        body = fake_node_manifest(name, profile, publication_for_profile(profile, node_name=name))
        discard(core.create_node(body=body, _preload_content=False))

    _run_concurrently(create, names, concurrency=concurrency, progress=progress, what="create node")


def delete_nodes(
    core: client.CoreV1Api, names: Iterable[str], *, concurrency: int = 32, progress: Progress | None = None
) -> None:
    """Delete nodes by name; nodes already gone are fine."""

    def delete(name: str) -> None:
        try:
            discard(core.delete_node(name, _preload_content=False))
        except ApiException as exc:
            if exc.status != 404:
                raise

    _run_concurrently(delete, list(names), concurrency=concurrency, progress=progress, what="delete node")


def wait_nodes_ready(
    core: client.CoreV1Api, names: Iterable[str], *, timeout_s: float, progress: Progress | None = None
) -> None:
    """Block until every named node has condition Ready=True: one list, then a watch from its
    resourceVersion (listing again if the watch expires), never polling."""
    pending = set(names)
    total = len(pending)
    deadline = time.monotonic() + timeout_s
    selector = f"{FAKE_LABEL}=true"
    version: str | None = None
    while pending:
        if version is None:
            listing = read_json(core.list_node(label_selector=selector, _preload_content=False))
            pending -= {item["metadata"]["name"] for item in listing["items"] if _is_ready(item)}
            version = listing["metadata"]["resourceVersion"]
        if progress:
            progress(total - len(pending), total)
        left = deadline - time.monotonic()
        if not pending:
            break
        if left <= 0:
            sample = ", ".join(sorted(pending)[:3])
            raise DevClusterError(
                f"{len(pending)} of {total} nodes not Ready after {timeout_s:.0f}s "
                f"(e.g. {sample}); is kwok running? see its log"
            )
        stream = core.list_node(
            label_selector=selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=max(1, int(min(left, 30))),
            _preload_content=False,
        )
        try:
            for line in stream:
                event = json.loads(line)
                if event["type"] == "ERROR":  # e.g. 410 Gone: the version is too old; list again
                    version = None
                    break
                version = event["object"]["metadata"]["resourceVersion"]
                name = event["object"]["metadata"].get("name")
                if event["type"] in ("ADDED", "MODIFIED") and name in pending and _is_ready(event["object"]):
                    pending.discard(name)
                    if progress:
                        progress(total - len(pending), total)
                    if not pending:
                        break
        finally:
            stream.close()  # a watch left unread must not go back to the pool as a live connection
            stream.release_conn()


def _is_ready(node: dict[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _run_concurrently(
    action: Callable[[Any], object], items: list[Any], *, concurrency: int, progress: Progress | None, what: str
) -> None:
    if not items:
        return
    lock = threading.Lock()
    done = 0

    def one(item: Any) -> None:
        nonlocal done
        try:
            action(item)
        except ApiException as exc:
            raise DevClusterError(f"{what} {item}: {_api_reason(exc)}") from None
        with lock:
            done += 1
            if progress:
                progress(done, len(items))

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(items)))) as pool:
        for future in [pool.submit(one, item) for item in items]:
            future.result()


def _api_reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"HTTP {exc.status} {exc.reason}"
