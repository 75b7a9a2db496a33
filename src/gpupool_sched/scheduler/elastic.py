"""Elastic inference's wiring in the scheduler service (issue 20 §3, docs/idle-and-elastic.md#elastic-inference):
the watched Deployments and HorizontalPodAutoscalers, which pods are borrowed replicas, the give-back
action's candidates and how its plan is carried out (writer/elastic.py), the periodic grow step (leader
only, from the housekeeping tick), the metrics and the Events.

Grow, one replica at a time per Deployment, while all of these hold: the Deployment's annotations are valid,
every replica it asks for runs (none pending, none going), the count is below `max` and below what its
demand asks for, no give-back from it within the no-flap window, no other pod waits for GPUs, and one more
replica (the request of a running one) fits on free GPUs now (`decide` on the snapshot: holds and
reservations count as taken). With an HPA on the Deployment gpupool never raises the count: it raises the
HPA's maxReplicas by one (up to `max`) once the HPA uses all it was lent, and the HPA decides."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.elastic import (
    DEFAULT_NO_FLAP_S,
    ElasticSpec,
    FlapGuard,
    InvalidElastic,
    Replica,
    deployment_of,
    give_back_order,
    inflight,
    parse_elastic,
    tiers,
)
from gpupool_sched.framework.queue import ClusterEvent, SchedulingQueue
from gpupool_sched.kube.informer import WatchedKind
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.preemption import Preemption, RunningPod
from gpupool_sched.writer.elastic import ElasticWriter, GiveBack, Loan

log = logging.getLogger(__name__)

DEPLOYMENTS = "/apis/apps/v1/deployments"
AUTOSCALERS = "/apis/autoscaling/v2/horizontalpodautoscalers"
UNPLACED_S = 60.0  # a lent replica that found no free GPU for this long is taken back (the count lowered)


@dataclass(frozen=True)
class ElasticConfig:
    enabled: bool = True
    no_flap_s: float = DEFAULT_NO_FLAP_S  # --elastic-no-flap


@dataclass
class Target:
    """An elastic Deployment as the watch has it."""

    namespace: str
    name: str
    uid: str
    annotations: Mapping[str, str]
    replicas: int
    spec: ElasticSpec | None
    problem: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Elastic:
    config: ElasticConfig
    state: ClusterState
    queue: SchedulingQueue
    writer: ElasticWriter
    metrics: SchedulerMetrics
    policy: Callable[[], Policy]
    targets: dict[str, Target] = field(default_factory=dict)  # namespace/name -> elastic Deployment
    hpas: dict[str, str] = field(default_factory=dict)  # Deployment namespace/name -> its HPA's name
    hpa_max: dict[str, int] = field(default_factory=dict)  # Deployment namespace/name -> its HPA's maxReplicas
    inflight: dict[str, int] = field(default_factory=dict)  # pod UID -> gpupool.io/inflight
    reported: dict[str, str] = field(default_factory=dict)  # Deployment -> the annotation problem told
    writing: set[str] = field(default_factory=set)  # Deployments with a count write under way
    handing: dict[str, float] = field(default_factory=dict)  # waiting pod UID -> clock of its give-back
    short: dict[str, float] = field(default_factory=dict)  # Deployment -> clock since it runs fewer than asked
    flap: FlapGuard = field(default_factory=FlapGuard)

    def __post_init__(self) -> None:
        self.flap.window_s = self.config.no_flap_s

    # ---- watch ----------------------------------------------------------------------------------------
    def kinds(self) -> list[WatchedKind]:
        def absent(what: str) -> Callable[[ApiError], bool]:
            def tolerate(exc: ApiError) -> bool:
                log.warning("listing %s failed (%s): elastic inference sees none", what, exc)
                return True
            return tolerate

        return [WatchedKind("deployments", DEPLOYMENTS, self.on_deployment, on_error=absent("Deployments")),
                WatchedKind("horizontalpodautoscalers", AUTOSCALERS, self.on_autoscaler,
                            on_error=absent("HorizontalPodAutoscalers"))]

    def on_deployment(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        annotations = meta.get("annotations") or {}
        if kind == "DELETED":
            self._forget_target(key)
            return
        try:
            spec = parse_elastic(annotations)
            problem = None
        except InvalidElastic as exc:
            spec, problem = None, str(exc)
        if spec is None and problem is None:
            self._forget_target(key)
            return
        replicas = (obj.get("spec") or {}).get("replicas", 1)
        self.targets[key] = Target(str(meta.get("namespace", "")), str(meta.get("name", "")),
                                   str(meta.get("uid", "")), dict(annotations),
                                   replicas if isinstance(replicas, int) else 1, spec, problem)
        if problem is not None and self.reported.get(key) != problem:
            self.reported[key] = problem
            log.warning("Deployment %s: %s; not elastic", key, problem)
            target = self.targets[key]
            self.writer.event(target.namespace, target.name, target.uid, "Warning", "ElasticInvalid",
                              f"{problem}; the Deployment is left as it is")
        elif problem is None:
            self.reported.pop(key, None)

    def _forget_target(self, key: str) -> None:
        target = self.targets.pop(key, None)
        self.reported.pop(key, None)
        self.short.pop(key, None)
        if target is not None:
            for tier in ("guaranteed", "borrowed"):
                with contextlib.suppress(KeyError):
                    self.metrics.elastic_replicas.remove(target.namespace, target.name, tier)

    def on_autoscaler(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        ref = spec.get("scaleTargetRef") or {}
        if ref.get("kind") != "Deployment" or not isinstance(ref.get("name"), str):
            return
        key = f"{meta.get('namespace', '')}/{ref['name']}"
        if kind == "DELETED":
            self.hpas.pop(key, None)
            self.hpa_max.pop(key, None)
            return
        self.hpas[key] = str(meta.get("name", ""))
        if isinstance(spec.get("maxReplicas"), int):
            self.hpa_max[key] = spec["maxReplicas"]

    def observe(self, uid: str, obj: Mapping[str, Any], deleted: bool) -> None:
        """A pod's watch event: its requests in flight (gpupool.io/inflight)."""
        if deleted:
            self.inflight.pop(uid, None)
            return
        count = inflight((obj.get("metadata") or {}).get("annotations"))
        if count:
            self.inflight[uid] = count
        else:
            self.inflight.pop(uid, None)

    # ---- tiers ----------------------------------------------------------------------------------------
    def _replicas(self) -> dict[str, list[PodEntry]]:
        """Running replicas (bound or confirmed, not going) of each valid elastic Deployment."""
        out: dict[str, list[PodEntry]] = {}
        if not self.targets:
            return out
        for entry in self.state.running():
            key = deployment_of(entry.owner, entry.labels) if entry.owner else None
            if key is not None and key in self.targets and self.targets[key].spec is not None:
                out.setdefault(key, []).append(entry)
        return out

    def _tiers(self, key: str, entries: list[PodEntry]) -> tuple[list[Replica], list[Replica]]:
        spec = self.targets[key].spec
        assert spec is not None
        return tiers((Replica(e.uid, e.started, self.inflight.get(e.uid, 0)) for e in entries), spec.minimum)

    def borrowing(self, plan: PodPlan, labels: Mapping[str, str]) -> bool:
        """A pending pod is a borrowed replica: its Deployment is elastic and already runs `min` replicas.
        It is placed only on free GPUs (no give-back, no move, no preemption, no reclaim for it)."""
        key = deployment_of(plan.owner, labels) if plan.owner else None
        target = self.targets.get(key) if key is not None else None
        if target is None or target.spec is None:
            return False
        running = sum(1 for e in self.state.running() if e.owner == plan.owner
                      or deployment_of(e.owner, e.labels) == key)
        return running >= target.spec.minimum

    def candidates(self) -> list[RunningPod]:
        """Every borrowed replica, as the give-back planner's candidates: the plan priority is the rank in
        the give-back order, cheapest lowest (the planner keeps the costliest first, and never sees a `min`
        replica)."""
        out: list[RunningPod] = []
        for key, entries in self._replicas().items():
            _, borrowed = self._tiers(key, entries)
            by_uid = {e.uid: e for e in entries}
            order = give_back_order(borrowed)
            for rank, replica in enumerate(order):
                e = by_uid[replica.uid]
                out.append(RunningPod(e.uid, e.node, rank, e.request, e.placement, e.started))
        return out

    # ---- give back ------------------------------------------------------------------------------------
    def carry_out(self, plan: PodPlan, preemption: Preemption) -> None:
        """The give-back action's plan for `plan` (nominated, its loans marked): per Deployment, the loans'
        deletion cost and the count down to the replicas that stay."""
        by_deployment: dict[str, list[Loan]] = {}
        for victim in preemption.victims:
            entry = self.state.pods.get(victim.uid)
            key = deployment_of(entry.owner, entry.labels) if entry is not None else None
            if entry is None or key is None:
                continue
            namespace, _, name = entry.key.partition("/")
            by_deployment.setdefault(key, []).append(Loan(entry.uid, namespace, name))
        replicas = self._replicas()  # the loans are marked as going: not counted
        now = self.queue.clock()
        self.handing.setdefault(plan.uid, now)
        for key, loans in by_deployment.items():
            target = self.targets[key]
            back = GiveBack(target.namespace, target.name, tuple(loans), len(replicas.get(key, ())),
                            self.hpas.get(key))
            self.flap.gave_back(key, now)
            self.metrics.elastic_scaled.labels(direction="down").inc(len(loans))
            log.info("pod %s takes back %d borrowed replica(s) of %s on %s: %s", plan.key, len(loans), key,
                     preemption.node, ", ".join(loan.name for loan in loans))
            self.writer.spawn(self.writer.give_back(plan, preemption.node, back, target.uid))

    def bound(self, uid: str) -> None:
        began = self.handing.pop(uid, None)
        if began is not None:
            self.metrics.elastic_handover.observe(self.queue.clock() - began)

    def forget(self, uid: str) -> None:
        self.handing.pop(uid, None)

    # ---- grow (housekeeping) --------------------------------------------------------------------------
    def tick(self, leading: bool, waiting: Callable[[], bool]) -> None:
        """Housekeeping: the tier gauges; while leading, one step of growth (or an unplaced replica taken
        back) per elastic Deployment. `waiting()`: a pod waits for GPUs (asked only when a step may follow)."""
        if not self.config.enabled or not self.targets:
            return
        replicas = self._replicas()
        self._gauges(replicas)
        if not leading:
            return
        now = self.queue.clock()
        calm: bool | None = None  # no pod waits for GPUs (asked once, when a Deployment could grow)
        for key, target in self.targets.items():
            entries = replicas.get(key, [])
            if target.spec is None or key in self.writing or not entries:
                continue
            if not self.flap.may_grow(key, now):
                continue
            if any(e.evicting_for is not None for e in self.state.pods.values() if e.uid in {x.uid for x in entries}):
                continue
            hpa = self.hpas.get(key)
            count = len(entries)
            if count < target.replicas and count >= target.spec.minimum:
                self._unplaced(target, count, now)
                continue  # a replica is pending (or going)
            self.short.pop(key, None)
            if count != target.replicas or count >= target.spec.maximum:
                continue  # a replica is going, or at max
            if hpa is None and target.spec.wants(target.annotations, count) <= count:
                continue
            if hpa is not None and self.hpa_max.get(key, 0) > count:
                continue  # the HPA has room it does not use
            if calm is None:
                calm = not waiting()
            if not calm or not self._fits(entries[0]):
                continue
            self._grow(target, count, hpa)

    def _unplaced(self, target: Target, count: int, now: float) -> None:
        """The Deployment runs `count` (at least min) of the replicas it asks for: a borrowed replica that
        found no free GPU within UNPLACED_S is taken back (the count lowered to what runs; the ReplicaSet
        removes an unscheduled pod first). Counts as a give-back for the no-flap window."""
        key = target.key
        since = self.short.setdefault(key, now)
        if now - since < UNPLACED_S or self.hpas.get(key) is not None:
            return
        self.short.pop(key, None)
        self.writing.add(key)
        self.flap.gave_back(key, now)

        async def lower() -> None:
            try:
                done = await self.writer.scale(target.namespace, target.name,
                                               lambda now_: count if now_ > count else None)
            except ApiError as exc:
                log.warning("Deployment %s: taking back an unplaced replica failed: %s", key, exc)
                return
            finally:
                self.writing.discard(key)
            if done is not None:
                self.metrics.elastic_scaled.labels(direction="down").inc()
                self.writer.event(target.namespace, target.name, target.uid, "Normal", "ElasticGaveBack",
                                  f"Took back borrowed replica(s) that found no free GPU within {UNPLACED_S:.0f}s; "
                                  f"replicas to {done}")

        self.writer.spawn(lower())

    def _fits(self, like: PodEntry) -> bool:
        """One more replica like `like` fits on free GPUs now."""
        request = like.request
        return isinstance(decide(self.state.snapshot, request, self.policy()), Placement)

    def _grow(self, target: Target, count: int, hpa: str | None) -> None:
        key, spec = target.key, target.spec
        assert spec is not None
        self.writing.add(key)

        async def grow() -> None:
            try:
                if hpa is not None:
                    done = await self.writer.set_hpa_max(target.namespace, hpa,
                                                         lambda now, _low: min(now + 1, spec.maximum)
                                                         if now <= count else None)
                    what = f"HorizontalPodAutoscaler {target.namespace}/{hpa} maxReplicas to {done}"
                else:
                    done = await self.writer.scale(target.namespace, target.name,
                                                   lambda now: now + 1 if now == count else None)
                    what = f"replicas to {done}"
            except ApiError as exc:
                log.warning("Deployment %s: lending a replica failed: %s", key, exc)
                return
            finally:
                self.writing.discard(key)
            if done is None:
                return
            self.metrics.elastic_scaled.labels(direction="up").inc()
            log.info("Deployment %s: lent a replica (%s)", key, what)
            self.writer.event(target.namespace, target.name, target.uid, "Normal", "ElasticScaledUp",
                              f"Lent one borrowed replica on free GPUs: {what} (min {spec.minimum}, max "
                              f"{spec.maximum}); it is given back first when a guaranteed pod needs the GPUs")
            self.queue.on_event(ClusterEvent.GPU_FREED)

        self.writer.spawn(grow())

    def _gauges(self, replicas: dict[str, list[PodEntry]]) -> None:
        for key, target in self.targets.items():
            if target.spec is None:
                continue
            guaranteed, borrowed = self._tiers(key, replicas.get(key, []))
            self.metrics.elastic_replicas.labels(namespace=target.namespace, deployment=target.name,
                                         tier="guaranteed").set(len(guaranteed))
            self.metrics.elastic_replicas.labels(namespace=target.namespace, deployment=target.name,
                                         tier="borrowed").set(len(borrowed))
