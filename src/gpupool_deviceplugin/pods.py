"""The device plugin's view of a pod bound to its node: containers, device requests, handshake state.

Built from the API server's JSON (the raw dicts of the pod watch), so no client model is involved.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpupool_common.handshake import (
    AllocationAck,
    Assignment,
    HandshakeError,
    parse_ack,
    parse_assignment,
)

TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    init: bool
    sidecar: bool  # init container with restartPolicy Always: its devices are never reused
    requests: Mapping[str, int]  # device-plugin resources only


@dataclass(frozen=True)
class PodRecord:
    uid: str
    namespace: str
    name: str
    node: str
    created: float  # creationTimestamp, seconds since the epoch
    resource_version: str
    terminal: bool
    containers: tuple[ContainerSpec, ...]  # kubelet order: init containers, then app containers
    assignment: Assignment | None = None
    assignment_error: str | None = None
    ack: AllocationAck | None = None
    annotations: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # the latest start of its running containers (seconds since the epoch); None while none runs
    started: float | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def requests(self, resource: str) -> bool:
        return any(c.requests.get(resource, 0) > 0 for c in self.containers)


def _timestamp(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _quantity(value: Any) -> int:
    """Extended resources are integers; anything else counts as 0 (the API server rejects it anyway)."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def _requests(container: Mapping[str, Any], resources: Collection[str]) -> dict[str, int]:
    res = container.get("resources") or {}
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    out = {}
    for name in resources:
        value = limits.get(name, requests.get(name))
        if value is not None and _quantity(value) > 0:
            out[name] = _quantity(value)
    return out


def _started(status: Mapping[str, Any]) -> float | None:
    """The latest startedAt of the running containers (init containers included: sidecars), None if none runs.
    A restarted container starts later: the idle sampler's start grace begins again."""
    starts = [_timestamp(((c.get("state") or {}).get("running") or {}).get("startedAt"))
              for key in ("initContainerStatuses", "containerStatuses") for c in status.get(key) or ()
              if ((c.get("state") or {}).get("running") or {}).get("startedAt")]
    return max(starts) if starts else None


def pod_record(obj: Mapping[str, Any], resources: Collection[str], node: str) -> PodRecord:
    """A PodRecord from the pod's JSON; a bad assignment annotation is kept as `assignment_error`."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    annotations = dict(meta.get("annotations") or {})
    containers = [
        ContainerSpec(c["name"], True, c.get("restartPolicy") == "Always", _requests(c, resources))
        for c in spec.get("initContainers") or ()
    ] + [ContainerSpec(c["name"], False, False, _requests(c, resources)) for c in spec.get("containers") or ()]
    uid = meta.get("uid", "")
    assignment = ack = None
    error = None
    try:
        assignment = parse_assignment(annotations)
        if assignment is not None:
            error = _check_assignment(assignment, uid, node, containers)
            if error:
                assignment = None
    except HandshakeError as exc:
        error = str(exc)
    try:
        ack = parse_ack(annotations)
    except HandshakeError:
        ack = None  # our own annotation; a bad one is simply rewritten
    return PodRecord(
        uid=uid,
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        node=spec.get("nodeName") or "",
        created=_timestamp(meta.get("creationTimestamp")),
        resource_version=meta.get("resourceVersion", ""),
        terminal=status.get("phase") in TERMINAL_PHASES,
        containers=tuple(containers),
        assignment=assignment,
        assignment_error=error,
        ack=ack,
        annotations=annotations,
        started=_started(status),
    )


def _check_assignment(a: Assignment, uid: str, node: str, containers: list[ContainerSpec]) -> str | None:
    """Why an assignment cannot be used for this pod on this node, or None."""
    if a.node != node:
        return f"assignment is for node {a.node!r}, this is {node!r}"
    if a.pod_uid != uid:
        return f"assignment is for pod UID {a.pod_uid}, this pod is {uid} (copied annotation?)"
    by_name = {c.name: c for c in containers}
    for ca in a.containers:
        spec = by_name.get(ca.name)
        if spec is None:
            return f"assignment names container {ca.name!r}, which the pod does not have"
        for resource, ids in ca.devices.items():
            if spec.requests.get(resource, 0) != len(ids):
                return (f"container {ca.name!r}: assignment gives {len(ids)} {resource} but the container "
                        f"requests {spec.requests.get(resource, 0)}")
        if ca.memory is not None:
            want = spec.requests.get("nvidia.com/gpu-memory", 0)
            if want != ca.memory.units:
                return (f"container {ca.name!r}: assignment gives {ca.memory.units} nvidia.com/gpu-memory "
                        f"but the container requests {want}")
    for spec in containers:
        given = a.container(spec.name)
        for resource in spec.requests:
            covered = given is not None and (
                given.memory is not None if resource == "nvidia.com/gpu-memory" else resource in given.devices)
            if not covered:
                return f"container {spec.name!r} requests {resource} but the assignment gives it none"
    return None
