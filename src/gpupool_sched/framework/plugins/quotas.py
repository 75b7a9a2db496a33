"""GpuQuota objects in the scheduler: read and validated from the watch, resolved against Namespace
labels, usage counted from the ledger, the status to write back, and the two questions the cycle asks
(`check`: may this pod start; `reclaim`: whose borrowed pods may give GPUs back). The decisions are the
placement core's (placement/quota.py); this module only feeds them and says what the status should be
(writer/status.py writes it).

    kopf on.event gpuquotas, namespaces ──▶ QuotaBook.on_quota / on_namespace
    ClusterState.pods (assumed, bound, confirmed) ──▶ usage per quota
    cycle ──▶ check(plan) → Verdict     reclaim(plan, running) → list[RunningPod]
    ClusterState.watchers ──▶ _recount(entry): usage per namespace and per quota, kept as the ledger
        changes (a check costs O(quotas), not O(pods)); a quota's usage dropping ──▶ on_freed(quota),
        which wakes only the over-quota pods that wait for it (wake_hints)
    housekeeping ──▶ status_updates(): status.used / borrowed / namespaces / conditions where they changed,
        gauges ──▶ StatusWriter.quotas (writer/status.py) writes them, sent(update) for each written

An invalid GpuQuota (unknown or misspelt fields, negative or non-integer amounts, a malformed
selector) gets `Valid=False` with every problem in its message and is ignored: it governs no
namespace, and nothing else changes. The apiserver's schema (deploy/crds) already refuses most of
these; the checks here cover what a schema cannot (label syntax, `In` without values, misspelt
fields, which the schema keeps instead of pruning) and objects written against an older schema.

The parts: quota_spec.py (the object validated, the record kept of it), quota_ledger.py (`QuotaLedger`,
the base of `QuotaBook`: quotas resolved, usage counted from the ledger) and quota_status.py (the status
and gauges published), all in framework/plugins/.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.cache.events import ClusterEvent, Hint, QuotaFreed
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.idle import IdlePolicy
from gpupool_sched.framework.plugins.quota_ledger import QuotaLedger
from gpupool_sched.framework.plugins.quota_spec import InvalidQuota as InvalidQuota
from gpupool_sched.framework.plugins.quota_spec import _Record
from gpupool_sched.framework.plugins.quota_spec import parse_quota as parse_quota
from gpupool_sched.framework.plugins.quota_status import (
    QuotaGauges,
    QuotaStatus,
    _same_status,
    _with_transition_times,
    invalid_status,
    valid_status,
)
from gpupool_sched.kube.informer import WatchedKind
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.kube.podspec import InvalidPod
from gpupool_sched.placement.preemption import RunningPod
from gpupool_sched.placement.quota import Amount, Verdict, admit, demand_of, held_by, reclaim_candidates, total

if TYPE_CHECKING:
    from gpupool_sched.kube.podinfo import PodInfo
    from gpupool_sched.kube.podspec import PodPlan

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "gpupool.io", "v1alpha1", "gpuquotas"
QUOTAS_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
NAMESPACES_PATH = "/api/v1/namespaces"
VERIFY_EVERY = 60  # status_updates() calls (housekeeping: about a minute) between full recounts of the usage


class QuotaBook(QuotaLedger):
    """The cluster's GpuQuotas as the scheduler uses them. Runs on the scheduler's event loop thread."""

    def __init__(self, state: ClusterState, registry: CollectorRegistry | None = None) -> None:
        self._publishes = 0
        self.gauges = QuotaGauges(registry) if registry is not None else None
        super().__init__(state)

    # ---- watch events ---------------------------------------------------------------------------
    def on_quota(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name:
            return
        self._resolved = None
        if kind == "DELETED":
            self.records.pop(name, None)
            if self.gauges is not None:
                self.gauges.drop(name)
            return
        uid = str(meta.get("uid") or "")
        generation = int(meta.get("generation") or 0)
        observed = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
        old = self.records.get(name)
        try:
            spec, problem = parse_quota(obj), None
        except InvalidQuota as exc:
            spec, problem = None, str(exc)
            if old is None or old.problem != problem or old.generation != generation:
                log.warning("GpuQuota %s is invalid and ignored: %s", name, problem)
        sent = old.sent if old is not None and old.uid == uid and _same_status(observed, old.sent) else None
        self.records[name] = _Record(name, uid, generation, spec, problem, observed or {}, sent)

    def on_namespace(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name:
            return
        if kind == "DELETED":
            changed = self.namespaces.pop(name, None) is not None
        else:
            raw = meta.get("labels") or {}
            labels = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}
            labels.setdefault("kubernetes.io/metadata.name", name)
            changed = self.namespaces.get(name) != labels
            self.namespaces[name] = labels
        if changed:
            self._resolved = None

    async def resync(self, api: KubeApi) -> None:
        """Rebuild from a LIST of namespaces and GpuQuotas (a missing CRD: no quotas, logged)."""
        namespaces, _ = await api.list_raw(NAMESPACES_PATH)
        self.namespaces.clear()
        for obj in namespaces:
            self.on_namespace("ADDED", obj)
        try:
            quotas, _ = await api.list_raw(QUOTAS_PATH)
        except ApiError as exc:
            if exc.status != 404:
                raise
            log.warning("the GpuQuota CRD is not installed (deploy/crds): no team quotas")
            quotas = []
        self.records.clear()
        self._resolved = None
        for obj in quotas:
            self.on_quota("ADDED", obj)

    # ---- what failover and the queue ask --------------------------------------------------------
    def reclaimable_by(self, pod: PodInfo | Mapping[str, Any]) -> Callable[[PodEntry], bool] | None:
        """For a nomination of the pending pod `obj` adopted after a failover, whose victims are known only as
        its node's terminating pods: those a quota reclaim for it may have evicted whatever their priority
        (pods of another quota's team holding what it asks for). None when its namespace has no quota (it
        cannot reclaim), its request is invalid or counts nothing."""
        try:
            plan = self.state.plan(pod)
        except InvalidPod:
            return None
        demand = demand_of(plan.request, self.state.memory_unit_mib)
        self.quotas()
        team = self._governing.get(plan.namespace)
        if team is None or demand.is_zero:
            return None

        def victim(entry: PodEntry) -> bool:
            self.quotas()
            other = self._governing.get(self._namespace_of(entry))
            return other is not None and other != team and demand.overlaps(
                held_by(entry.placement, self.state.memory_unit_mib))

        return victim

    def wake_hints(self, verdict: Verdict) -> tuple[Hint, ...]:
        """What may admit a pod `verdict` refused: its quota changing, its team's usage dropping and, where
        the cohort's room (not the team's borrowing limit) is what it lacks, any team's usage dropping."""
        hints: list[Hint] = [ClusterEvent.QUOTA_CHANGED]
        self.quotas()
        quota = self._by_name.get(verdict.quota or "")
        if quota is None:
            return tuple(hints)
        hints.append(QuotaFreed(quota.name))
        limit, over, borrowing = quota.borrowing_limit, verdict.over, verdict.borrowed
        if (over.gpus and borrowing.gpus <= limit.gpus) or \
                (over.memory_units and borrowing.memory_units <= limit.memory_units):
            hints.append(QuotaFreed(None))
        return tuple(hints)

    # ---- what the cycle asks --------------------------------------------------------------------
    def check(self, plan: PodPlan) -> Verdict:
        """May `plan` start as far as quotas go (a refusal's message is for its Event)? The holds kept for
        it (a preemptor's) are its own room: not counted against it. A pod is a gang of one."""
        return self.admit_gang([plan], 1)[1]

    def check_gang(self, plans: Sequence[PodPlan]) -> Verdict:
        """May these pods of one namespace (a gang) start together?"""
        namespaces = {p.namespace for p in plans}
        if len(namespaces) > 1:
            raise ValueError(f"a gang's pods share one namespace, got {', '.join(sorted(namespaces))}")
        if not plans:
            return Verdict(True)
        unit = self.state.memory_unit_mib
        return self.check_demand(plans[0].namespace, total(demand_of(p.request, unit) for p in plans))

    def admit_gang(self, plans: Sequence[PodPlan], need: int) -> tuple[int, Verdict]:
        """How many of a gang's pending members (one namespace), taken in order, the quota admits to start
        together, and a verdict. Every member that is bound must pass admission, not just the first
        `need` (issue 16 A4): (0, refusal) when even the first `need` together are over; else (k >= need,
        the verdict of member k, the first left out, counted as if the k before it already ran), or
        (len(plans), ok) when all of them fit."""
        namespaces = {p.namespace for p in plans}
        if len(namespaces) > 1:
            raise ValueError(f"a gang's pods share one namespace, got {', '.join(sorted(namespaces))}")
        if not plans or need > len(plans):
            raise ValueError(f"need {need} of {len(plans)} members")
        unit = self.state.memory_unit_mib
        namespace = plans[0].namespace
        own = self._own_holds(p.uid for p in plans)  # the members' holds: their own room
        demand = total(demand_of(p.request, unit) for p in plans[:need])
        verdict = self.check_demand(namespace, demand, running=Amount() - own)
        if not verdict.ok:
            return 0, verdict
        count = need
        for member in plans[need:]:
            more = demand_of(member.request, unit)
            nxt = self.check_demand(namespace, more, running=demand - own)
            if not nxt.ok:
                return count, nxt
            demand += more
            count += 1
        return count, verdict

    def check_demand(self, namespace: str, demand: Amount, *, running: Amount | None = None) -> Verdict:
        """`running`: what the team is to start besides `demand` in the same decision (counted as used)."""
        quotas = self.quotas()
        if not quotas or demand.is_zero:
            return Verdict(True)
        used, cohort = self._used, self._cohort
        if running is not None and not running.is_zero:
            name = self._governing.get(namespace)
            if name is not None:
                used = {**used, name: used.get(name, Amount()) + running}
                cohort = replace(cohort, used=cohort.used + running)
        return admit(quotas, used, demand, namespace, cohort=cohort)

    def may_reclaim(self, namespace: str) -> bool:
        """Whether a pod of `namespace` could reclaim at all: a quota governs its namespace. Cheap: asked
        before the running pods are gathered for `reclaim_gang` (thousands of them for each pod that fits
        nowhere, in a namespace no quota governs)."""
        return bool(self.quotas()) and namespace in self._governing

    def idle_policy(self, namespace: str) -> IdlePolicy | None:
        """The idle policy (`spec.idleReclaim`) of the valid quota that governs `namespace`; None when none
        governs it or it sets none (the scheduler's default applies)."""
        self.quotas()
        name = self._governing.get(namespace)
        record = self.records.get(name) if name is not None else None
        return record.spec.idle_reclaim if record is not None and record.spec is not None else None

    def within_guarantee(self, plans: Sequence[PodPlan]) -> str | None:
        """The quota within whose guarantee these pods (one namespace) would run, all of them started
        (what the team holds, the pods' own holds not counted, plus their demand); None when no quota
        governs them or they would borrow."""
        if not plans:
            return None
        self.quotas()
        name = self._governing.get(plans[0].namespace)
        quota = self._by_name.get(name) if name is not None else None
        if quota is None:
            return None
        unit = self.state.memory_unit_mib
        demand = total(demand_of(p.request, unit) for p in plans)
        used = self._used.get(quota.name, Amount()) - self._own_holds(p.uid for p in plans)
        return quota.name if (used + demand).within(quota.guaranteed) else None

    def reclaim(self, plan: PodPlan, running: Iterable[RunningPod]) -> list[RunningPod]:
        """Borrowed pods that may be preempted so that `plan`'s team gets its guaranteed GPUs back, in
        victim order (lowest priority, then newest); empty when its team may not reclaim. `running`:
        the eviction candidates (victims.running_pods(state, budgets) without a priority bound). A pod is a
        gang of one."""
        return self.reclaim_gang([plan], running)

    def reclaim_gang(self, plans: Sequence[PodPlan], running: Iterable[RunningPod]) -> list[RunningPod]:
        """`reclaim` for a gang's pods (one namespace) together: its team must stay within its
        guarantee with all of them."""
        if not plans:
            return []
        unit = self.state.memory_unit_mib
        return self.reclaim_demand(plans[0].namespace, total(demand_of(p.request, unit) for p in plans), running,
                                   holding=[p.uid for p in plans])

    def reclaim_demand(self, namespace: str, demand: Amount, running: Iterable[RunningPod], *,
                       holding: Iterable[str] = ()) -> list[RunningPod]:
        """`holding`: the pods asking (their holds are not counted against them)."""
        quotas = self.quotas()
        if not quotas or demand.is_zero:
            return []
        pods = []
        for pod in running:
            entry = self.state.pods.get(pod.uid)
            pod_namespace = entry.key.partition("/")[0] if entry is not None else pod.request.namespace
            if pod.request.namespace != pod_namespace:  # a pod read without its spec: the ledger key knows
                pod = replace(pod, request=replace(pod.request, namespace=pod_namespace))
            pods.append(pod)
        used = self.usage()
        own = self._own_holds(holding)
        if (team := self._governing.get(namespace)) is not None and not own.is_zero:
            used[team] -= own
        return reclaim_candidates(quotas, used, pods, demand, namespace, memory_unit_mib=self.state.memory_unit_mib)

    # ---- status and gauges ----------------------------------------------------------------------
    def desired_status(self, name: str, used: Mapping[str, Amount] | None = None) -> dict[str, Any]:
        """The status the quota `name` should show (conditions without their transition times)."""
        record = self.records[name]
        if record.spec is None:
            return invalid_status(record)
        quotas = self.quotas()
        return valid_status(record, quotas, used if used is not None else self.usage())

    def status_updates(self) -> list[QuotaStatus]:
        """The status of every quota whose status differs from what it shows and from what was last sent
        (`sent`), transition times stamped; the gauges are updated. A status not marked sent (its write
        failed) is in the next call's updates again. Every VERIFY_EVERY calls, the usage is first checked
        against a full recount of the ledger."""
        self._publishes += 1
        if self._publishes % VERIFY_EVERY == 0:
            self.verify()
        used = self.usage()
        self._set_gauges(used)
        updates = []
        for name in sorted(self.records):
            record = self.records[name]
            desired = self.desired_status(name, used)
            if _same_status(record.observed, desired) or _same_status(record.sent, desired):
                continue
            updates.append(QuotaStatus(name, _with_transition_times(desired, record.observed), record))
        return updates

    def sent(self, update: QuotaStatus) -> None:
        """`update` was written: not written again while nothing changes."""
        update.record.sent = update.status

    def _set_gauges(self, used: Mapping[str, Amount]) -> None:
        if self.gauges is not None:
            self.gauges.update(self.records.values(), self.quotas(), used)


def quota_kinds(book: QuotaBook, changed: Callable[[], None]) -> list[WatchedKind]:
    """The namespaces and GpuQuotas a QuotaBook follows, as watched kinds (a missing CRD: no quotas)."""

    def no_crd(exc: ApiError) -> bool:
        if exc.status != 404:
            return False
        log.warning("the GpuQuota CRD is not installed (deploy/crds): no team quotas")
        return True

    def on_namespace(kind: str | None, obj: dict[str, Any]) -> None:
        book.on_namespace(kind, obj)
        changed()

    def on_quota(kind: str | None, obj: dict[str, Any]) -> None:
        book.on_quota(kind, obj)
        changed()

    return [WatchedKind("namespaces", NAMESPACES_PATH, on_namespace),
            WatchedKind(PLURAL, QUOTAS_PATH, on_quota, on_error=no_crd)]
