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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Context, Decimal
from functools import lru_cache
from typing import Any, TypeGuard

from kubernetes.utils import parse_quantity

from gpupool_sched.model.constraints import NodeConstraints, Requirement, Toleration
from gpupool_sched.model.request import MILLI, GpuShape, InvalidRequest, PodRequest, WorkloadKind

RESOURCE_GPU = "nvidia.com/gpu"
RESOURCE_MEMORY = "nvidia.com/gpu-memory"
MIG_PREFIX = "nvidia.com/mig-"
MODEL_ANNOTATION = "gpupool.io/gpu-model"
WORKLOAD_ANNOTATION = "gpupool.io/workload"

MAX_DEVICES = 2**31 - 1  # a device count beyond int32 is no real request
MAX_AMOUNT = 2**62  # CPU milli / memory MiB: stays inside the core's int64 arrays
MIB = 2**20
_CTX = Context(prec=100, rounding=ROUND_CEILING, traps=[])  # rounds quantities up, as Kubernetes does
_MAX_MESSAGES = 5


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

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def memory_units(self) -> int:
        """The pod's units on its one shared GPU (app and sidecar containers)."""
        return sum(c.memory_units for c in self.containers if not c.reuses_devices)


class InvalidPod(ValueError):
    """The message is what the pod's FailedScheduling Event and Unschedulable condition say.

    ``permanent``: True when the pod is malformed (only a change of the pod can fix it); False when
    no node of the cluster as it is now could ever take it (unknown GPU model or MIG profile, more
    memory units than any GPU has), so it is retried when nodes change."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


class _Findings:
    """Problems found while reading a pod: malformed ones and ones only the cluster could fix."""

    def __init__(self) -> None:
        self.malformed: list[str] = []
        self.unfit: list[str] = []

    def bad(self, message: str) -> None:
        if message not in self.malformed:
            self.malformed.append(message)

    def missing(self, message: str) -> None:
        if message not in self.unfit:
            self.unfit.append(message)

    def raise_any(self) -> None:
        for messages, permanent in ((self.malformed, True), (self.unfit, False)):
            if messages:
                text = "; ".join(messages[:_MAX_MESSAGES])
                if len(messages) > _MAX_MESSAGES:
                    text += f"; and {len(messages) - _MAX_MESSAGES} more"
                raise InvalidPod(text, permanent=permanent)


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
    )


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


# ---- containers --------------------------------------------------------------------------------


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


# ---- node constraints --------------------------------------------------------------------------

_EXPRESSION_OPS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_FIELD_OPS = ("In", "NotIn")
_FIELD_KEY = "metadata.name"
_TOLERATION_OPS = ("Exists", "Equal")
_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def _constraints(spec: Mapping[str, Any], f: _Findings) -> NodeConstraints | None:
    selector: list[tuple[str, str]] = []
    for key, value in _map(spec.get("nodeSelector"), "spec.nodeSelector", f).items():
        if not _text(key) or not isinstance(value, str):
            f.bad(f"spec.nodeSelector: {_show(key)}: {_show(value)} is not a label key and value")
            continue
        selector.append((key, value))
    terms = _affinity_terms(spec, f)
    tolerations = _tolerations(spec, f)
    if not (selector or terms or tolerations):
        return None
    return NodeConstraints(node_selector=tuple(sorted(selector)), affinity_terms=terms, tolerations=tolerations)


def _affinity_terms(spec: Mapping[str, Any], f: _Findings) -> tuple[tuple[Requirement, ...], ...]:
    """spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: ORed terms of ANDed
    requirements; matchFields become requirements on the key "metadata.name"."""
    where = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    affinity = _map(spec.get("affinity"), "spec.affinity", f)
    node_affinity = _map(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity", f)
    if node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") is None:
        return ()
    required = _map(node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution"), where, f)
    raw_terms = _list(required.get("nodeSelectorTerms"), f"{where}.nodeSelectorTerms", f)
    if not raw_terms:
        f.bad(f"{where}.nodeSelectorTerms must list at least one term")
    terms: list[tuple[Requirement, ...]] = []
    for i, raw in enumerate(raw_terms):
        at = f"{where}.nodeSelectorTerms[{i}]"
        term = _map(raw, at, f)
        reqs: list[Requirement] = []
        for field_name, fields in (("matchExpressions", False), ("matchFields", True)):
            for j, expr in enumerate(_list(term.get(field_name), f"{at}.{field_name}", f)):
                req = _requirement(expr, f"{at}.{field_name}[{j}]", fields, f)
                if req is not None:
                    reqs.append(req)
        terms.append(tuple(reqs))
    return tuple(terms)


def _requirement(raw: Any, where: str, fields: bool, f: _Findings) -> Requirement | None:
    expr = _map(raw, where, f)
    key, op = expr.get("key"), expr.get("operator")
    values = _list(expr.get("values"), f"{where}.values", f)
    if not _text(key):
        f.bad(f"{where}: key must be a non-empty string")
        return None
    if fields and key != _FIELD_KEY:
        f.bad(f"{where}: matchFields supports only the key {_FIELD_KEY}, got {_show(key)}")
        return None
    ops = _FIELD_OPS if fields else _EXPRESSION_OPS
    if op not in ops:
        f.bad(f"{where}: operator must be one of {', '.join(ops)}, got {_show(op)}")
        return None
    if not all(isinstance(v, str) for v in values):
        f.bad(f"{where}: values must be strings")
        return None
    if op in ("In", "NotIn") and not values:
        f.bad(f"{where}: operator {op} needs values")
        return None
    if fields and len(values) != 1:
        f.bad(f"{where}: matchFields {op} takes exactly one node name")
        return None
    if op in ("Exists", "DoesNotExist") and values:
        f.bad(f"{where}: operator {op} takes no values")
        return None
    if op in ("Gt", "Lt") and (len(values) != 1 or not _integer_text(values[0])):
        f.bad(f"{where}: operator {op} takes exactly one integer value")
        return None
    try:
        return Requirement(str(key), str(op), tuple(values))
    except InvalidRequest as exc:  # the checks above should have said it already
        f.bad(f"{where}: {exc}")
        return None


def _integer_text(text: str) -> bool:
    return re.fullmatch(r"[+-]?[0-9]{1,18}", text) is not None


def _tolerations(spec: Mapping[str, Any], f: _Findings) -> tuple[Toleration, ...]:
    out: list[Toleration] = []
    for i, raw in enumerate(_list(spec.get("tolerations"), "spec.tolerations", f)):
        where = f"spec.tolerations[{i}]"
        t = _map(raw, where, f)
        key, op = t.get("key") or "", t.get("operator") or "Equal"
        value, effect = t.get("value") or "", t.get("effect") or ""
        seconds = t.get("tolerationSeconds")
        if not all(isinstance(x, str) for x in (key, op, value, effect)):
            f.bad(f"{where}: key, operator, value and effect must be strings")
        elif op not in _TOLERATION_OPS:
            f.bad(f"{where}: operator must be Exists or Equal, got {_show(op)}")
        elif effect not in _EFFECTS:
            f.bad(f"{where}: effect must be NoSchedule, PreferNoSchedule or NoExecute, got {_show(effect)}")
        elif op == "Exists" and value:
            f.bad(f"{where}: operator Exists takes no value")
        elif not key and op != "Exists":
            f.bad(f"{where}: a toleration without a key must use operator Exists")
        elif seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
            f.bad(f"{where}: tolerationSeconds must be an integer")
        else:
            try:
                out.append(Toleration(key, op, value, effect))
            except InvalidRequest as exc:
                f.bad(f"{where}: {exc}")
    return tuple(out)


# ---- quantities and plain values ---------------------------------------------------------------


def _quantity(value: Any, what: str, f: _Findings) -> Decimal | None:
    """A non-negative, finite Kubernetes quantity, or None (recorded as malformed)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        f.bad(f"{what} {_show(value)} is not a quantity")
        return None
    try:
        q = parse_quantity(value)
    except (ValueError, ArithmeticError, TypeError):
        f.bad(f"{what} {_show(value)} is not a quantity")
        return None
    if not q.is_finite() or q < 0:
        f.bad(f"{what} {_show(value)} is not a non-negative quantity")
        return None
    return q


