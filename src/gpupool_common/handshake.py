"""The assignment handshake between gpupool's scheduler and the device plugin (protocol version 1).

The kubelet's Allocate call carries device IDs but no pod identity, so the scheduler says up front
which devices each container gets, and the plugin steers the kubelet to exactly those devices.

1. At bind time the scheduler writes `gpupool.io/assignment` on the pod, preferably in the Binding's
   own metadata.annotations (the API server copies them onto the pod together with spec.nodeName, so
   no observer ever sees the pod bound without its assignment). JSON, `Assignment` below: per
   container, in spec order (init containers first), the exact device IDs per resource; for
   nvidia.com/gpu-memory the GPU and a unit count.
2. The plugin watches the pods bound to its node. The kubelet admits one pod at a time and allocates
   its containers in order (init containers, then app containers), calling GetPreferredAllocation
   then Allocate per container and resource. GetPreferredAllocation finds the pending container the
   request belongs to and returns its devices; Allocate maps the IDs it receives back to that one
   container, checks them against the node's state and records them.
3. The plugin acknowledges with `gpupool.io/allocated` on the pod (`AllocationAck`), off the gRPC path.

Only two pending pods with the same request shape, (resource, device count) of some container, can be
confused at step 2, because GetPreferredAllocation sees only the shape. The scheduler therefore must
not bind a pod to a node while an unacknowledged pod on that node shares a shape with it
(`shapes_conflict`); the gate is per (node, shape) and held until the ack (seconds), never a
node-wide lock. If it happens anyway the plugin uses the kubelet's PodResources pod list, else the order
of the binds (docs/handshake.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROTOCOL_VERSION: Final = 1
ASSIGNMENT_ANNOTATION = "gpupool.io/assignment"
ACK_ANNOTATION = "gpupool.io/allocated"
MEMORY_RESOURCE = "nvidia.com/gpu-memory"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemoryShare(_Model):
    """A share of one GPU's memory: `units` nvidia.com/gpu-memory devices of GPU `gpu`.

    Units of one GPU are interchangeable, so the scheduler names the GPU and the count and the plugin
    picks the unit IDs the kubelet has free; `unit_mib` guards against a scheduler and a plugin that
    disagree on the unit size."""

    gpu: str = Field(min_length=1, description="GPU UUID")
    units: int = Field(gt=0)
    unit_mib: int = Field(gt=0)


class ContainerAssignment(_Model):
    name: str = Field(min_length=1)
    # resource name -> exact kubelet device IDs: GPU UUIDs for nvidia.com/gpu, MIG UUIDs for
    # nvidia.com/mig-<profile> (and for nvidia.com/gpu under migStrategy=single)
    devices: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    memory: MemoryShare | None = None

    @model_validator(mode="after")
    def _valid(self) -> ContainerAssignment:
        if MEMORY_RESOURCE in self.devices:
            raise ValueError(f"{MEMORY_RESOURCE} goes in `memory`, not in `devices`")
        for resource, ids in self.devices.items():
            if not ids or len(set(ids)) != len(ids):
                raise ValueError(f"devices[{resource!r}] must be a non-empty list of distinct IDs")
        return self

    def shapes(self) -> set[tuple[str, int]]:
        out = {(resource, len(ids)) for resource, ids in self.devices.items()}
        if self.memory is not None:
            out.add((MEMORY_RESOURCE, self.memory.units))
        return out


class Assignment(_Model):
    """`gpupool.io/assignment`: written by the scheduler, read by the plugin."""

    version: Literal[1] = PROTOCOL_VERSION
    node: str = Field(min_length=1)
    pod_uid: str = Field(min_length=1, description="guards against the annotation being copied to another pod")
    containers: tuple[ContainerAssignment, ...]

    @model_validator(mode="after")
    def _valid(self) -> Assignment:
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise ValueError("container names must be unique")
        whole = {d for c in self.containers for d in c.devices.get("nvidia.com/gpu", ())}
        shared = {c.memory.gpu for c in self.containers if c.memory}
        if whole & shared:
            raise ValueError(f"GPUs {sorted(whole & shared)} are assigned both whole and shared")
        return self

    def container(self, name: str) -> ContainerAssignment | None:
        return next((c for c in self.containers if c.name == name), None)

    def shapes(self) -> set[tuple[str, int]]:
        return {s for c in self.containers for s in c.shapes()}


class AllocationAck(_Model):
    """`gpupool.io/allocated`: written by the plugin after Allocate.

    `containers[name][resource]` lists the device IDs the kubelet allocated to that container.
    `complete` is true once every container of the assignment has been allocated (the scheduler's
    shape gate opens then). Pods without an assignment get an ack too, so the scheduler learns which
    GPUs pods of other schedulers hold."""

    version: Literal[1] = PROTOCOL_VERSION
    node: str
    pod_uid: str
    containers: dict[str, dict[str, tuple[str, ...]]] = Field(default_factory=dict)
    complete: bool = False
    error: str | None = None


class HandshakeError(ValueError):
    """An annotation that cannot be used; the message says which and why."""


def _parse(annotations: Mapping[str, str] | None, key: str, model: type[_Model]) -> _Model | None:
    raw = (annotations or {}).get(key)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise HandshakeError(f"{key} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != PROTOCOL_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise HandshakeError(f"{key} has version {version!r}; this plugin speaks version {PROTOCOL_VERSION}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise HandshakeError(f"{key}: {where}: {err['msg']}") from None


def parse_assignment(annotations: Mapping[str, str] | None) -> Assignment | None:
    return _parse(annotations, ASSIGNMENT_ANNOTATION, Assignment)  # type: ignore[return-value]


def parse_ack(annotations: Mapping[str, str] | None) -> AllocationAck | None:
    return _parse(annotations, ACK_ANNOTATION, AllocationAck)  # type: ignore[return-value]


def assignment_annotations(assignment: Assignment) -> dict[str, str]:
    """The annotation to put on the Binding (or the pod) for this assignment."""
    return {ASSIGNMENT_ANNOTATION: assignment.model_dump_json(exclude_none=True)}


def ack_annotations(ack: AllocationAck) -> dict[str, str]:
    return {ACK_ANNOTATION: ack.model_dump_json(exclude_none=True)}


def shapes_conflict(a: Assignment, b: Assignment) -> bool:
    """True when pods a and b must not be pending on the same node at the same time."""
    return bool(a.shapes() & b.shapes())


def is_acknowledged(assignment: Assignment, ack: AllocationAck | None) -> bool:
    """The scheduler's gate test: the plugin has allocated every container of this assignment."""
    return ack is not None and ack.pod_uid == assignment.pod_uid and ack.complete
