"""The extender's brain: the scheduler's live state (`ClusterState`, fed by the watch) and placement
core behind kube-scheduler's verbs. Everything here runs on the event loop's thread (the HTTP
handlers and the kopf handlers share one loop), so the state needs no lock.

    filter      the core's filter chain on the nodes kube-scheduler sends (NodeNames)
    prioritize  the core's scorers on them, scaled to 0..10, the core's pick alone at 10
    bind        decide() restricted to kube-scheduler's node (the core picks the GPUs), assume it in
                the ledger, then the scheduler's Binder: handshake gate, Binding with the assignment
    preempt     kube-scheduler's victims, unchanged
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpupool_sched.cache.nodes import apply_node_event
from gpupool_sched.cache.policy import PolicyCache
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.cache.sync import caches_ready, initial_sync, stop_syncing
from gpupool_sched.framework.plugins.quotas import QuotaBook, quota_kinds
from gpupool_sched.framework.queue import QueuedPod
from gpupool_sched.kube.informer import Informers, WatchedKind
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import InvalidPod
from gpupool_sched.model.decision import Unschedulable
from gpupool_sched.placement.decide import decide
from gpupool_sched.writer.binder import Binder, BindOutcome

from .metrics import ExtenderMetrics
from .protocol import (
    BindingArgs,
    ExtenderArgs,
    PreemptionArgs,
    filter_result,
    preemption_result,
)
from .verdicts import extender_scores, verdicts

log = logging.getLogger(__name__)

PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


class NotReady(RuntimeError):
    """The state is not built yet (HTTP 503)."""


@dataclass(frozen=True)
class ExtenderConfig:
    scheduler_name: str = "default-scheduler"  # kube-scheduler's profile: its pending pods are cached
    policy: str = "gpupool"
    memory_unit_mib: int = 1024
    gate_timeout_s: float = 30.0
    confirm_ttl_s: float = 60.0
    bind_timeout_s: float = 25.0  # under kube-scheduler's httpTimeout for the extender (docs/extender.md)
    profile_window: int = 2000
    housekeeping_s: float = 1.0
    consistency_check_s: float = 300.0  # a re-list of every watched kind that repairs what the watch missed
    max_cached_pods: int = 50000
    freeze_gc: bool = False  # the process's own (CLI): gc.freeze() after the first sync (cache/gcpolicy.py)


class Extender:
    def __init__(self, config: ExtenderConfig, api: KubeApi, metrics: ExtenderMetrics | None = None) -> None:
        self.config = config
        self.api = api
        self.metrics = metrics or ExtenderMetrics()
        self.state = ClusterState(config.scheduler_name, memory_unit_mib=config.memory_unit_mib,
                                  gate_timeout_s=config.gate_timeout_s, confirm_ttl_s=config.confirm_ttl_s)
        self.policies = PolicyCache(config.policy, self.state, window=config.profile_window)
        # GpuQuota admission as the scheduler does it; the scheduler alone writes the quotas' status
        self.quotas = QuotaBook(self.state)
        self._pods: dict[str, PodInfo] = {}  # UID -> latest pending pod, read once (watch, filter args)
        self._outcomes: dict[str, BindOutcome] = {}
        self.rng = np.random.default_rng(0)
        # no queue: the Binder retries nothing here, kube-scheduler owns the retry
        self.binder = Binder(self.state, api, queue=None, metrics=self.metrics.binder,
                             is_leader=lambda: True, on_bound=self._bound)
        self.informers = Informers(api, [
            WatchedKind("priorityclasses", PRIORITY_CLASSES, self.on_priority_class),
            *quota_kinds(self.quotas, lambda: None),
            WatchedKind("nodes", "/api/v1/nodes", self.on_node),
            WatchedKind("pods", "/api/v1/pods", self.on_pod),
        ], registry=self.metrics.registry, component="extender", consistency_check_s=config.consistency_check_s)
        self.binder.on_read = lambda obj: self.informers["pods"].event("MODIFIED", obj)
        self.synced = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- workload profile ----------------------------------------------------------------------
    def _observe(self, uid: str, pod: PodInfo | None = None) -> None:
        if self.policies.observed(uid):
            return
        entry = self.state.pods.get(uid)
        if entry is not None:
            request = entry.request
        elif pod is not None:
            try:
                request = self.state.plan(pod).request
            except InvalidPod:
                return
        else:
            return
        self.policies.observe(uid, request)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await initial_sync(self.informers, freeze_gc=self.config.freeze_gc)
        self.synced.set()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._housekeeping(), name="housekeeping"),
                       loop.create_task(self.informers.run_checks(), name="consistency-check")]
        log.info("extender for %s started: %d nodes, %d pods in the ledger", self.config.scheduler_name,
                 len(self.state.nodes), len(self.state.pods))

    async def stop(self) -> None:
        await stop_syncing(self.informers, self._tasks)
        await self.binder.drain()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.config.housekeeping_s)
            try:
                for entry in self.state.expire():  # bound but not seen bound: read the pod
                    namespace, _, name = entry.key.partition("/")
                    self.binder.verify(entry.uid, entry.key, namespace, name, entry.node, None)
            except Exception:
                log.exception("housekeeping failed")

    def readiness(self) -> tuple[bool, str]:
        ledger = f"{len(self.state.nodes)} nodes, {len(self.state.pods)} pods in the ledger"
        return caches_ready(self.synced, f"synced: {ledger}")

    # ---- watch events ------------------------------------------------------------------------------
    def on_priority_class(self, kind: str | None, obj: dict[str, Any]) -> None:
        self.state.apply_priority_class(kind, obj)

    def on_node(self, kind: str | None, obj: dict[str, Any]) -> None:
        apply_node_event(self.state, self.policies.profile, kind, obj)

    def on_pod(self, kind: str | None, obj: dict[str, Any]) -> None:
        info = self._info(obj)
        update = self.state.apply_pod(info, deleted=kind == "DELETED")
        if update.gone:
            self._pods.pop(info.uid, None)
            self._observe(info.uid)
        elif update.pending_ours:
            self._remember(info)

    def _info(self, obj: dict[str, Any]) -> PodInfo:
        """The pod read once: the record kept for this version of it (the watch, then filter, prioritize
        and bind of one attempt all carry the same one), else a new one taking over unchanged plans."""
        info = PodInfo.of(obj)
        known = self._pods.get(info.uid)
        if known is not None and info.resource_version and known.resource_version == info.resource_version:
            return known
        return info.follows(known)

    def _remember(self, info: PodInfo) -> None:
        if not info.uid:
            return
        if info.uid not in self._pods and len(self._pods) >= self.config.max_cached_pods:
            self._pods.pop(next(iter(self._pods)))
        self._pods[info.uid] = info

    # ---- the verbs ---------------------------------------------------------------------------------
    def _ready(self) -> None:
        if not self.synced.is_set():
            raise NotReady("the extender's caches are not synced yet")
        if self.informers.stale:  # kube-scheduler retries; an answer now could name a deleted node
            raise NotReady("the extender is re-listing after a watch gap")

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        self._ready()
        info = self._info(args.pod)
        self._remember(info)
        try:
            plan = self.state.plan(info)
        except InvalidPod as exc:
            bucket = {n: str(exc) for n in args.node_names}
            self.metrics.filtered.labels(result="failed").inc(len(bucket))
            if exc.permanent:
                return filter_result(args, [], {}, bucket)
            return filter_result(args, [], bucket, {})
        self._observe(info.uid, info)
        verdict = self.quotas.check(plan)
        if not verdict.ok:  # no node helps: the team's quota does (kube-scheduler retries on pod events)
            bucket = {n: verdict.message for n in args.node_names}
            self.metrics.filtered.labels(result="failed").inc(len(bucket))
            return filter_result(args, [], bucket, {})
        v = verdicts(self.state.snapshot, plan.request, self.policies.current(), self.rng)
        feasible = set(v.feasible.tolist())
        index = self.state.snapshot.index
        passed: list[str] = []
        failed: dict[str, str] = {}
        for name in args.node_names:
            row = index.get(name)
            if row is None:
                failed[name] = "node unknown to the gpupool extender (not in its watch yet)"
            elif row in feasible:
                passed.append(name)
            else:
                failed[name] = v.reasons.get(row, "does not fit")
        self.metrics.filtered.labels(result="passed").inc(len(passed))
        self.metrics.filtered.labels(result="failed").inc(len(failed))
        return filter_result(args, passed, failed, {})

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        """HostPriorityList: every node kube-scheduler sent; the infeasible ones score 0."""
        self._ready()
        try:
            plan = self.state.plan(self._info(args.pod))
        except InvalidPod:
            return [{"Host": n, "Score": 0} for n in args.node_names]
        policy = self.policies.current()
        v = verdicts(self.state.snapshot, plan.request, policy, self.rng)
        index = self.state.snapshot.index
        wanted = {r for n in args.node_names if (r := index.get(n)) is not None}
        rows = np.array(sorted(wanted.intersection(v.feasible.tolist())), dtype=np.int64)
        scores = extender_scores(v, policy, rows)
        return [{"Host": n, "Score": scores.get(index.get(n, -1), 0)} for n in args.node_names]

    async def bind(self, args: BindingArgs) -> dict[str, Any]:
        """ExtenderBindingResult: `Error` empty when the Binding (with the assignment) was accepted."""
        self._ready()
        key = f"{args.pod_namespace}/{args.pod_name}"
        info = self._pods.get(args.pod_uid)
        if info is None:
            try:
                info = PodInfo.of(await self._read_pod(args.pod_namespace, args.pod_name))
            except ApiError as exc:
                return {"Error": f"pod {key}: cannot read it: {exc}"}
        if info.uid != args.pod_uid:
            return {"Error": f"pod {key} is not the pod {args.pod_uid} any more (replaced by a namesake)"}
        try:
            plan = self.state.plan(info)
        except InvalidPod as exc:
            return {"Error": f"pod {key}: {exc}"}
        entry = self.state.pods.get(plan.uid)
        if entry is not None:
            return {"Error": f"pod {key} is already {entry.phase.value} on {entry.node}"}
        verdict = self.quotas.check(plan)  # again: pods filtered before this one's bind may have used it up
        if not verdict.ok:
            return {"Error": f"pod {key}: {verdict.message}"}
        row = self.state.snapshot.index.get(args.node)
        if row is None:
            return {"Error": f"node {args.node} is unknown to the gpupool extender"}
        policy = self.policies.current()
        v = verdicts(self.state.snapshot, plan.request, policy, self.rng)
        if not (v.feasible == row).any():
            return {"Error": f"pod {key} does not fit on {args.node} any more: {v.reasons.get(row, 'does not fit')}"}
        started = time.perf_counter()
        decision = decide(self.state.snapshot, plan.request, policy, self.rng, sample=lambda c: c[c == row])
        self.metrics.binder.algorithm_latency.observe(time.perf_counter() - started)
        if isinstance(decision, Unschedulable):  # cannot happen after the verdict above; answered anyway
            return {"Error": f"pod {key} does not fit on {args.node}"}
        try:
            self.state.assume(plan, decision)
        except ValueError as exc:
            return {"Error": str(exc)}
        item = QueuedPod(uid=plan.uid, key=key, priority=plan.priority, created=plan.created)
        try:
            await asyncio.wait_for(self.binder.bind_one(plan, decision, item, time.monotonic()),
                                   self.config.bind_timeout_s)
        except TimeoutError:
            self._outcomes.pop(plan.uid, None)
            return {"Error": f"pod {key}: no Binding within {self.config.bind_timeout_s:.0f}s (waiting at the "
                             f"handshake gate of {args.node}); kube-scheduler retries it"}
        outcome = self._outcomes.pop(plan.uid, None)
        if outcome is None:  # the pod went while waiting at the gate
            return {"Error": f"pod {key} was deleted before its Binding"}
        if not outcome.ok:
            return {"Error": f"binding {key} to {args.node} failed: {outcome.error}"}
        self._pods.pop(plan.uid, None)
        return {"Error": ""}

    def preempt(self, args: PreemptionArgs) -> dict[str, Any]:
        """kube-scheduler's victims, unchanged (its own choice, by its own view of resources)."""
        self._ready()
        return preemption_result(args.victims)

    def _bound(self, outcome: BindOutcome, _: QueuedPod) -> None:
        self._outcomes[outcome.plan.uid] = outcome

    async def _read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            resp = self.api.core.read_namespaced_pod(name, namespace, _preload_content=False)
            try:
                return dict(json.loads(resp.data))
            finally:
                resp.release_conn()

        return await self.api.call(read)
