"""A Kubernetes pod (the API server's JSON) reduced to what placement needs: a `PodPlan`.

The scheduler reads pods straight from the watch, so everything a pod says is untrusted input: a
malformed pod must become a clear message on the pod (its FailedScheduling Event and Unschedulable
condition), never an exception that stops the scheduler. `plan_pod` therefore raises only
`InvalidPod`, and says whether a change of the cluster could ever fix it (`permanent`).

CPU and memory are the pod's effective requests as kube-scheduler computes them (Kubernetes >= 1.29,
with restartable init containers). GPU demand follows the device plugin's resources
(docs/gpu-pool.md) and the handshake's rules for init containers (docs/handshake.md, rule 3):

* `nvidia.com/gpu`: whole GPUs, summed over the app and sidecar containers;
* `nvidia.com/gpu-memory`: memory units; every such container of a pod shares ONE GPU;
* `nvidia.com/mig-<profile>`: MIG devices, summed per profile;
* a non-restartable init container's devices are a subset of those of the next container that
  requests the same resource, so it adds nothing to the pod's demand.

GPU counts come from limits (extended resources have request = limit), else requests.

This module reads the pod's metadata, annotations and priority and puts the plan together; the parts:
scheduler/containers.py (each container's devices, the pod's effective requests),
scheduler/pod_constraints.py (nodeSelector, node affinity, tolerations) and scheduler/pod_input.py
(`InvalidPod` and the readers of untrusted values).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gpupool_sched.kube.containers import (
    MIG_PREFIX,
    RESOURCE_GPU,
    RESOURCE_MEMORY,
    _aggregate,
    _check_reuse,
    _containers,
    _pod_level_resources,
)
from gpupool_sched.kube.containers import ContainerDemand as ContainerDemand
from gpupool_sched.kube.pod_constraints import _constraints
from gpupool_sched.kube.pod_input import InvalidPod as InvalidPod
from gpupool_sched.kube.pod_input import (
    _amount,
    _Findings,
    _map,
    _mib,
    _names,
    _show,
    _text,
    _timestamp,
)
from gpupool_sched.model.request import MILLI, GpuShape, InvalidRequest, PodRequest, WorkloadKind

MODEL_ANNOTATION = "gpupool.io/gpu-model"
WORKLOAD_ANNOTATION = "gpupool.io/workload"


@dataclass(frozen=True, slots=True)
class ClusterFacts:
    """What the live cluster offers; the scheduler's state builds it from the nodes."""

    memory_unit_mib: int = 1024
    models: frozenset[str] = frozenset()  # GPU model names as NodeSpec/GpuSpec.model spell them
    mig_profiles: frozenset[str] = frozenset()  # e.g. {"1g.10gb", "3g.40gb"}
    max_units_per_gpu: int = 0  # most nvidia.com/gpu-memory units one GPU offers

    def __post_init__(self) -> None:
        if self.memory_unit_mib <= 0:
            raise ValueError(f"memory_unit_mib must be positive, got {self.memory_unit_mib}")


@dataclass(frozen=True, slots=True)
class PodPlan:
    """A pod as the scheduler places it."""

    uid: str
    namespace: str
    name: str
    created: float  # metadata.creationTimestamp, seconds since the epoch (0 when unreadable)
    priority: int
    request: PodRequest
    containers: tuple[ContainerDemand, ...]  # kubelet order: init containers, then app containers
    memory_unit_mib: int
    owner: str = ""  # the controller that recreates it, "Kind/namespace/name" ("" for a bare pod)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def memory_units(self) -> int:
        """The pod's units on its one shared GPU (app and sidecar containers)."""
        return sum(c.memory_units for c in self.containers if not c.reuses_devices)


