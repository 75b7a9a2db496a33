"""The status report: what `gpupool status --output json` prints (docs/status.md documents every field).

The field names are an interface (scripts and dashboards read them): adding a field keeps `version`
1; renaming or removing one, or changing what it means, bumps it.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

STATUS_VERSION: Final = 1

GpuUse = Literal["free", "whole", "shared", "mig"]
Health = Literal["healthy", "unhealthy"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MigSliceStatus(_Model):
    uuid: str
    profile: str = Field(description="MIG profile, e.g. 1g.10gb")
    health: Health
    pod: str | None = Field(description="namespace/name of the pod holding the slice; null: free")


class GpuStatus(_Model):
    index: int
    uuid: str
    model: str = Field(description="product name as the device plugin's inventory reports it")
    memory_mib: int
    health: Health
    use: GpuUse = Field(description="whole: held by a whole-GPU pod; shared: memory-unit tenants; mig: MIG "
                                    "mode (see mig); free: none of these")
    memory_units_used: int = Field(description="nvidia.com/gpu-memory units held on this GPU")
    memory_units_total: int = Field(description="units this GPU offers (0: not offered as units)")
    pods: list[str] = Field(description="namespace/name of the pods holding it whole or sharing it")
    mig: list[MigSliceStatus] = Field(description="the MIG layout of a MIG-enabled GPU, else empty")


class NodeStatus(_Model):
    name: str
    model: str = Field(description="the most common GPU product of the node ('' without GPUs)")
    schedulable: bool = Field(description="false when cordoned (spec.unschedulable)")
    inventory_problem: str | None = Field(description="why the inventory annotation could not be used "
                                                      "(the node then counts no GPUs); null: none")
    memory_unit_mib: int | None = Field(description="MiB per nvidia.com/gpu-memory unit on this node; null: "
                                                    "not offered")
    gpus: int
    whole: int = Field(description="GPUs held whole")
    shared: int = Field(description="GPUs with memory-unit tenants")
    free: int = Field(description="healthy GPUs, not MIG-enabled, with nothing on them")
    mig: int = Field(description="MIG-enabled GPUs")
    unhealthy: int = Field(description="GPUs the device plugin reports unhealthy (whatever their use)")
    memory_units_used: int
    memory_units_total: int
    mig_slices_used: int
    mig_slices_total: int
    gpu_list: list[GpuStatus] = Field(description="every GPU of the node, by index")


class PendingGroup(_Model):
    priority: int = Field(description="the pods' priority value")
    priority_class: str | None = Field(description="spec.priorityClassName; null: none")
    pods: int
    oldest_age_seconds: float
    oldest_pod: str = Field(description="namespace/name of the oldest pod of the group")


class Fragmentation(_Model):
    percent: float = Field(description="idle GPU capacity the workload cannot use, % of all GPU capacity "
                                       "(FGD; the same figure as gpupool_scheduler_cluster_fragmentation_percent)")
    gpus: float = Field(description="the same in GPUs (milli-GPU / 1000)")
    allocated_percent: float = Field(description="GPU capacity allocated, % (shares count fractionally)")
    profile: Literal["prior", "observed"] = Field(description="prior: the scheduler's built-in workload mix "
                                                             "(fewer than 50 pods seen); observed: learnt from "
                                                             "the pods")
    pods_observed: int = Field(description="pods the workload profile saw")


class Totals(_Model):
    nodes: int
    gpus: int
    whole: int
    shared: int
    free: int
    mig: int
    unhealthy: int
    memory_units_used: int
    memory_units_total: int
    mig_slices_used: int
    mig_slices_total: int
    pending_pods: int
    unknown_device_pods: int = Field(description="bound GPU pods without an assignment or ack, accounted "
                                                 "on GPUs the scheduler guessed")


class ClusterStatus(_Model):
    version: Literal[1] = STATUS_VERSION
    generated_at: str = Field(description="RFC 3339 UTC time of the read")
    server: str = Field(description="the API server's URL")
    scheduler_name: str = Field(description="pending pods with this spec.schedulerName are counted")
    memory_unit_mib: int = Field(description="the scheduler's MiB per memory unit (--memory-unit-mib)")
    selector: str | None = Field(description="the node label selector (--selector); null: every node")
    totals: Totals
    fragmentation: Fragmentation
    pending: list[PendingGroup] = Field(description="pending pods by priority, highest first")
    nodes: list[NodeStatus] = Field(description="by name")
