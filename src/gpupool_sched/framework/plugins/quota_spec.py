"""A GpuQuota object (framework/plugins/quotas.py): its spec read and validated (`parse_quota`, `InvalidQuota`
naming every problem), and the record the QuotaBook keeps of each one it has seen on the watch."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool_sched.framework.plugins.idle import IdlePolicy, parse_policy
from gpupool_sched.kube.labelselector import LabelSelector
from gpupool_sched.placement.quota import Amount

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class InvalidQuota(ValueError):
    """A GpuQuota the scheduler cannot use; the message lists every problem."""


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    name: str
    selector: LabelSelector
    guaranteed: Amount
    borrowing_limit: Amount
    idle_reclaim: IdlePolicy | None = None  # spec.idleReclaim: the idle policy of its namespaces


def parse_quota(obj: Mapping[str, Any]) -> QuotaSpec:
    """The GpuQuota's spec, or InvalidQuota naming every problem (field paths as in the object)."""
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    problems: list[str] = []
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidQuota("spec must be an object")
    _unknown(spec, "spec", ("namespaceSelector", "guaranteed", "borrowingLimit", "idleReclaim"), problems)
    selector = _selector(spec.get("namespaceSelector"), problems)
    if "guaranteed" not in spec:
        problems.append("spec.guaranteed is required")
    guaranteed = _amount(spec.get("guaranteed"), "spec.guaranteed", problems)
    limit = _amount(spec.get("borrowingLimit"), "spec.borrowingLimit", problems)
    idle = parse_policy(spec.get("idleReclaim"), "spec.idleReclaim", problems)
    if problems:
        raise InvalidQuota("; ".join(problems))
    return QuotaSpec(name, selector, guaranteed, limit,
                     None if idle is None else IdlePolicy(idle.action, idle.idle_after_s, f"GpuQuota {name}"))


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


@dataclass(slots=True)
class _Record:
    name: str
    uid: str
    generation: int
    spec: QuotaSpec | None
    problem: str | None
    observed: Mapping[str, Any]  # status as last seen on the watch
    sent: dict[str, Any] | None = None  # status last written (None: write when it differs)
