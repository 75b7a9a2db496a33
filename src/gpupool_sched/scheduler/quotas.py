"""GpuQuota objects in the scheduler: read and validated from the watch, resolved against Namespace
labels, usage counted from the ledger, status written back, and the two questions the cycle asks
(`check`: may this pod start; `reclaim`: whose borrowed pods may give GPUs back). The decisions are the
placement core's (placement/quota.py); this module only feeds them and reports.

    kopf on.event gpuquotas, namespaces ──▶ QuotaBook.on_quota / on_namespace
    ClusterState.pods (assumed, bound, confirmed) ──▶ usage per quota
    cycle ──▶ check(plan) → Verdict     reclaim(plan, running) → list[RunningPod]
    ClusterState.watchers ──▶ _recount(entry): usage per namespace and per quota, kept as the ledger
        changes (a check costs O(quotas), not O(pods)); a quota's usage dropping ──▶ on_freed(quota),
        which wakes only the over-quota pods that wait for it (wake_hints)
    housekeeping ──▶ publish(api): status.used / borrowed / namespaces / conditions, gauges

An invalid GpuQuota (unknown or misspelt fields, negative or non-integer amounts, a malformed
selector) gets `Valid=False` with every problem in its message and is ignored: it governs no
namespace, and nothing else changes. The apiserver's schema (deploy/crds) already refuses most of
these; the checks here cover what a schema cannot (label syntax, `In` without values, misspelt
fields, which the schema keeps instead of pruning) and objects written against an older schema.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from gpupool_sched.placement.preemption import RunningPod
from gpupool_sched.placement.quota import (
    Amount,
    Cohort,
    Quota,
    Verdict,
    admit,
    borrowed,
    demand_of,
    held_by,
    overlaps,
    owners,
    reclaim_candidates,
    total,
)
from gpupool_sched.placement.quota import usage as count_usage
from gpupool_sched.scheduler.informer import WatchedKind
from gpupool_sched.scheduler.kubeapi import ApiError, KubeApi, now_rfc3339
from gpupool_sched.scheduler.labelselector import LabelSelector
from gpupool_sched.scheduler.podspec import InvalidPod
from gpupool_sched.scheduler.queue import ClusterEvent, Hint, QuotaFreed
from gpupool_sched.scheduler.state import ClusterState, Phase, PodEntry

if TYPE_CHECKING:
    from gpupool_sched.scheduler.podspec import PodPlan

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "gpupool.io", "v1alpha1", "gpuquotas"
QUOTAS_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
NAMESPACES_PATH = "/api/v1/namespaces"
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# every entry: a NOMINATED hold counts against its preemptor's team (what it reclaimed stays its own: issue 16 A5)
_COUNTED = frozenset((Phase.ASSUMED, Phase.BOUND, Phase.CONFIRMED, Phase.NOMINATED))
VERIFY_EVERY = 60  # publish() calls (housekeeping: about a minute) between full recounts of the usage


class InvalidQuota(ValueError):
    """A GpuQuota the scheduler cannot use; the message lists every problem."""


# ---- the object ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class QuotaSpec:
    name: str
    selector: LabelSelector
    guaranteed: Amount
    borrowing_limit: Amount


def parse_quota(obj: Mapping[str, Any]) -> QuotaSpec:
    """The GpuQuota's spec, or InvalidQuota naming every problem (field paths as in the object)."""
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    problems: list[str] = []
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidQuota("spec must be an object")
    _unknown(spec, "spec", ("namespaceSelector", "guaranteed", "borrowingLimit"), problems)
    selector = _selector(spec.get("namespaceSelector"), problems)
    if "guaranteed" not in spec:
        problems.append("spec.guaranteed is required")
    guaranteed = _amount(spec.get("guaranteed"), "spec.guaranteed", problems)
    limit = _amount(spec.get("borrowingLimit"), "spec.borrowingLimit", problems)
    if problems:
        raise InvalidQuota("; ".join(problems))
    return QuotaSpec(name, selector, guaranteed, limit)


def _unknown(obj: Mapping[str, Any], path: str, known: Sequence[str], problems: list[str]) -> None:
    for key in sorted(set(obj) - set(known), key=str):
        problems.append(f"unknown field {path}.{key} (known: {', '.join(known)})")


