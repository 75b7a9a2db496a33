"""What ``plan_preemption`` found on each node, kept from one plan to the next (``PreemptionMemo``).

A plan's work on a node (its cheap bound, whether the pod fits there with the node's lower-priority pods
gone, and the reprieve that picks the node's victims) depends on nothing but that node's row of the
snapshot, the pods released there, the pod's request (not its name) and priority, the disruptions
already spent, and the policy's filters: nodes are independent (placement/preemption.py). A saturated
cluster plans a preemption for most arrivals of the same few request shapes while only a few nodes
changed in between, so the memo answers for the unchanged nodes and the plan works on the others only.

Validity: a node's entry is used only while the row has the version it was computed at (a row version
is never reused, by any snapshot of the process, and copies keep the versions of what they copied:
``ClusterSnapshot.version``) and the node's candidates are the same objects in the same order; the
memo is emptied when the policy object changes. Entries are per request shape; the least recently used
shapes go beyond ``max_shapes``. Pure data, no clock: the answer is exactly the one without the memo.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import is_
from typing import Any

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import PodRequest

DEFAULT_MAX_SHAPES = 256


@dataclass(slots=True)
class NodeResult:
    """One node's part of a plan for one request shape, at row `version` with `pods` released."""

    version: int
    pods: tuple[Any, ...]  # the node's lower-priority RunningPods, as given
    bounded: bool  # passes the cheap bound (the pod might fit with all of them gone)
    viable: bool | None = None  # fits with all of them gone; None: not tried yet
    plan: Any = None  # viable: the node's reprieved plan (victims, violations); read-only once stored


class PreemptionMemo:
    """Per request shape and node, what the last plan found (`NodeResult`); see the module docstring."""

    def __init__(self, max_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        self.max_shapes = max_shapes
        self._policy: object | None = None
        self._shapes: OrderedDict[Hashable, dict[int, NodeResult]] = OrderedDict()

    def nodes(self, policy: object, shape: Hashable) -> dict[int, NodeResult]:
        """The entries (row -> result) of `shape` under `policy`, for the caller to read and update."""
        if policy is not self._policy:
            self._shapes.clear()
            self._policy = policy
        found = self._shapes.get(shape)
        if found is None:
            found = self._shapes[shape] = {}
            if len(self._shapes) > self.max_shapes:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(shape)
        return found

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._shapes.values())


def shape_key(request: PodRequest, priority: int, spent: Mapping[str, int] | None) -> Hashable:
    """What a node's result depends on besides the node: the request but its name, the priority, the
    disruptions already spent."""
    return replace(request, name=""), priority, tuple(sorted(spent.items())) if spent else ()


def still_valid(found: dict[int, NodeResult] | None, snapshot: ClusterSnapshot,
                by_row: Mapping[int, Sequence[Any]]) -> dict[int, NodeResult]:
    """The entries of `found` that hold for the nodes as they are now: the row's version, and the same
    candidate objects in the same order (identity, compared in C: this runs over every node with
    candidates, each plan)."""
    known: dict[int, NodeResult] = {}
    if found:
        versions = snapshot.version.tolist()  # Python ints: one conversion, not one per row
        get = found.get
        for row, pods in by_row.items():
            hit = get(row)
            if hit is not None and hit.version == versions[row] and len(hit.pods) == len(pods) and all(
                    map(is_, hit.pods, pods)):
                known[row] = hit
    return known


def remember(found: dict[int, NodeResult] | None, snapshot: ClusterSnapshot, unknown: Mapping[int, Sequence[Any]],
             bounded: set[int], viable: Mapping[int, bool], plans: Mapping[int, Any]) -> None:
    """Keep what a plan found per node in `found` (nothing without a memo), once the plan is complete so
    that no half-reprieved node is ever kept: new entries for the nodes it had none valid for
    (`unknown`: their candidates), and whether the pod fits (with the node's plan) for those it tried
    (`viable`: each a node of `unknown` or one whose entry in `found` is valid). The nodes whose entries
    were valid and not tried are not visited: the bookkeeping is for the nodes that changed."""
    if found is None:
        return
    versions = snapshot.version
    for row, pods in unknown.items():
        found[row] = NodeResult(int(versions[row]), tuple(pods), row in bounded)
    for row, fits in viable.items():
        entry = found[row]
        entry.viable, entry.plan = fits, plans.get(row)