def plan_pod(
    obj: Mapping[str, Any],
    facts: ClusterFacts,
    priority_classes: Mapping[str, int] | None = None,
    *,
    strict: bool = True,
) -> PodPlan:
    """The pod's plan; raises `InvalidPod` (and nothing else) for anything a pod may say.

    ``strict=False`` is for pods already bound to a node (any scheduler's): it describes what the pod
    holds as well as it can, ignoring unknown models and profiles, zero counts, the units limit and
    malformed parts, and raises only when `obj` is not a pod at all."""
    if not isinstance(obj, Mapping):
        raise InvalidPod(f"not a pod: {_show(obj)}")
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise InvalidPod("not a pod: metadata and spec must be objects")
    name, uid, namespace = meta.get("name"), meta.get("uid"), meta.get("namespace") or "default"
    if not (_text(name) and _text(uid) and _text(namespace)):
        raise InvalidPod("not a pod: metadata.name, metadata.uid and metadata.namespace must be non-empty strings")
    f = _Findings()
    annotations = _map(meta.get("annotations"), "metadata.annotations", f)

    containers = _containers(spec, f)
    demands = tuple(d for d, _ in containers)
    amounts = [a for _, a in containers]
    _check_reuse(demands, f)
    total = _aggregate(demands, amounts)
    _pod_level_resources(spec, total, f)
    overhead = _map(spec.get("overhead"), "spec.overhead", f)
    for resource, scale in (("cpu", MILLI), ("memory", 0)):
        total[resource] = total.get(resource, 0) + _amount(overhead.get(resource), f"spec.overhead.{resource}",
                                                           scale, f)

    whole = total.get(RESOURCE_GPU, 0)
    units = total.get(RESOURCE_MEMORY, 0)
    mig = {r[len(MIG_PREFIX):]: n for r, n in sorted(total.items()) if r.startswith(MIG_PREFIX)}
    _check_cluster(units, mig, facts, f)
    wants_gpu = bool(whole or units or mig)
    if wants_gpu:
        models = _models(annotations, facts, f)
    else:  # a pod without GPUs takes no model: only the annotation's syntax is checked
        models = frozenset()
        _check_model_syntax(annotations, f)
    kind = _kind(annotations, whole, wants_gpu, f)
    priority = _priority(spec, priority_classes or {}, f)
    constraints = _constraints(spec, f)
    if strict:
        f.raise_any()

    fields = dict(
        cpu_milli=total.get("cpu", 0),
        memory_mib=total.get("memory", 0),
        gpu_models=models,
        priority=priority,
        kind=kind,
        namespace=namespace,
        constraints=constraints,
    )
    try:
        request = PodRequest.of_shapes(name, _shapes(whole, units * facts.memory_unit_mib, mig), **fields)
    except InvalidRequest as exc:
        if strict:
            raise InvalidPod(str(exc)) from None
        try:  # cannot happen for a pod the API server accepted; keep CPU and memory at least
            request = PodRequest.of_shapes(name, (), **fields)
        except InvalidRequest as again:
            raise InvalidPod(str(again)) from None
    return PodPlan(
        uid=uid,
        namespace=namespace,
        name=name,
        created=_timestamp(meta.get("creationTimestamp")),
        priority=priority,
        request=request,
        containers=demands,
        memory_unit_mib=facts.memory_unit_mib,
        owner=controller_of(meta),
    )


