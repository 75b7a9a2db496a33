"""Node constraints as filters: cordons, node selector / required node affinity, and taints
(kube-scheduler's NodeUnschedulable, NodeAffinity and TaintToleration plugins, in that order).

They must stay cheap at tens of thousands of nodes, so nothing is evaluated per node: a pod's
constraints are evaluated once per distinct node *signature* (labels, taints, cordon; see
``NodeSignature``) and the per-signature answers are cached in ``snapshot.signature_caches``
(valid across node changes: signature ids are never reused, new ones are evaluated on demand). The
per-node boolean mask (answers indexed by each node's signature id) is cached in
``snapshot.caches``, which node changes clear. Requirements on the node name (matchFields
``metadata.name``) are the one part that is per node; they are vectorised through the name index.

A pod without constraints costs nothing on a cluster without cordons or NoSchedule/NoExecute
taints: the filters report themselves not applicable (``applies_to``) from counters the snapshot
keeps, and ``decide()`` skips them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import replace

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.constraints import NODE_NAME_FIELD, UNSCHEDULABLE_TAINT, NodeConstraints, Requirement
from gpupool_sched.model.node import NodeSignature
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.framework import CycleState, FilterPlugin

MASKS = "nodeaffinity.masks"  # snapshot.caches: constraint key -> bool per node
TABLES = "nodeaffinity.tables"  # snapshot.signature_caches: constraint key -> bool per signature id
MAX_CACHED = 512  # constraint values remembered (least recently used dropped)

NO_CONSTRAINTS = NodeConstraints()


class _Lru:
    def __init__(self, size: int = MAX_CACHED) -> None:
        self.size = size
        self.items: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def get(self, key: Hashable) -> np.ndarray | None:
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: np.ndarray) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


def _lru(store: dict[object, object], key: str) -> _Lru:
    lru = store.get(key)
    if not isinstance(lru, _Lru):
        lru = store[key] = _Lru()
    return lru


def signature_table(snapshot: ClusterSnapshot, key: Hashable, test: Callable[[NodeSignature], bool]) -> np.ndarray:
    """``test`` per signature id (False for ids no node has any more); new ids are evaluated lazily."""
    tables = _lru(snapshot.signature_caches, TABLES)
    table = tables.get(key)
    count = len(snapshot.signatures)
    if table is None or table.size < count:
        done = 0 if table is None else table.size
        grown = np.zeros(count, dtype=bool)
        if table is not None:
            grown[:done] = table
        for sid in range(done, count):
            sig = snapshot.signatures[sid]
            grown[sid] = sig is not None and test(sig)
        table = grown
        tables.put(key, table)
    return table


def node_mask(snapshot: ClusterSnapshot, key: Hashable, build: Callable[[], np.ndarray]) -> np.ndarray:
    """A per-node boolean mask (read-only), cached on the snapshot until its nodes change."""
    masks = _lru(snapshot.caches, MASKS)
    mask = masks.get(key)
    if mask is None:
        mask = build()
        mask.flags.writeable = False
        masks.put(key, mask)
    return mask


def _by_signature(snapshot: ClusterSnapshot, key: Hashable, test: Callable[[NodeSignature], bool]) -> np.ndarray:
    return signature_table(snapshot, key, test)[snapshot.node_signature]  # type: ignore[no-any-return]


def _name_mask(snapshot: ClusterSnapshot, req: Requirement) -> np.ndarray:
    """matchFields metadata.name In/NotIn, through the name index."""
    mask = np.zeros(len(snapshot), dtype=bool)
    rows = [snapshot.index[v] for v in req.values if v in snapshot.index]
    mask[rows] = True
    return mask if req.operator == "In" else ~mask


def affinity_mask(snapshot: ClusterSnapshot, constraints: NodeConstraints) -> np.ndarray:
    """Nodes matching the node selector AND one of the required affinity terms."""
    c = constraints
    key = ("affinity", c.node_selector, c.affinity_terms)  # tolerations do not matter here
    if not c.uses_node_name:
        return node_mask(
            snapshot, key, lambda: _by_signature(snapshot, key, lambda sig: c.matches("", sig.label_map()))
        )

    def build() -> np.ndarray:
        selector = c.node_selector
        ok = _by_signature(snapshot, ("selector", selector), lambda sig: c.selector_matches(sig.label_map()))
        any_term = np.zeros(len(snapshot), dtype=bool)
        for term in c.affinity_terms:
            if not term:
                continue  # an empty term matches no node
            labels = tuple(r for r in term if not r.on_node_name)

            def term_matches(sig: NodeSignature, reqs: tuple[Requirement, ...] = labels) -> bool:
                return all(r.matches("", sig.label_map()) for r in reqs)

            hit = _by_signature(snapshot, ("term", labels), term_matches)
            for req in term:
                if req.on_node_name:
                    hit = hit & _name_mask(snapshot, req)
            any_term |= hit
        return ok & any_term

    return node_mask(snapshot, key, build)


def taint_mask(snapshot: ClusterSnapshot, constraints: NodeConstraints) -> np.ndarray:
    """Nodes whose NoSchedule/NoExecute taints the pod tolerates (keyed by the tolerations alone)."""
    key = ("taints", constraints.tolerations)
    return node_mask(
        snapshot, key, lambda: _by_signature(snapshot, key, lambda sig: constraints.untolerated(sig.taints) is None)
    )


def tolerates_cordon(constraints: NodeConstraints) -> bool:
    return constraints.tolerates(UNSCHEDULABLE_TAINT)


def cordon_mask(snapshot: ClusterSnapshot) -> np.ndarray:
    return node_mask(
        snapshot, ("cordon",), lambda: _by_signature(snapshot, ("cordon",), lambda sig: not sig.unschedulable)
    )


def constraints_of(request: PodRequest) -> NodeConstraints:
    return request.constraints if request.constraints is not None else NO_CONSTRAINTS


class NodeUnschedulable(FilterPlugin):
    """Cordoned nodes, unless the pod tolerates node.kubernetes.io/unschedulable:NoSchedule."""

    name = "NodeUnschedulable"

    def applies_to(self, state: CycleState) -> bool:
        return state.snapshot.cordoned_nodes > 0 and not tolerates_cordon(constraints_of(state.request))

    def passes(self, state: CycleState) -> np.ndarray:
        if tolerates_cordon(constraints_of(state.request)):
            return np.ones(len(state.snapshot), dtype=bool)
        return cordon_mask(state.snapshot)

    def reason(self, request: PodRequest) -> str:
        return "node(s) were unschedulable"


class NodeAffinity(FilterPlugin):
    """The pod's nodeSelector and requiredDuringSchedulingIgnoredDuringExecution node affinity."""

    name = "NodeAffinity"

    def applies(self, request: PodRequest) -> bool:
        return request.constraints is not None and request.constraints.selects_nodes

    def passes(self, state: CycleState) -> np.ndarray:
        return affinity_mask(state.snapshot, constraints_of(state.request))

    def reason(self, request: PodRequest) -> str:
        return "node(s) didn't match Pod's node affinity/selector"


class TaintToleration(FilterPlugin):
    """NoSchedule and NoExecute taints the pod does not tolerate (PreferNoSchedule never rejects)."""

    name = "TaintToleration"

    def applies_to(self, state: CycleState) -> bool:
        return state.snapshot.tainted_nodes > 0

    def passes(self, state: CycleState) -> np.ndarray:
        return taint_mask(state.snapshot, constraints_of(state.request))

    def reason(self, request: PodRequest) -> str:
        return "node(s) had untolerated taint(s)"


def with_requirement(request: PodRequest, requirement: Requirement) -> PodRequest:
    """``request`` with ``requirement`` ANDed into every affinity term (its own selector, affinity and
    tolerations still apply); empty terms stay empty (they match nothing)."""
    c = constraints_of(request)
    terms = (tuple((*term, requirement) if term else term for term in c.affinity_terms) if c.affinity_terms
             else ((requirement,),))
    return replace(request, constraints=replace(c, affinity_terms=terms))


def pinned(request: PodRequest, node: str) -> PodRequest:
    """``request`` restricted to ``node`` (a node-name requirement, `with_requirement`)."""
    return with_requirement(request, Requirement(NODE_NAME_FIELD, "In", (node,)))
