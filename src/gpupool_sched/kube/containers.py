"""A pod's containers (kube/podspec.py): each one's device-plugin resources (`ContainerDemand`),
their checks, and the pod's effective requests as kube-scheduler computes them (Kubernetes >= 1.29,
with restartable init containers; spec.resources when set). Device resources follow docs/gpu-pool.md
and the handshake's rule 3 for init containers (docs/handshake.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.kube.pod_input import _amount, _devices, _Findings, _list, _map, _resource_map, _show, _text
from gpupool_sched.model.request import MILLI

RESOURCE_GPU = "nvidia.com/gpu"
RESOURCE_MEMORY = "nvidia.com/gpu-memory"
MIG_PREFIX = "nvidia.com/mig-"


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """One container's plugin resources (device counts)."""

    name: str
    init: bool
    sidecar: bool  # init container with restartPolicy Always: keeps its devices, like an app container
    gpus: int = 0
    memory_units: int = 0
    mig: tuple[tuple[str, int], ...] = ()  # (profile, devices), sorted by profile

    @property
    def wants_devices(self) -> bool:
        return bool(self.gpus or self.memory_units or self.mig)

    @property
    def reuses_devices(self) -> bool:
        """A non-restartable init container: its devices go on to the next container of the resource."""
        return self.init and not self.sidecar

    def counts(self) -> dict[str, int]:
        """Device count per plugin resource name."""
        out = {RESOURCE_GPU: self.gpus, RESOURCE_MEMORY: self.memory_units}
        out.update((MIG_PREFIX + p, n) for p, n in self.mig)
        return {r: n for r, n in out.items() if n > 0}


def _containers(spec: Mapping[str, Any], f: _Findings) -> list[tuple[ContainerDemand, dict[str, int]]]:
    """Every container in kubelet order with its demand and its amounts (cpu milli, memory MiB, devices)."""
    out: list[tuple[ContainerDemand, dict[str, int]]] = []
    seen: set[str] = set()
    for key, init in (("initContainers", True), ("containers", False)):
        for i, c in enumerate(_list(spec.get(key), f"spec.{key}", f)):
            where = f"spec.{key}[{i}]"
            if not isinstance(c, Mapping):
                f.bad(f"{where} is not an object")
                continue
            name = c.get("name")
            if not _text(name):
                f.bad(f"{where} has no name")
                name = where
            elif name in seen:
                f.bad(f"container name {_show(name)} is used twice")
            seen.add(name)
            sidecar = False
            if init and c.get("restartPolicy") is not None:
                if c.get("restartPolicy") not in ("Always",):
                    f.bad(f"init container {_show(name)}: restartPolicy {_show(c.get('restartPolicy'))} "
                          "is not supported (only Always)")
                sidecar = c.get("restartPolicy") == "Always"
            out.append(_container(name, init, sidecar, c, f))
    if not any(not d.init for d, _ in out):
        f.bad("the pod has no containers")
    return out


def _container(
    name: str, init: bool, sidecar: bool, c: Mapping[str, Any], f: _Findings
) -> tuple[ContainerDemand, dict[str, int]]:
    who = f"container {_show(name)}"
    res = _map(c.get("resources"), f"{who}: resources", f)
    limits = _resource_map(res.get("limits"), f"{who}: resources.limits", f)
    requests = _resource_map(res.get("requests"), f"{who}: resources.requests", f)
    amounts: dict[str, int] = {}
    for resource, scale in (("cpu", MILLI), ("memory", 0)):
        kind, value = ("request", requests[resource]) if resource in requests else ("limit", limits.get(resource))
        amounts[resource] = _amount(value, f"{who}: {resource} {kind}", scale, f)
    gpus = units = 0
    mig: dict[str, int] = {}
    for resource in sorted(set(limits) | set(requests)):
        if not _plugin_resource(resource):
            continue
        value = limits[resource] if resource in limits else requests[resource]
        n = _devices(value, f"{who}: {resource}", f)
        if resource == RESOURCE_GPU:
            gpus = n
        elif resource == RESOURCE_MEMORY:
            units = n
        elif not resource[len(MIG_PREFIX):]:
            f.bad(f"{who}: {resource} names no MIG profile")
            continue
        elif n:
            mig[resource[len(MIG_PREFIX):]] = n
        if n:
            amounts[resource] = n
    if gpus and units:
        f.bad(f"{who} asks for both {RESOURCE_GPU} and {RESOURCE_MEMORY}; put them in separate containers")
    elif sum(1 for n in (gpus, units, *mig.values()) if n) > 1:
        # each resource's Allocate answer sets NVIDIA_VISIBLE_DEVICES and the kubelet keeps only one of
        # them, so the container would see only part of its devices (found with the real devicemanager)
        kinds = [r for r, n in ((RESOURCE_GPU, gpus), (RESOURCE_MEMORY, units)) if n]
        kinds += [f"{MIG_PREFIX}{p}" for p in sorted(mig)]
        f.bad(f"{who} asks for {', '.join(kinds)}: a container gets devices of one GPU resource only "
              "(the kubelet keeps one NVIDIA_VISIBLE_DEVICES); put them in separate containers")
    demand = ContainerDemand(name, init, sidecar, gpus, units, tuple(sorted(mig.items())))
    return demand, amounts


