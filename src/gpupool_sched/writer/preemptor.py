"""Carrying out a preemption: the cycle decided (`plan_preemption`, pure) and marked the victims and the
nomination in the state; this evicts them through the Eviction API (so PodDisruptionBudgets hold), sets
the preemptor's status.nominatedNodeName and posts the Events that say who preempted whom and why.

Like the binder it runs as asyncio tasks off the cycle. A victim already gone (404) is fine; any other
failure (429: a PDB forbids it) aborts the preemption: victims not yet evicted are spared, the holds of
the gone ones are released, the nomination is cleared and the preemptor retried after its backoff.
Also here: which pods may preempt at all, and the PodDisruptionBudgets as preemption sees them.
docs/preemption.md tells the whole story.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.cache.entries import CHECKPOINT_GRACE, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.labelselector import LabelSelector
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.preemption import Preemption, RunningPod
from gpupool_sched.writer.recorder import EventRecorder

log = logging.getLogger(__name__)

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

    def apply(self, kind: str | None, obj: Mapping[str, Any]) -> bool:
        """Take in a watch event; True when it relaxed the budgets (one was removed or allows more
        disruptions than before), so pods that waited on them may preempt now."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        budget = None if kind == "DELETED" else parse_budget(obj)
        before = self.budgets.get(key)
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
    with `below`, only those of lower priority (the only ones preemption may pick)."""
    out: list[RunningPod] = []
    for entry in state.running():
        if below is not None and entry.request.priority >= below:
            continue
        namespace = entry.key.partition("/")[0]
        covering = budgets.covering(namespace, entry.labels) if budgets.budgets else ()
        out.append(RunningPod(entry.uid, entry.node, entry.request.priority, entry.request, entry.placement,
                              entry.started, any(allowed <= 0 for _, allowed in covering), covering))
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

@dataclass(frozen=True, slots=True)
class Target:
    uid: str
    namespace: str
    name: str
    priority: int
    grace_s: int | None  # the eviction's gracePeriodSeconds (None: the pod's own)
    asked_s: int | None = None  # the checkpoint annotation, when the cap clamped it


class Preemptor:
    def __init__(self, state: ClusterState, api: KubeApi, queue: SchedulingQueue, metrics: SchedulerMetrics,
                 recorder: EventRecorder, *, max_checkpoint_grace_s: int = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> None:
        self.max_checkpoint_grace_s = max_checkpoint_grace_s
        self.state = state
        self.api = api
        self.queue = queue
        self.metrics = metrics
        self.recorder = recorder
        self._tasks: set[asyncio.Task[None]] = set()

    def carry_out(self, plan: PodPlan, preemption: Preemption, why: str = BY_PRIORITY) -> None:
        """Start evicting `preemption`'s victims for `plan` (already nominated in the state); `why` the
        victims go, for the Events (quota reclaim evicts pods whatever their priority)."""
        targets = []
        for victim in preemption.victims:
            entry = self.state.pods[victim.uid]
            namespace, _, name = entry.key.partition("/")
            grace = checkpoint_grace_s(entry, self.max_checkpoint_grace_s)
            asked = entry.grace_s if entry.grace_s != grace else None
            if asked is not None:
                log.warning("pod %s/%s asks %s=%d; capped at %d s (--max-checkpoint-grace)",
                            namespace, name, CHECKPOINT_GRACE, asked, grace)
            targets.append(Target(victim.uid, namespace, name, victim.priority, grace, asked))
        self.metrics.preemption_attempts.labels(result="planned").inc()
        log.info("pod %s (priority %d) preempts %d pod(s) on %s: %s", plan.key, plan.priority, len(targets),
                 preemption.node, ", ".join(f"{t.namespace}/{t.name}" for t in targets))
        task = asyncio.get_running_loop().create_task(self._run(plan, preemption.node, targets, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def clear(self, namespace: str, name: str) -> None:
        """Clear a pod's status.nominatedNodeName (its nomination expired)."""
        task = asyncio.get_running_loop().create_task(self._clear(namespace, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _clear(self, namespace: str, name: str) -> None:
        try:
            await self.api.set_nominated_node(namespace, name, None)
        except ApiError as exc:
            if exc.status != 404:
                log.warning("pod %s/%s: clearing nominatedNodeName failed: %s", namespace, name, exc)

    async def _run(self, plan: PodPlan, node: str, targets: list[Target], why: str = BY_PRIORITY) -> None:
        try:
            await self.api.set_nominated_node(plan.namespace, plan.name, node)
        except ApiError as exc:
            if exc.status == 404:  # the preemptor is gone: evict nobody
                self._abort(plan, targets, exc, clear=False)
                return
            log.warning("pod %s: setting nominatedNodeName failed (%s); evicting anyway", plan.key, exc)
        names = ", ".join(f"{t.namespace}/{t.name}" for t in targets)
        self.recorder.record(plan.namespace, plan.name, plan.uid, "Normal", "Preempting",
                             f"Preempting {len(targets)} pod(s) {why} on node {node}: {names}")
        what = asks(plan.request)
        for i, target in enumerate(targets):
            if plan.uid not in self.state.nominations:  # placed, deleted or expired meanwhile
                self.state.spare(plan.uid, (t.uid for t in targets[i:]))
                return
            try:
                await self.api.evict(target.namespace, target.name, target.uid, target.grace_s)
            except ApiError as exc:
                if exc.status == 404:
                    continue  # already gone: what it held is free (or held, if the watch saw it go)
                self._abort(plan, targets[i:], exc, clear=True)
                return
            self.metrics.preemption_victims.labels(reason="priority" if why == BY_PRIORITY else "quota").inc()
            self.recorder.record(
                target.namespace, target.name, target.uid, "Warning", "Preempted",
                f"Preempted by {plan.key} (priority {plan.priority}) on node {node} to make room for {what}"
                + ("" if why == BY_PRIORITY else f": pod(s) {why}")
                + (f"; checkpoint grace {target.grace_s}s" if target.grace_s is not None else "")
                + (f" ({CHECKPOINT_GRACE} asks {target.asked_s}s; capped at {target.grace_s}s)"
                   if target.asked_s is not None else ""))

    def _abort(self, plan: PodPlan, remaining: list[Target], exc: ApiError, *, clear: bool) -> None:
        blocked = "a PodDisruptionBudget forbids it" if exc.status == 429 else str(exc)
        log.warning("pod %s: preemption aborted at %s (%s); retrying later",
                    plan.key, f"{remaining[0].namespace}/{remaining[0].name}" if remaining else "-", blocked)
        self.metrics.preemption_attempts.labels(result="failed").inc()
        self.state.spare(plan.uid, (t.uid for t in remaining))
        if self.state.end_nomination(plan.uid):
            self.queue.on_event(ClusterEvent.GPU_FREED)
        if clear:
            self.recorder.record(plan.namespace, plan.name, plan.uid, "Warning", "PreemptionFailed",
                                 f"Preemption stopped: evicting {remaining[0].namespace}/{remaining[0].name} "
                                 f"failed: {blocked}")
            self.clear(plan.namespace, plan.name)
            self.queue.retry(plan.uid)
