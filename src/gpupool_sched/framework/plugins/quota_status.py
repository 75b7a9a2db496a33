"""What the QuotaBook reports about each GpuQuota (framework/plugins/quotas.py): the status it should show (used,
borrowed, governed namespaces, Valid and Overlapping conditions), compared with the one it shows and
stamped with transition times (`QuotaStatus`: one to write, which writer/status.py does), and the per-quota
gauges."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from gpupool_sched.framework.plugins.quota_spec import _Record
from gpupool_sched.kube.kubeapi import now_rfc3339
from gpupool_sched.placement.quota import Amount, Quota, borrowed, overlaps


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

    def update(self, records: Collection[_Record], quotas: Sequence[Quota], used: Mapping[str, Amount]) -> None:
        """Set every gauge: `quotas` the valid ones (resolved), `used` what each one's namespaces hold."""
        for record in records:
            self.valid.labels(quota=record.name).set(1 if record.spec is not None else 0)
        for quota in quotas:
            amount = used.get(quota.name, Amount())
            lent = borrowed(quota, amount)
            for resource, attr in (("gpus", "gpus"), ("memory_units", "memory_units")):
                self.used.labels(quota=quota.name, resource=resource).set(getattr(amount, attr))
                self.borrowed.labels(quota=quota.name, resource=resource).set(getattr(lent, attr))
                self.guaranteed.labels(quota=quota.name, resource=resource).set(getattr(quota.guaranteed, attr))
                self.borrowing_limit.labels(quota=quota.name, resource=resource).set(
                    getattr(quota.borrowing_limit, attr))
        valid = {q.name for q in quotas}
        for name in {r.name for r in records} - valid:
            self.drop(name, keep_valid=True)

    def drop(self, name: str, *, keep_valid: bool = False) -> None:
        for gauge in (self.used, self.borrowed, self.guaranteed, self.borrowing_limit):
            for resource in ("gpus", "memory_units"):
                with contextlib.suppress(KeyError):
                    gauge.remove(name, resource)
        if not keep_valid:
            with contextlib.suppress(KeyError):
                self.valid.remove(name)


@dataclass(frozen=True, slots=True)
class QuotaStatus:
    """A GpuQuota's status to write (transition times stamped), and the record of the quota it is for."""

    name: str
    status: dict[str, Any]
    record: _Record


def invalid_status(record: _Record) -> dict[str, Any]:
    """The status of a GpuQuota ignored as invalid (conditions without their transition times)."""
    return {
        "used": _amount_json(Amount()), "borrowed": _amount_json(Amount()), "namespaces": [],
        "conditions": [_condition("Valid", "False", "InvalidSpec",
                                  f"ignored: {record.problem}", record.generation)],
    }


def valid_status(record: _Record, quotas: Sequence[Quota], used: Mapping[str, Amount]) -> dict[str, Any]:
    """The status of the valid GpuQuota of `record` (conditions without their transition times): `quotas`
    the valid ones (resolved), `used` what each one's namespaces hold."""
    name = record.name
    mine = next(q for q in quotas if q.name == name)
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