def controller_ref(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first ownerReference marked ``controller: true`` with a kind and a name (None when none)."""
    refs = meta.get("ownerReferences")
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            kind, name = ref.get("kind"), ref.get("name")
            if isinstance(kind, str) and isinstance(name, str) and kind and name:
                return ref
    return None


def controller_of(meta: Mapping[str, Any], ref: Mapping[str, Any] | None = None) -> str:
    """``Kind/namespace/name`` of the ownerReference marked ``controller: true`` ("" when none or malformed):
    what recreates the pod when it is evicted (a ReplicaSet, a StatefulSet, a Job). `ref`: that reference,
    when the caller has it already (`controller_ref`)."""
    ref = controller_ref(meta) if ref is None else ref
    if ref is None:
        return ""
    return f"{ref['kind']}/{meta.get('namespace') or 'default'}/{ref['name']}"


def controlling_job(ref: Mapping[str, Any] | None) -> str:
    """The UID of the batch/v1 Job a controller reference (`controller_ref`) names, "" when it names none."""
    if ref is None or ref.get("kind") != "Job" or ref.get("apiVersion") != "batch/v1":
        return ""
    uid = ref.get("uid")
    return uid if isinstance(uid, str) else ""


def _shapes(whole: int, share_mib: int, mig: Mapping[str, int]) -> list[GpuShape]:
    shapes: list[GpuShape] = []
    if whole:
        shapes.append(GpuShape(gpu_count=whole, gpu_milli=MILLI))
    if share_mib:
        shapes.append(GpuShape(gpu_count=1, gpu_memory_mib=share_mib))
    shapes.extend(GpuShape(mig_profile=p, mig_count=n) for p, n in mig.items())
    return shapes


def pod_revision(obj: Mapping[str, Any]) -> str | None:
    """A digest of what decides a pending pod's schedulability, for `QueuedPod.revision`: its spec and
    metadata without the fields every write changes (kube-scheduler's isPodUpdated). The status is
    left out, so the scheduler's own Unschedulable condition is not a change of the pod. None when
    the object cannot be serialised (then every update counts as a change)."""
    try:
        meta = obj.get("metadata") or {}
        kept = {k: v for k, v in meta.items() if k not in ("resourceVersion", "generation", "managedFields")}
        text = json.dumps([kept, obj.get("spec")], sort_keys=True, default=repr)
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _check_cluster(units: int, mig: Mapping[str, int], facts: ClusterFacts, f: _Findings) -> None:
    """Demands that no node of the cluster as it is now offers (fixed by new nodes, not by the pod)."""
    if units > facts.max_units_per_gpu:
        asked = f"asks for {units} {RESOURCE_MEMORY} units ({_mib(units * facts.memory_unit_mib)}) on one GPU"
        if facts.max_units_per_gpu:
            f.missing(f"{asked}; the largest GPU offers {facts.max_units_per_gpu}")
        else:
            f.missing(f"{asked}; no GPU of the cluster offers {RESOURCE_MEMORY}")
    for profile in mig:
        if profile not in facts.mig_profiles:
            f.missing(f"unknown MIG profile {_show(profile)}; the cluster has: {_names(facts.mig_profiles)}")


# ---- annotations, priority ---------------------------------------------------------------------


def _annotation(annotations: Mapping[str, Any], key: str, f: _Findings) -> str | None:
    value = annotations.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        f.bad(f"annotation {key} must be a string, got {_show(value)}")
        return None
    return value


def _check_model_syntax(annotations: Mapping[str, Any], f: _Findings) -> None:
    raw = _annotation(annotations, MODEL_ANNOTATION, f)
    if raw is not None:
        _model_entries(raw, f)


def _model_entries(raw: str, f: _Findings) -> list[tuple[str, frozenset[str]]]:
    entries = [(e.strip(), _tokens(e)) for e in raw.split(",")]
    if not raw.strip():
        f.bad(f"annotation {MODEL_ANNOTATION} is empty; name GPU models, e.g. H100,A100-80GB")
        return []
    if any(not tokens for _, tokens in entries):
        f.bad(f"annotation {MODEL_ANNOTATION} {_show(raw)} has an empty entry")
    return [(e, tokens) for e, tokens in entries if tokens]


def _models(annotations: Mapping[str, Any], facts: ClusterFacts, f: _Findings) -> frozenset[str]:
    """The models the pod accepts: every model of the cluster that one of its entries names. An entry
    names a model when each of its tokens (split on '-', '_', ' ', any case) is a token of the model."""
    raw = _annotation(annotations, MODEL_ANNOTATION, f)
    if raw is None:
        return frozenset()
    matched: set[str] = set()
    for entry, tokens in _model_entries(raw, f):
        hits = {m for m in facts.models if tokens <= _tokens(m)}
        if not hits:
            f.missing(f"unknown GPU model {_show(entry)}; the cluster has: {_names(facts.models)}")
        matched |= hits
    return frozenset(matched)


@lru_cache(maxsize=1024)
def _tokens(text: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[-_ ]+", text.strip().lower()) if t)


def _kind(annotations: Mapping[str, Any], whole: int, wants_gpu: bool, f: _Findings) -> WorkloadKind:
    """The annotation, else training for whole GPUs and inference for shares and MIG slices."""
    raw = _annotation(annotations, WORKLOAD_ANNOTATION, f)
    if raw is not None:
        if raw in (WorkloadKind.TRAINING, WorkloadKind.INFERENCE):
            return WorkloadKind(raw)
        f.bad(f"annotation {WORKLOAD_ANNOTATION} must be training or inference, got {_show(raw)}")
    if whole:
        return WorkloadKind.TRAINING
    if wants_gpu:  # memory units or MIG devices only
        return WorkloadKind.INFERENCE
    return WorkloadKind.UNKNOWN


def _priority(spec: Mapping[str, Any], classes: Mapping[str, int], f: _Findings) -> int:
    """spec.priority (set by the Priority admission plugin), else the pod's priority class, else 0."""
    value = spec.get("priority")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            f.bad(f"spec.priority must be an integer, got {_show(value)}")
        elif not -(2**31) <= value < 2**31:
            f.bad(f"spec.priority {value} is out of the int32 range")
        else:
            return value
    name = spec.get("priorityClassName")
    if name is None or name == "":
        return 0
    if not isinstance(name, str):
        f.bad(f"spec.priorityClassName must be a string, got {_show(name)}")
        return 0
    if name in classes:
        return int(classes[name])
    f.bad(f"priority class {_show(name)} does not exist")
    return 0