def _amount(value: Any, what: str, scale: int, f: _Findings) -> int:
    """CPU in milli (scale 1000) or memory in MiB (scale 0), rounded up; 0 for absent or malformed."""
    if value is None:
        return 0
    q = _quantity(value, what, f)
    if q is None:
        return 0
    scaled = _CTX.multiply(q, scale) if scale else _CTX.divide(q, MIB)
    if scaled > MAX_AMOUNT:
        f.bad(f"{what} {_show(value)} is too large")
        return 0
    return int(_CTX.to_integral_value(scaled))


def _devices(value: Any, what: str, f: _Findings) -> int:
    """A device count: a positive integer (0 for anything else, recorded as malformed)."""
    q = _quantity(value, what, f)
    if q is None:
        return 0
    if q > MAX_DEVICES:
        f.bad(f"{what} {_show(value)} is too large")
        return 0
    if q != q.to_integral_value():
        f.bad(f"{what} {_show(value)} is not a whole number of devices")
        return 0
    if q == 0:
        f.bad(f"{what} is 0; ask for at least 1 or leave the resource out")
        return 0
    return int(q)


def _resource_map(value: Any, where: str, f: _Findings) -> dict[str, Any]:
    raw = _map(value, where, f)
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if not isinstance(key, str):
            f.bad(f"{where}: resource name {_show(key)} is not a string")
            continue
        out[key] = v
    return out


def _map(value: Any, where: str, f: _Findings) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        f.bad(f"{where} must be an object, got {_show(value)}")
        return {}
    return value


def _list(value: Any, where: str, f: _Findings) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        f.bad(f"{where} must be a list, got {_show(value)}")
        return []
    return list(value)


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)


def _timestamp(value: Any) -> float:
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _names(values: Iterable[str]) -> str:
    return ", ".join(sorted(values)) or "none"


def _mib(mib: int) -> str:
    if mib % 1024 == 0:
        return f"{mib // 1024} GiB"
    return f"{mib} MiB"
