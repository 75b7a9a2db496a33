"""A pod's node constraints (kube/podspec.py): spec.nodeSelector, the required node affinity and
the tolerations, checked and read into the placement core's `NodeConstraints`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpupool_sched.kube.pod_input import _Findings, _list, _map, _show, _text
from gpupool_sched.model.constraints import NodeConstraints, Requirement, Toleration
from gpupool_sched.model.request import InvalidRequest

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
