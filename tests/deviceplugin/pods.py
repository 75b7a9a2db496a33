"""Pod JSON as the API server returns it, for feeding the plugin's pod records in tests."""

from __future__ import annotations

from typing import Any

from gpupool_common.handshake import Assignment, ContainerAssignment, MemoryShare, assignment_annotations


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
