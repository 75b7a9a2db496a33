"""Victim selection, the rules preemption and reclaim ask: which pods may preempt at all (preemptionPolicy,
PriorityClasses), which running pods are eviction candidates (lower priority, not already going) and how
PodDisruptionBudgets count them, how long an eviction's grace is (a pod's own, or its checkpoint annotation
under a cap) and so how long a nomination holds for its victims, and how the Events say why victims go.
The writer (`writer/preemptor.py`) carries the evictions out. docs/preemption.md tells the whole story."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.kube.labelselector import LabelSelector
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.preemption import RunningPod

log = logging.getLogger(__name__)

_GENERATIONS = itertools.count()
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it says nothing (the API server's default)
# gpupool.io/checkpoint-grace-seconds above this is clamped to it (scheduler flag --max-checkpoint-grace):
# the annotation is the workload's own say, and a preemptor waits that long for the room
DEFAULT_MAX_CHECKPOINT_GRACE_S = 3600


def may_preempt(obj: Mapping[str, Any], non_preempting_classes: Iterable[str]) -> bool:
    """False for `preemptionPolicy: Never` (the Priority admission plugin copies the class's policy into
    the pod's spec; the class is asked too in case the plugin is off)."""
    spec = obj.get("spec") or {}
    policy = spec.get("preemptionPolicy")
    if policy is not None:
        return policy != "Never"
    return spec.get("priorityClassName") not in set(non_preempting_classes)


def asks(request: PodRequest) -> str:
    """What a pod asks for, in an Event's words."""
    shapes = [s.describe() for s in request.gpu_shapes()]
    return " + ".join(shapes) if shapes else f"{request.cpu_milli}m CPU, {request.memory_mib} MiB memory"


# ---- PodDisruptionBudgets ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Budget:
    namespace: str
    selector: LabelSelector | None  # None: a null selector, which selects nothing
    disruptions_allowed: int

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return namespace == self.namespace and self.selector is not None and self.selector.matches(labels)


def parse_budget(obj: Mapping[str, Any]) -> Budget | None:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace = str(meta.get("namespace") or "")
    selector = spec.get("selector")
    try:
        allowed = int(status.get("disruptionsAllowed") or 0)
        if not isinstance(selector, Mapping):
            return Budget(namespace, None, allowed)
        labels = tuple(sorted((str(k), str(v)) for k, v in (selector.get("matchLabels") or {}).items()))
        expressions = tuple(
            (str(e.get("key")), str(e.get("operator")), frozenset(str(v) for v in e.get("values") or ()))
            for e in selector.get("matchExpressions") or ()
        )
    except (AttributeError, TypeError, ValueError):
        log.warning("PodDisruptionBudget %s/%s is malformed; ignored", namespace, meta.get("name"))
        return None
    return Budget(namespace, LabelSelector(labels, expressions), allowed)


class DisruptionBudgets:
    """The cluster's PodDisruptionBudgets (policy/v1), from the watch. A pod is blocked when a budget of
    its namespace selects it and allows no disruption now (its status.disruptionsAllowed is 0, which is
    what kube-controller-manager's disruption controller computes; a budget without status counts as 0).
    Each candidate also carries every budget that selects it with the disruptions it allows
    (`covering`): the planner counts them down per victim, so two victims under a budget that allows
    one make one violation. Only preemption's ranking uses this: the Eviction API enforces the budgets
    either way."""

    def __init__(self) -> None:
        self.budgets: dict[tuple[str, str], Budget] = {}
        # changed on every watch event, never the same number twice in a process (running_pods' memos)
        self.generation = next(_GENERATIONS)

    def apply(self, kind: str | None, obj: Mapping[str, Any]) -> bool:
        """Take in a watch event; True when it relaxed the budgets (one was removed or allows more
        disruptions than before), so pods that waited on them may preempt now."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        budget = None if kind == "DELETED" else parse_budget(obj)
        before = self.budgets.get(key)
        self.generation = next(_GENERATIONS)
        if budget is None:
            self.budgets.pop(key, None)
            return before is not None
        self.budgets[key] = budget
        return before is not None and (budget.disruptions_allowed > before.disruptions_allowed
                                       or budget.selector != before.selector)

    def blocked(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return any(b.disruptions_allowed <= 0 and b.selects(namespace, labels) for b in self.budgets.values())

    def covering(self, namespace: str, labels: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
        """("namespace/name", disruptions allowed) of every budget that selects the pod."""
        return tuple(sorted((f"{ns}/{name}", b.disruptions_allowed) for (ns, name), b in self.budgets.items()
                            if b.selects(namespace, labels)))


def running_pods(state: ClusterState, budgets: DisruptionBudgets, below: int | None = None) -> list[RunningPod]:
    """The ledger's candidates for eviction (bound or confirmed, not already being evicted, no holds);
    with `below`, only those of lower priority (the only ones preemption may pick), taken from the
    ledger's accounted entries by priority (`Ledger.running`), so the pass does not visit the others.

    Each entry keeps the RunningPod last built for it (`PodEntry.victim_memo`) with what it was built
    from (request, placement, node, key, labels, start, the budgets' generation); it is reused while all
    of them are the same objects, so a preemption does not rebuild thousands of unchanged candidates."""
    out: list[RunningPod] = []
    append = out.append
    generation = budgets.generation if budgets.budgets else -1  # -1: no budget covers anything
    for entry in state.running(below):  # with `below`: only entries of lower priority are visited
        request = entry.request
        memo = entry.victim_memo
        if (memo is not None and memo[0] is request and memo[1] is entry.placement and memo[2] == generation
                and memo[3] is entry.labels and memo[4] == entry.started and memo[5] is entry.node
                and memo[6] is entry.key and memo[7] is entry.uid):
            append(memo[8])
            continue
        covering = budgets.covering(entry.key.partition("/")[0], entry.labels) if generation >= 0 else ()
        pod = RunningPod(entry.uid, entry.node, request.priority, request, entry.placement, entry.started,
                         any(allowed <= 0 for _, allowed in covering), covering)
        entry.victim_memo = (request, entry.placement, generation, entry.labels, entry.started, entry.node,
                             entry.key, entry.uid, pod)
        out.append(pod)
    return out


BY_PRIORITY = "of lower priority"  # why victims go, in Events and messages; else a quota reclaim


def eviction_reason(reclaim: bool, quota: str | None) -> str:
    """Why a preemption's victims go: their priority, or their team borrowing `quota`'s guarantee."""
    return f"borrowing beyond their GpuQuota's guarantee (reclaimed for {quota})" if reclaim else BY_PRIORITY


def checkpoint_grace_s(entry: PodEntry, max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> int | None:
    """The eviction's gracePeriodSeconds: the pod's checkpoint annotation, clamped to the cap; None
    without one (the pod's own terminationGracePeriodSeconds applies)."""
    return None if entry.grace_s is None else min(entry.grace_s, max_checkpoint_grace_s)


def eviction_grace_s(entry: PodEntry, max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> int:
    """How long the pod may take to go once evicted: the grace it is already terminating with
    (metadata.deletionGracePeriodSeconds), else the one its eviction gets (the capped checkpoint
    annotation), else its terminationGracePeriodSeconds (30 s when unset, as Kubernetes)."""
    if entry.deletion_grace_s is not None:
        return entry.deletion_grace_s
    checkpoint = checkpoint_grace_s(entry, max_checkpoint_grace_s)
    if checkpoint is not None:
        return checkpoint
    return entry.pod_grace_s if entry.pod_grace_s is not None else DEFAULT_GRACE_S


def nomination_timeout_s(state: ClusterState, victims: Iterable[str], slack_s: float,
                         max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> float:
    """How long the freed room is held: the victims' longest eviction grace period plus `slack_s`."""
    graces = [eviction_grace_s(e, max_checkpoint_grace_s) for v in victims if (e := state.pods.get(v)) is not None]
    return max(graces, default=DEFAULT_GRACE_S) + slack_s


# ---- carrying it out -----------------------------------------------------------------------------
