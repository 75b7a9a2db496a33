"""The wire format of kube-scheduler's extender verbs (k8s.io/kube-scheduler/extender/v1).

kube-scheduler sends Go field names as JSON keys (`Pod`, `NodeNames`, `PodUID`, ...) and reads the
answer in the same spelling. Parsing is strict about what the verbs need and reports the first
problem as a `BadRequest` (HTTP 400) with a message naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority: kube-scheduler multiplies by weight × 10


class BadRequest(ValueError):
    """The request body is not what the verb takes (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    pod: dict[str, Any]
    node_names: list[str]
    # nodeCacheCapable=false: full Node objects came; the answer then carries `Nodes`, not `NodeNames`
    full_nodes: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


@dataclass(frozen=True, slots=True)
class PreemptionArgs:
    pod: dict[str, Any]
    victims: dict[str, tuple[list[str], int]]  # node -> (victim UIDs, NumPDBViolations)


def _object(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"{what} must be a JSON object, not {type(body).__name__}")
    return body


def _pod(body: Mapping[str, Any]) -> dict[str, Any]:
    pod = body.get("Pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("`Pod` (a v1.Pod object) is missing")
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping) or not meta.get("uid") or not meta.get("name"):
        raise BadRequest("`Pod.metadata` needs `name` and `uid`")
    if not isinstance(pod.get("spec"), Mapping):
        raise BadRequest("`Pod.spec` is missing")
    return dict(pod)


def _string(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"`{key}` must be a non-empty string")
    return value


def parse_extender_args(body: Any) -> ExtenderArgs:
    """ExtenderArgs of filter and prioritize: `NodeNames` (nodeCacheCapable) or `Nodes.items`."""
    args = _object(body, "ExtenderArgs")
    pod = _pod(args)
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("`NodeNames` must be a list of strings")
        return ExtenderArgs(pod, list(names))
    nodes = args.get("Nodes")
    if isinstance(nodes, Mapping) and isinstance(nodes.get("items"), list):
        items = [n for n in nodes["items"] if isinstance(n, Mapping)]
        names = [str((n.get("metadata") or {}).get("name") or "") for n in items]
        if len(items) != len(nodes["items"]) or not all(names):
            raise BadRequest("every item of `Nodes.items` needs `metadata.name`")
        return ExtenderArgs(pod, names, [dict(n) for n in items])
    raise BadRequest("neither `NodeNames` nor `Nodes.items` given")


def parse_binding_args(body: Any) -> BindingArgs:
    args = _object(body, "ExtenderBindingArgs")
    return BindingArgs(_string(args, "PodName"), _string(args, "PodNamespace"), _string(args, "PodUID"),
                       _string(args, "Node"))


def parse_preemption_args(body: Any) -> PreemptionArgs:
    """`NodeNameToMetaVictims` (UIDs, nodeCacheCapable) or `NodeNameToVictims` (full pods)."""
    args = _object(body, "ExtenderPreemptionArgs")
    pod = _pod(args)
    victims: dict[str, tuple[list[str], int]] = {}
    meta = args.get("NodeNameToMetaVictims")
    full = args.get("NodeNameToVictims")
    source = meta if meta is not None else full
    if source is None:
        return PreemptionArgs(pod, victims)
    if not isinstance(source, Mapping):
        raise BadRequest("`NodeNameToMetaVictims` / `NodeNameToVictims` must be an object of node names")
    for node, entry in source.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("Pods") or [], list):
            raise BadRequest(f"victims of node {node!r} must be an object with a `Pods` list")
        uids: list[str] = []
        for p in entry.get("Pods") or []:
            uid = (p.get("UID") if meta is not None else (p.get("metadata") or {}).get("uid")) \
                if isinstance(p, Mapping) else None
            if not isinstance(uid, str) or not uid:
                raise BadRequest(f"a victim on node {node!r} has no UID")
            uids.append(uid)
        violations = entry.get("NumPDBViolations", 0)
        if not isinstance(violations, int):
            raise BadRequest(f"`NumPDBViolations` of node {node!r} must be an integer")
        victims[str(node)] = (uids, violations)
    return PreemptionArgs(pod, victims)


def filter_result(args: ExtenderArgs, passed: list[str], failed: Mapping[str, str],
                  unresolvable: Mapping[str, str], error: str = "") -> dict[str, Any]:
    """ExtenderFilterResult in the spelling kube-scheduler reads; `Nodes` when it sent full nodes."""
    out: dict[str, Any] = {"FailedNodes": dict(failed), "FailedAndUnresolvableNodes": dict(unresolvable),
                           "Error": error}
    if args.full_nodes is None:
        out["NodeNames"] = passed
    else:
        keep = set(passed)
        out["Nodes"] = {"items": [n for n in args.full_nodes if n["metadata"]["name"] in keep]}
    return out


def preemption_result(victims: Mapping[str, tuple[list[str], int]]) -> dict[str, Any]:
    return {"NodeNameToMetaVictims": {
        node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": n} for node, (uids, n) in victims.items()
    }}