def _amount(value: Any, path: str, problems: list[str]) -> Amount:
    if value is None:
        return Amount()
    if not isinstance(value, Mapping):
        problems.append(f"{path} must be an object with gpus and memoryUnits")
        return Amount()
    _unknown(value, path, ("gpus", "memoryUnits"), problems)
    out = []
    for key in ("gpus", "memoryUnits"):
        n = value.get(key, 0)
        if isinstance(n, bool) or not isinstance(n, int):
            problems.append(f"{path}.{key} must be a whole number, not {n!r}")
            n = 0
        elif n < 0:
            problems.append(f"{path}.{key} must not be negative ({n})")
            n = 0
        out.append(n)
    return Amount(out[0], out[1])


def _label_key(key: Any, path: str, problems: list[str]) -> bool:
    if not isinstance(key, str) or not key:
        problems.append(f"{path}: a label key must be a non-empty string, not {key!r}")
        return False
    prefix, slash, name = key.rpartition("/")
    if (slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or not name or \
            len(name) > 63 or not _LABEL_NAME.match(name):
        problems.append(f"{path}: {key!r} is not a valid label key")
        return False
    return True


def _label_value(value: Any, path: str, problems: list[str]) -> bool:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_NAME.match(value):
        problems.append(f"{path}: {value!r} is not a valid label value")
        return False
    return True


def _selector(value: Any, problems: list[str]) -> LabelSelector:
    path = "spec.namespaceSelector"
    if value is None:
        problems.append(f"{path} is required ({{}} selects every namespace)")
        return LabelSelector()
    if not isinstance(value, Mapping):
        problems.append(f"{path} must be a label selector (matchLabels, matchExpressions)")
        return LabelSelector()
    _unknown(value, path, ("matchLabels", "matchExpressions"), problems)
    labels: list[tuple[str, str]] = []
    raw_labels = value.get("matchLabels") or {}
    if not isinstance(raw_labels, Mapping):
        problems.append(f"{path}.matchLabels must be a map of label keys to values")
        raw_labels = {}
    for key, val in raw_labels.items():
        where = f"{path}.matchLabels"
        if _label_key(key, where, problems) and _label_value(val, f"{where}[{key}]", problems):
            labels.append((key, val))
    expressions: list[tuple[str, str, frozenset[str]]] = []
    raw_expressions = value.get("matchExpressions") or []
    if not isinstance(raw_expressions, list):
        problems.append(f"{path}.matchExpressions must be a list")
        raw_expressions = []
    for i, expr in enumerate(raw_expressions):
        where = f"{path}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping):
            problems.append(f"{where} must be an object with key, operator and values")
            continue
        _unknown(expr, where, ("key", "operator", "values"), problems)
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values")
        ok = _label_key(key, f"{where}.key", problems)
        if op not in OPERATORS:
            problems.append(f"{where}.operator must be one of {', '.join(OPERATORS)}, not {op!r}")
            ok = False
        if values is not None and not isinstance(values, list):
            problems.append(f"{where}.values must be a list of strings")
            continue
        values = values or []
        if op in ("In", "NotIn") and not values:
            problems.append(f"{where}: operator {op} needs at least one value")
            ok = False
        if op in ("Exists", "DoesNotExist") and values:
            problems.append(f"{where}: operator {op} takes no values")
            ok = False
        ok = all([_label_value(v, f"{where}.values", problems) for v in values]) and ok
        if ok:
            expressions.append((str(key), str(op), frozenset(values)))
    return LabelSelector(tuple(sorted(labels)), tuple(expressions))


# ---- the book -----------------------------------------------------------------------------------

@dataclass(slots=True)
class _Record:
    name: str
    uid: str
    generation: int
    spec: QuotaSpec | None
    problem: str | None
    observed: Mapping[str, Any]  # status as last seen on the watch
    sent: dict[str, Any] | None = None  # status last written (None: write when it differs)


@dataclass(frozen=True, slots=True)
class _Held:
    namespace: str  # whose quota it counts against
    amount: Amount


@dataclass
class QuotaGauges:
    """Per-quota gauges, labelled by quota and resource (gpus, memory_units)."""

    registry: CollectorRegistry
    used: Gauge = field(init=False)
    guaranteed: Gauge = field(init=False)
    borrowing_limit: Gauge = field(init=False)
    borrowed: Gauge = field(init=False)
    valid: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        labels = ["quota", "resource"]
        self.used = Gauge("gpupool_scheduler_quota_used", "What a GpuQuota's namespaces hold (running and "
                          "just scheduled pods)", labels, registry=r)
        self.guaranteed = Gauge("gpupool_scheduler_quota_guaranteed", "A GpuQuota's guaranteed amount", labels,
                                registry=r)
        self.borrowing_limit = Gauge("gpupool_scheduler_quota_borrowing_limit",
                                     "How much beyond guaranteed a GpuQuota may borrow", labels, registry=r)
        self.borrowed = Gauge("gpupool_scheduler_quota_borrowed", "What a GpuQuota's namespaces use beyond its "
                              "guaranteed amount (borrowed from other quotas)", labels, registry=r)
        self.valid = Gauge("gpupool_scheduler_quota_valid", "1 for a valid GpuQuota, 0 for one ignored as invalid",
                           ["quota"], registry=r)


class QuotaBook:
    """The cluster's GpuQuotas as the scheduler uses them. Runs on the scheduler's event loop thread."""

    def __init__(self, state: ClusterState, registry: CollectorRegistry | None = None) -> None:
        self.state = state
        self.records: dict[str, _Record] = {}
        self.namespaces: dict[str, dict[str, str]] = {}  # name -> labels
        self._resolved: list[Quota] | None = None
        self._governing: dict[str, str] = {}  # namespace -> the quota that governs it (with _resolved)
        self._used: dict[str, Amount] = {}  # valid quota -> what its namespaces hold (with _resolved)
        self._cohort = Cohort({}, Amount(), Amount())  # admit()'s sums and owners (with _resolved, _used)
        self._by_name: dict[str, Quota] = {}  # the valid quotas (with _resolved)
        self._held: dict[str, _Held] = {}  # ledger UID -> what it counts (entries holding nothing: absent)
        self._by_namespace: dict[str, Amount] = {}  # namespace -> what its entries hold
        self.on_freed: Callable[[str | None], object] = lambda quota: None  # see _recount
        self.recounts = 0  # verify() calls; drift repaired by them is logged
        self._publishes = 0
        self.gauges = QuotaGauges(registry) if registry is not None else None
        state.watchers.append(self._recount)
        for entry in list(state.pods.values()):
            self._recount(entry)

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
                self._drop_gauges(name)
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

    # ---- what the core is given -----------------------------------------------------------------
    def quotas(self) -> list[Quota]:
        """The valid quotas, their selectors resolved to today's namespaces, by name."""
        if self._resolved is None:
            out = []
            for record in sorted(self.records.values(), key=lambda r: r.name):
                if record.spec is None:
                    continue
                selector = record.spec.selector
                chosen = frozenset(ns for ns, labels in self.namespaces.items() if selector.matches(labels))
                out.append(Quota(record.name, chosen, record.spec.guaranteed, record.spec.borrowing_limit))
            self._resolved = out
            self._governing = owners(out)
            used = {q.name: Amount() for q in out}
            for namespace, amount in self._by_namespace.items():
                name = self._governing.get(namespace)
                if name is not None:
                    used[name] += amount
            self._used = used
            self._by_name = by_name = {q.name: q for q in out}
            self._cohort = Cohort({ns: by_name[name] for ns, name in self._governing.items()},
                                  total(q.guaranteed for q in out), total(used.values()))
        return self._resolved

    def usage(self) -> dict[str, Amount]:
        """What each valid quota's namespaces hold now (assumed, bound, confirmed), kept up to date as the
        ledger changes (`_recount`): O(quotas), not a scan of the ledger."""
        self.quotas()
        return dict(self._used)

    def recount(self) -> dict[str, Amount]:
        """`usage()` counted afresh from the whole ledger, O(pods): the reference the incremental count
        is tested and checked (`verify`) against."""
        unit = self.state.memory_unit_mib
        return count_usage(self.quotas(), ((self._namespace_of(e), held_by(e.placement, unit))
                                           for e in self.state.pods.values() if e.phase in _COUNTED))

    def verify(self) -> bool:
        """Recount the whole ledger; a difference from the incremental usage (a ledger change that bypassed
        ClusterState's watchers) is logged and repaired. True when there was none."""
        self.recounts += 1
        expected = self.recount()
        if expected == self.usage():
            return True
        log.warning("GpuQuota usage drifted from the ledger (kept %s, counted %s); repaired", self.usage(), expected)
        self._held.clear()
        self._by_namespace.clear()
        self._resolved = None
        for entry in list(self.state.pods.values()):
            self._recount(entry)
        self.quotas()
        return False

    def _recount(self, entry: PodEntry) -> None:
        """ClusterState's watcher: `entry` joined or left the ledger, or what it holds changed. Moves its
        amount between the namespace and quota totals; a quota whose usage dropped is told to `on_freed`
        (then None: the cohort has more room to lend)."""
        uid = entry.uid
        old = self._held.pop(uid, None)
        new: _Held | None = None
        if self.state.pods.get(uid) is entry and entry.phase in _COUNTED:
            amount = held_by(entry.placement, self.state.memory_unit_mib)
            if not amount.is_zero:
                new = self._held[uid] = _Held(self._namespace_of(entry), amount)
        if old == new:
            return
        self.quotas()  # _governing and _used current
        touched = {name for h in (old, new) if h is not None and (name := self._governing.get(h.namespace))}
        before = {name: self._used[name] for name in touched}
        cohort_used = before_cohort = self._cohort.used
        if old is not None:
            self._by_namespace[old.namespace] = self._by_namespace.get(old.namespace, Amount()) - old.amount
            if (name := self._governing.get(old.namespace)) is not None:
                self._used[name] -= old.amount
                cohort_used -= old.amount
        if new is not None:
            self._by_namespace[new.namespace] = self._by_namespace.get(new.namespace, Amount()) + new.amount
            if (name := self._governing.get(new.namespace)) is not None:
                self._used[name] += new.amount
                cohort_used += new.amount
        if touched:
            self._cohort = replace(self._cohort, used=cohort_used)
        freed = sorted(name for name in touched if not before[name].within(self._used[name]))
        for name in freed:
            self.on_freed(name)
        if freed and not before_cohort.within(self._cohort.used):  # not e.g. a victim's GPUs turned into a hold
            self.on_freed(None)

    def _namespace_of(self, entry: PodEntry) -> str:
        """The namespace whose quota a ledger entry counts against: its pod's, or for a hold (what a gone
        victim freed, kept for a preemptor) its preemptor's."""
        if entry.phase is not Phase.NOMINATED:
            return entry.key.partition("/")[0]
        nomination = self.state.nominations.get(entry.uid.split("/")[1] if entry.uid.startswith("hold/") else "")
        if nomination is not None:
            return nomination.key.partition("/")[0]
        return entry.key.removeprefix("hold for ").partition("/")[0]

    def _own_holds(self, preemptors: Iterable[str]) -> Amount:
        """What the holds kept for these pods count (against their own team): not counted against
        themselves when they are checked, as they take that room when placed."""
        out = Amount()
        for uid in preemptors:
            nomination = self.state.nominations.get(uid)
            for hold in nomination.holds if nomination is not None else ():
                held = self._held.get(hold)
                if held is not None:
                    out += held.amount
        return out

    def reclaimable_by(self, obj: Mapping[str, Any]) -> Callable[[PodEntry], bool] | None:
        """For a nomination of the pending pod `obj` adopted after a failover, whose victims are known only as
        its node's terminating pods: those a quota reclaim for it may have evicted whatever their priority
        (pods of another quota's team holding what it asks for). None when its namespace has no quota (it
        cannot reclaim), its request is invalid or counts nothing."""
        try:
            plan = self.state.plan(obj)
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
        it (a preemptor's) are its own room: not counted against it."""
        return self.check_demand(plan.namespace, demand_of(plan.request, self.state.memory_unit_mib),
                                 running=Amount() - self._own_holds((plan.uid,)))

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

    def reclaim(self, plan: PodPlan, running: Iterable[RunningPod]) -> list[RunningPod]:
        """Borrowed pods that may be preempted so that `plan`'s team gets its guaranteed GPUs back, in
        victim order (lowest priority, then newest); empty when its team may not reclaim. `running`:
        the eviction candidates (preemptor.running_pods(state, budgets) without a priority bound)."""
        return self.reclaim_demand(plan.namespace, demand_of(plan.request, self.state.memory_unit_mib), running,
                                   holding=(plan.uid,))

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
            return {
                "used": _amount_json(Amount()), "borrowed": _amount_json(Amount()), "namespaces": [],
                "conditions": [_condition("Valid", "False", "InvalidSpec",
                                          f"ignored: {record.problem}", record.generation)],
            }
        quotas = self.quotas()
        mine = next(q for q in quotas if q.name == name)
        used = used if used is not None else self.usage()
        lost = overlaps(quotas).get(name, {})
        governed = sorted(mine.namespaces - set(lost))
        amount = used.get(name, Amount())
        conditions = [_condition("Valid", "True", "Accepted",
                                 f"governs {len(governed)} namespace(s)", record.generation)]
        if lost:
            text = ", ".join(f"{ns} (by GpuQuota {other})" for ns, other in sorted(lost.items()))
            conditions.append(_condition(
                "Overlapping", "True", "NamespaceGovernedElsewhere",
                f"selected namespaces governed by a quota earlier by name, not by this one: {text}",
                record.generation))
        else:
            conditions.append(_condition("Overlapping", "False", "NoOverlap",
                                         "no other quota governs a namespace this one selects", record.generation))
        return {
            "used": _amount_json(amount),
            "borrowed": _amount_json(borrowed(mine, amount)),
            "namespaces": governed,
            "conditions": conditions,
        }

    async def publish(self, api: KubeApi) -> int:
        """Write the status of every quota whose status differs from what it shows; update the gauges.
        Returns how many were written. A failed write is logged and retried on the next call. Every
        VERIFY_EVERY calls, the usage is first checked against a full recount of the ledger."""
        self._publishes += 1
        if self._publishes % VERIFY_EVERY == 0:
            self.verify()
        used = self.usage()
        self._set_gauges(used)
        written = 0
        for name in sorted(self.records):
            record = self.records[name]
            desired = self.desired_status(name, used)
            if _same_status(record.observed, desired) or _same_status(record.sent, desired):
                continue
            status = _with_transition_times(desired, record.observed)
            try:
                await api.patch_cluster_custom_status(GROUP, VERSION, PLURAL, name, status)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("GpuQuota %s: writing its status failed: %s", name, exc)
                continue
            record.sent = status
            written += 1
        return written

    def _set_gauges(self, used: Mapping[str, Amount]) -> None:
        g = self.gauges
        if g is None:
            return
        for record in self.records.values():
            g.valid.labels(quota=record.name).set(1 if record.spec is not None else 0)
        for quota in self.quotas():
            amount = used.get(quota.name, Amount())
            lent = borrowed(quota, amount)
            for resource, attr in (("gpus", "gpus"), ("memory_units", "memory_units")):
                g.used.labels(quota=quota.name, resource=resource).set(getattr(amount, attr))
                g.borrowed.labels(quota=quota.name, resource=resource).set(getattr(lent, attr))
                g.guaranteed.labels(quota=quota.name, resource=resource).set(getattr(quota.guaranteed, attr))
                g.borrowing_limit.labels(quota=quota.name, resource=resource).set(
                    getattr(quota.borrowing_limit, attr))
        valid = {q.name for q in self.quotas()}
        for name in {r.name for r in self.records.values()} - valid:
            self._drop_gauges(name, keep_valid=True)

    def _drop_gauges(self, name: str, *, keep_valid: bool = False) -> None:
        g = self.gauges
        if g is None:
            return
        for gauge in (g.used, g.borrowed, g.guaranteed, g.borrowing_limit):
            for resource in ("gpus", "memory_units"):
                with contextlib.suppress(KeyError):
                    gauge.remove(name, resource)
        if not keep_valid:
            with contextlib.suppress(KeyError):
                g.valid.remove(name)


def _amount_json(amount: Amount) -> dict[str, int]:
    return {"gpus": amount.gpus, "memoryUnits": amount.memory_units}


def _condition(kind: str, status: str, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message[:1024],
            "observedGeneration": generation}


def _comparable(status: Mapping[str, Any] | None) -> Any:
    if not status:
        return None
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                  for c in status.get("conditions") or () if isinstance(c, Mapping)]
    return ({k: status.get(k) for k in ("used", "borrowed", "namespaces")},
            sorted(conditions, key=lambda c: str(c.get("type"))))


def _same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    return a is not None and b is not None and _comparable(a) == _comparable(b)


def _with_transition_times(desired: dict[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
    """Conditions keep the lastTransitionTime they show while their status stays the same."""
    before = {c.get("type"): c for c in observed.get("conditions") or () if isinstance(c, Mapping)}
    now = now_rfc3339()
    conditions = []
    for cond in desired["conditions"]:
        old = before.get(cond["type"]) or {}
        kept = old.get("lastTransitionTime") if old.get("status") == cond["status"] else None
        conditions.append({**cond, "lastTransitionTime": kept or now})
    return {**desired, "conditions": conditions}


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