def _plugin_resource(resource: str) -> bool:
    return resource in (RESOURCE_GPU, RESOURCE_MEMORY) or resource.startswith(MIG_PREFIX)


def _check_reuse(demands: tuple[ContainerDemand, ...], f: _Findings) -> None:
    """Handshake rule 3: a non-restartable init container's devices are a subset of those of the next
    container that requests the same resource (the kubelet hands them on to it)."""
    for i, d in enumerate(demands):
        if not d.reuses_devices:
            continue
        for resource, n in d.counts().items():
            nxt = next((c for c in demands[i + 1:] if c.counts().get(resource, 0) > 0), None)
            if nxt is None:
                f.bad(f"init container {_show(d.name)} asks for {n} {resource} but no later container does; "
                      "an init container's devices must go on to the next container that requests the "
                      "same resource")
            elif nxt.counts()[resource] < n:
                f.bad(f"init container {_show(d.name)} asks for {n} {resource}, more than the "
                      f"{nxt.counts()[resource]} of the next container asking for it ({_show(nxt.name)}); "
                      "an init container's devices must be a subset of that container's")


def _aggregate(demands: tuple[ContainerDemand, ...], amounts: list[dict[str, int]]) -> dict[str, int]:
    """kube-scheduler's pod requests (Kubernetes >= 1.29): max(init containers, sum of app containers),
    where sidecars add to the sum and every later init container runs beside the sidecars before it."""
    total: dict[str, int] = {}
    for d, a in zip(demands, amounts, strict=True):
        if not d.init:
            _add(total, a)
    sidecars: dict[str, int] = {}
    init_max: dict[str, int] = {}
    for d, a in zip(demands, amounts, strict=True):
        if not d.init:
            continue
        if d.sidecar:
            _add(total, a)
            _add(sidecars, a)
            running = dict(sidecars)
        else:
            running = dict(a)
            _add(running, sidecars)
        for r, n in running.items():
            init_max[r] = max(init_max.get(r, 0), n)
    for r, n in init_max.items():
        total[r] = max(total.get(r, 0), n)
    return total


def _add(into: dict[str, int], other: Mapping[str, int]) -> None:
    for r, n in other.items():
        into[r] = into.get(r, 0) + n


def _pod_level_resources(spec: Mapping[str, Any], total: dict[str, int], f: _Findings) -> None:
    """spec.resources (PodLevelResources, beta in 1.34): when set, it replaces the containers' sum."""
    if spec.get("resources") is None:
        return
    res = _map(spec.get("resources"), "spec.resources", f)
    limits = _resource_map(res.get("limits"), "spec.resources.limits", f)
    requests = _resource_map(res.get("requests"), "spec.resources.requests", f)
    for resource, scale in (("cpu", MILLI), ("memory", 0)):
        value = requests[resource] if resource in requests else limits.get(resource)
        if value is not None:
            total[resource] = _amount(value, f"spec.resources.{resource}", scale, f)
