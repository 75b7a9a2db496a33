"""Kubernetes objects as JSON, as the API server returns them, built by hand for tests that feed them to the
scheduler's ledger (nodes, pods, GpuQuotas, namespaces) or to the device plugin's pod records (pods with an
assignment). resourceVersions and uids come from counters of this module: each object gets a later one.

Nothing here talks to a server: the builders of what a test creates on a cluster are in scheduler_harness.py.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from gpupool_common.handshake import Assignment, ContainerAssignment, MemoryShare, assignment_annotations
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_sched.framework.plugins.quotas import GROUP, VERSION

_uids = itertools.count()
_rv = itertools.count(100)


# ---- for the scheduler's ledger ------------------------------------------------------------------
def node_obj(name: str, profile: str = "l40s-pcie", *, pod_identity: bool = True, **spec: Any) -> dict[str, Any]:
    pub = node_publication_for_profile(profile, node_name=name, pod_identity=pod_identity)
    resources = {**pub.host_capacity, **pub.capacity}
    return {
        "metadata": {"name": name, "labels": dict(pub.labels), "annotations": dict(pub.annotations),
                     "resourceVersion": str(next(_rv))},
        "spec": dict(spec),
        "status": {"capacity": resources, "allocatable": resources},
    }


def pod_obj(
    name: str, *, gpus: int = 0, units: int = 0, node: str | None = None, scheduler: str = "gpupool",
    phase: str = "Pending", uid: str | None = None, annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    limits = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if units:
        limits["nvidia.com/gpu-memory"] = str(units)
    spec: dict[str, Any] = {"schedulerName": scheduler, "containers": [
        {"name": "main", "resources": {"limits": limits, "requests": {"cpu": "1", "memory": "1Gi", **limits}}}]}
    if node:
        spec["nodeName"] = node
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{next(_uids)}",
                     "resourceVersion": str(next(_rv)), "creationTimestamp": "2026-11-30T10:00:00Z",
                     "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {"phase": phase},
    }


def bump(obj: dict[str, Any], **changes: Any) -> dict[str, Any]:
    new = copy.deepcopy(obj)
    new["metadata"]["resourceVersion"] = str(next(_rv))
    for key, value in changes.items():
        if key == "phase":
            new["status"]["phase"] = value
        elif key == "node":
            new["spec"]["nodeName"] = value
        elif key == "annotations":
            new["metadata"]["annotations"].update(value)
    return new


def nominated(obj: dict[str, Any], node: str | None) -> dict[str, Any]:
    out = bump(obj)
    out.setdefault("status", {})["nominatedNodeName"] = node
    return out


def terminating(obj: dict[str, Any], grace_s: int | None = None) -> dict[str, Any]:
    out = bump(obj)
    out["metadata"]["deletionTimestamp"] = "2026-12-01T11:00:00Z"
    if grace_s is not None:
        out["metadata"]["deletionGracePeriodSeconds"] = grace_s
    return out


def quota_obj(name: str, spec: dict[str, Any], *, generation: int = 1, uid: str = "u1",
              status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota",
                           "metadata": {"name": name, "uid": uid, "generation": generation}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def team_spec(team: str, gpus: int, units: int = 0, borrow: int = 0, borrow_units: int = 0) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"team": team}}, "guaranteed": {"gpus": gpus, "memoryUnits": units},
            "borrowingLimit": {"gpus": borrow, "memoryUnits": borrow_units}}


def ns_obj(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


# ---- for the device plugin's pod records -----------------------------------------------------------
def pod_json(name: str, uid: str, node: str, containers: dict[str, dict[str, int]], *,
             init: dict[str, dict[str, int]] | None = None, created: str = "2026-01-01T00:00:00Z",
             phase: str = "Pending", annotations: dict[str, str] | None = None, rv: str = "1") -> dict[str, Any]:
    def spec(cname: str, req: dict[str, int]) -> dict[str, Any]:
        return {"name": cname, "image": "x", "resources": {"limits": {k: str(v) for k, v in req.items()}}}

    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "creationTimestamp": created,
                     "resourceVersion": rv, "annotations": annotations or {}},
        "spec": {"nodeName": node, "containers": [spec(c, r) for c, r in containers.items()],
                 "initContainers": [spec(c, r) for c, r in (init or {}).items()]},
        "status": {"phase": phase},
    }


def assignment(node: str, uid: str, containers: dict[str, dict[str, Any]]) -> dict[str, str]:
    """containers: name -> {"devices": {resource: [ids]}, "memory": (gpu, units, unit_mib)}."""
    out = []
    for name, spec in containers.items():
        mem = spec.get("memory")
        out.append(ContainerAssignment(name=name, devices={r: tuple(i) for r, i in spec.get("devices", {}).items()},
                                       memory=MemoryShare(gpu=mem[0], units=mem[1], unit_mib=mem[2]) if mem else None))
    return assignment_annotations(Assignment(node=node, pod_uid=uid, containers=tuple(out)))
