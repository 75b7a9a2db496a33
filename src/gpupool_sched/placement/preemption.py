"""Priority preemption, the decision: which lower-priority pods to evict, on which node, and where the
preemptor goes once they are gone. Pure, like ``decide()``: the scheduler service, the simulator and the
tests call the same function and carry out its answer themselves (Eviction API, nominatedNodeName).

It follows kube-scheduler's DefaultPreemption (pkg/scheduler/framework/preemption, plugins/
defaultpreemption), with GPU awareness added:

* Only pods of strictly lower priority may be evicted. On each node, all of them are removed; if the pod
  still does not fit there, the node is no candidate. Otherwise they are added back one at a time, most
  important first (PDB-protected ones first, then higher priority, then *more GPU capacity held*, then
  earlier start), each kept if the pod still fits; those that cannot be kept are the node's victims.
* PodDisruptionBudgets are counted down per pod, as kube-scheduler's ``filterPodsWithPDBViolation``
  does: a budget that allows k disruptions lets k of the pods it selects go; each further one is a
  violation (the Eviction API would refuse it, halfway through the plan). "PDB-protected" above means
  the pods past their budgets' allowance when the node's candidates are counted, most important first;
  the violations a plan reports are counted the same way over its actual victims. ``spent``: what
  earlier victims of the same decision (a gang's other members) already took of each budget.
* "Fits" is the policy's own filter chain (plus the joint check of multi-shape pods), exactly what
  ``decide()`` asks, so a plan never evicts for a node the pod could not use anyway.
* The node is chosen by, in order: fewest PDB violations; lowest highest-victim priority; least GPU
  capacity evicted (milli-GPU, then whole GPUs); smallest priority sum; fewest victims; latest start of the
  highest-priority victims; the snapshot's tie order (node name by default).

Where the GPU criterion sits, and why: after the highest victim priority, so no pod of higher priority
is ever evicted to spare GPU capacity, and before kube-scheduler's priority sum. That sum adds 2^31 to
each priority (so negative priorities do not reward more victims), which makes it a victim count at equal
priorities: behind it, evicting one whole-GPU job would always beat evicting the two tenants of a shared
GPU, the opposite of what a pooled GPU cluster wants. The tenants of one GPU hold at most 1000 milli
between them, a whole-GPU job 1000 per GPU; on a tie (tenants that fill their GPU) fewer whole GPUs wins.
Inside a node the reprieve order does the same: pods holding more GPU are kept first.

Work is batched across nodes rather than node by node: one working copy of the snapshot, every candidate
node's lower-priority pods released at once, and each reprieve step is one vectorised filter pass over
all nodes (nodes are independent, so the result is the same as node by node). A cheap bound (CPU, memory,
pod slots, whole GPUs, node constraints) skips nodes where even removing every lower-priority pod cannot
be enough. The nodes past the bound are tried in chunks, as kube-scheduler samples its candidates
(``CandidateBudget``, placement/candidates.py): from an offset, only until enough viable nodes are found
(10 % of them, at least 100), and the reprieve runs on those only; with no more viable nodes than that,
the answer is exactly the full search's. Nearly all the time goes to the snapshot's assume/release, so
the cost grows with the candidates tried rather than the cluster (docs/preemption.md). With a
``PreemptionMemo`` (placement/preemption_memo.py), nodes unchanged since an earlier plan for the same
request shape are not worked on again: their bound, fit and victims are the memo's.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.candidates import CandidateBudget, start_offset
from gpupool_sched.placement.decide import decide, feasible_nodes
from gpupool_sched.placement.filters import GpuShapesFit
from gpupool_sched.placement.framework import CycleState, Policy
from gpupool_sched.placement.nodeaffinity import (
    affinity_mask,
    constraints_of,
    cordon_mask,
    pinned,
    taint_mask,
    tolerates_cordon,
)
from gpupool_sched.placement.preemption_memo import PreemptionMemo, remember, shape_key, still_valid

PRIORITY_SHIFT = 1 << 31  # kube-scheduler adds MaxInt32+1 to each victim's priority before summing
_NO_VICTIM = -(1 << 62)  # "highest victim priority" of a plan without victims: below every int32
_MIG_PROFILE = re.compile(r"(\d+)g\.(\d+)gb")  # 1g.10gb, 1c.3g.40gb -> compute slices, GB
_MIG_COMPUTE_SLICES = 7  # A100/H100/H200: a MIG GPU has 7 compute slices (fallback when memory is unknown)
_SHAPES_FIT = GpuShapesFit()
_MIN_CHUNK = 16  # nodes tried at once once few candidates are missing (each chunk costs one filter pass)


@dataclass(frozen=True, slots=True)
class RunningPod:
    """A pod holding resources on a node, as preemption sees it. ``request`` and ``placement`` must be
    exactly what is accounted on the snapshot (``release`` undoes them). ``budgets``: (name, disruptions
    it allows now) of every PodDisruptionBudget that selects the pod (its status.disruptionsAllowed);
    the same name must carry the same number on every pod. ``pdb_blocked``: evicting it violates a
    budget whatever the count (the caller decides; a budget in ``budgets`` allowing 0 does the same)."""

    uid: str
    node: str
    priority: int
    request: PodRequest
    placement: Placement
    start_time: float  # seconds since the epoch; later = younger
    pdb_blocked: bool = False
    budgets: tuple[tuple[str, int], ...] = ()


def count_down(pods: Iterable[RunningPod], spent: Mapping[str, int] | None = None) -> list[bool]:
    """Per pod, in the order given: does evicting it (after the ones before it) violate a budget? Each
    pod takes one disruption from every budget that selects it (kube-scheduler's
    filterPodsWithPDBViolation); ``spent``: disruptions already taken from each budget."""
    left: dict[str, int] = {}
    out = []
    for pod in pods:
        violates = pod.pdb_blocked
        for name, allowed in pod.budgets:
            if name not in left:
                left[name] = allowed - (spent or {}).get(name, 0)
            left[name] -= 1
            violates |= left[name] < 0
        out.append(violates)
    return out


def spend(victims: Iterable[RunningPod], spent: Mapping[str, int] | None = None) -> dict[str, int]:
    """``spent`` plus the disruptions ``victims`` take from their budgets."""
    out = dict(spent or {})
    for victim in victims:
        for name, _ in victim.budgets:
            out[name] = out.get(name, 0) + 1
    return out


@dataclass(frozen=True, slots=True)
class Preemption:
    """Evict ``victims`` (most important first) on ``node``; the preemptor then goes to ``placement``.
    No victims means the pod already fits there (the caller's view was older than the snapshot)."""

    node: str
    victims: tuple[RunningPod, ...]
    placement: Placement
    pdb_violations: int
    considered: int = field(default=0, compare=False)  # nodes whose lower-priority pods were released


@dataclass(frozen=True, slots=True)
class GpuCost:
    """GPU capacity a pod holds: milli-GPU (whole GPUs 1000 each, shares their milli, MIG slices their
    part of the GPU) and how many whole GPUs of it are whole-GPU allocations."""

    milli: int = 0
    whole: int = 0

    def __add__(self, other: GpuCost) -> GpuCost:
        return GpuCost(self.milli + other.milli, self.whole + other.whole)


def mig_slice_milli(profile: str, gpu: GpuSpec) -> int:
    """A MIG device's part of its GPU in milli: its memory over the GPU's (``1g.10gb`` on an 80 GB GPU:
    125); by compute slices of 7 when the GPU's memory is unknown; the whole GPU for unknown profiles."""
    found = _MIG_PROFILE.search(profile)
    if found is None:
        return MILLI
    compute, gb = int(found.group(1)), int(found.group(2))
    if gpu.memory_mib > 0:
        return max(1, min(MILLI, gb * 1024 * MILLI // gpu.memory_mib))
    return max(1, min(MILLI, compute * MILLI // _MIG_COMPUTE_SLICES))


def gpu_cost(placement: Placement, spec: NodeSpec) -> GpuCost:
    """What evicting the pod placed at ``placement`` on the node ``spec`` gives up in GPU capacity."""
    milli = whole = 0
    for part in placement.parts():
        n = len(part.gpu_indices)
        if part.gpu_milli == MILLI:
            milli += MILLI * n
            whole += n
        else:
            milli += part.gpu_milli * n
        if part.mig_devices:
            slices = {s.uuid: (s.profile, g) for g in spec.gpus for s in g.mig_slices}
            for uuid in part.mig_devices:
                if uuid in slices:
                    milli += mig_slice_milli(*slices[uuid])
    return GpuCost(milli, whole)


def fit_mask(snapshot: ClusterSnapshot, request: PodRequest, policy: Policy) -> np.ndarray:
    """Boolean per node: ``decide()`` would accept the node for ``request`` (filters, then the joint
    fit of every GPU shape for multi-shape pods)."""
    state = CycleState(snapshot, request, None)
    ok, _ = feasible_nodes(state, policy)
    if request.extra and ok.size:
        ok = ok[_SHAPES_FIT.passes(state, ok)]
    mask = np.zeros(len(snapshot), dtype=bool)
    mask[ok] = True
    return mask


@dataclass(slots=True)
class _NodePlan:
    row: int
    order: list[RunningPod]  # reprieve order, most important first
    costs: dict[str, GpuCost]
    victims: list[RunningPod] = field(default_factory=list)
    violations: int = 0
    ranked: tuple[float, ...] | None = None  # key() but the tie rank, kept (a memo's plan is ranked again)

    def key(self, tie_rank: int) -> tuple[float, ...]:
        """Smaller is better (the module docstring says why); only once the plan is final (it is kept)."""
        if self.ranked is None:
            victims = self.victims
            if not victims:
                self.ranked = (0, _NO_VICTIM, 0, 0, 0, 0, 0)
            else:
                top = max(v.priority for v in victims)
                gpu = sum((self.costs[v.uid] for v in victims), GpuCost())
                priority_sum = sum(v.priority + PRIORITY_SHIFT for v in victims)
                earliest_top = min(v.start_time for v in victims if v.priority == top)  # negated: latest first
                self.ranked = (self.violations, top, gpu.milli, gpu.whole, priority_sum, len(victims), -earliest_top)
        return (*self.ranked, tie_rank)


def _importance(pod: RunningPod, cost: GpuCost) -> tuple[int, int, int, float, str]:
    """Sort key, most important first: higher priority, more GPU held (whole GPUs first), earlier start."""
    return (-pod.priority, -cost.milli, -cost.whole, pod.start_time, pod.uid)


def _bound(work: ClusterSnapshot, request: PodRequest, by_row: Mapping[int, list[RunningPod]]) -> list[int]:
    """Rows where the pod might fit once every lower-priority pod there is gone: a necessary condition
    of the default filter chain (node constraints, pod slots, CPU, memory, whole GPUs), cheap enough to
    spare releasing pods on nodes that cannot serve."""
    ordered = sorted(by_row)
    rows = np.array(ordered, dtype=np.int64)
    cpu_sums, mem_sums = [], []
    for r in ordered:  # one pass per node (this runs over every lower-priority pod of every plan)
        cpu_sum = mem_sum = 0
        for p in by_row[r]:
            req = p.request
            cpu_sum += req.cpu_milli
            mem_sum += req.memory_mib
        cpu_sums.append(cpu_sum)
        mem_sums.append(mem_sum)
    cpu = np.array(cpu_sums, dtype=np.int64)
    mem = np.array(mem_sums, dtype=np.int64)
    count = np.array([len(by_row[r]) for r in ordered], dtype=np.int64)
    ok = (work.pods_free[rows] + count >= 1) & (work.cpu_free[rows] + cpu >= request.cpu_milli)
    ok &= work.mem_free[rows] + mem >= request.memory_mib
    c = constraints_of(request)
    if c.selects_nodes:
        ok &= affinity_mask(work, c)[rows]
    if work.tainted_nodes:
        ok &= taint_mask(work, c)[rows]
    if work.cordoned_nodes and not tolerates_cordon(c):
        ok &= cordon_mask(work)[rows]
    if request.is_whole:  # only for the rows still in: the rest are out whatever their GPUs
        rows = rows[ok]
        slots = work.gpu_slots
        sums = [0] * (len(rows) * slots)  # row-major [rows, slots], filled in Python (no numpy scalars)
        for k, r in enumerate(rows.tolist()):
            base = k * slots
            for pod in by_row[r]:
                for part in pod.placement.parts():
                    for j in part.gpu_indices:
                        sums[base + j] += part.gpu_milli
        freed = np.array(sums, dtype=np.int64).reshape(len(rows), slots)
        free_after = (work.free_milli[rows] + freed == MILLI) & work.gpu_usable[rows]
        free_after &= work.allowed_models(request.gpu_models)[rows]
        ok = free_after.sum(axis=1) >= request.gpu_count
    return [int(r) for r in rows[ok]]


def plan_preemption(
    snapshot: ClusterSnapshot,
    request: PodRequest,
    priority: int,
    running: Sequence[RunningPod],
    policy: Policy,
    rng: np.random.Generator | None = None,
    spent: Mapping[str, int] | None = None,
    budget: CandidateBudget | None = None,
    memo: PreemptionMemo | None = None,
) -> Preemption | None:
    """Where ``request`` (of ``priority``, usually ``request.priority``) can run by evicting pods of
    strictly lower priority from ``running`` (the pods accounted on ``snapshot``), or None when no node
    would have room even with all of them gone. ``snapshot`` is not modified (the work happens on copies).

    Call it for a pod that fits nowhere and whose PriorityClass allows preemption (``preemptionPolicy:
    Never`` pods must not be passed). Nodes without lower-priority pods are not considered. Should the
    pod fit on a node as things are, that node wins with no victims. Multi-shape pods (``of_shapes``)
    are handled like single-shape ones: "fits" includes the joint fit of all their shapes, and victims
    holding several shapes free all of them. Running pods on nodes the snapshot lacks hold nothing on it
    and are ignored; a UID given twice is a ValueError. ``spent``: disruptions of each budget already
    taken by victims chosen earlier for the same decision (see the module docstring). ``budget``: how
    many viable nodes end the search (default: kube-scheduler's, 10 % of the nodes past the bound, at
    least 100); the search starts at ``start_offset`` (the pod's name, and a copy of ``rng``: the
    caller's stream is not advanced). The result's ``considered`` says how many nodes were tried.
    ``memo``: what earlier plans found per node (placement/preemption_memo.py): the same answer.
    """
    if len({pod.uid for pod in running}) != len(running):  # the first one given twice
        twice = next(p.uid for k, p in enumerate(running) if any(q.uid == p.uid for q in running[:k]))
        raise ValueError(f"running pod {twice} is given twice")
    by_row: dict[int, list[RunningPod]] = defaultdict(list)
    index = snapshot.index
    for pod in running:
        if pod.priority < priority:
            row = index.get(pod.node)
            if row is not None:
                by_row[row].append(pod)
    if not by_row:
        return None

    # what earlier plans found on the nodes that did not change since (the same answer, without the work)
    found = memo.nodes(policy, shape_key(request, priority, spent)) if memo is not None else None
    known = still_valid(found, snapshot, by_row)
    unknown = {row: pods for row, pods in by_row.items() if row not in known}
    work = snapshot.copy() if unknown else None  # the working copy, once a node is worked on
    bounded = set(_bound(work, request, unknown)) if work is not None else set()
    rows = sorted(row for row in by_row if (known[row].bounded if row in known else row in bounded))
    budget = budget or CandidateBudget()
    want = budget.count(len(rows))
    if want < len(rows):  # sampling: a rotated order, as kube-scheduler's GetOffsetAndNumCandidates
        start = start_offset(request.name, len(rows), rng)
        rows = rows[start:] + rows[:start]
    deadline = None if budget.seconds is None else time.perf_counter() + budget.seconds
    # Release each chunk's lower-priority pods; its viable nodes (the pod fits with all of them gone)
    # are candidates. The others stay released: nodes are independent and only candidates are read.
    plans: dict[int, _NodePlan] = {}
    fresh: list[_NodePlan] = []  # plans the memo did not have: reprieved below
    viable: dict[int, bool] = {}  # nodes tried here: the pod fits with their lower-priority pods gone
    tried = 0
    while tried < len(rows) and len(plans) < want:
        if deadline is not None and plans and time.perf_counter() >= deadline:
            break
        chunk = rows[tried:tried + max(want - len(plans), _MIN_CHUNK)]
        tried += len(chunk)
        released: dict[int, _NodePlan] = {}
        fits = None
        if todo := [row for row in chunk if row not in known or known[row].viable is None]:
            work = snapshot.copy() if work is None else work
            released = {row: _release_node(work, row, by_row[row], spent) for row in todo}
            fits = fit_mask(work, request, policy)
        for row in chunk:
            plan = released.get(row)
            if plan is None:  # the memo's
                if known[row].viable:
                    plans[row] = known[row].plan
                continue
            assert fits is not None
            viable[row] = bool(fits[row])
            if fits[row]:
                plans[row] = plan
                fresh.append(plan)
    if not plans:
        remember(found, snapshot, unknown, bounded, viable, plans)
        return None

    # Reprieve, one step for every node at once: add back each node's next pod; where the pod no longer
    # fits, take it out again: it is a victim.
    for step in range(max((len(plan.order) for plan in fresh), default=0)):
        assert work is not None  # a fresh plan released its node on it
        trying = [(plan, plan.order[step]) for plan in fresh if step < len(plan.order)]
        for _, pod in trying:
            work.assume(pod.request, pod.placement)
        fits = fit_mask(work, request, policy)
        for plan, pod in trying:
            if not fits[plan.row]:
                work.release(pod.request, pod.placement)
                plan.victims.append(pod)
    for plan in fresh:
        victims = sorted(plan.victims, key=lambda p: _importance(p, plan.costs[p.uid]))
        plan.violations = sum(count_down(victims, spent))
    remember(found, snapshot, unknown, bounded, viable, plans)

    best = min(plans.values(), key=lambda plan: plan.key(int(snapshot.tie_rank[plan.row])))
    node = snapshot.node_names[best.row]
    after = snapshot.copy()
    for pod in best.victims:
        after.release(pod.request, pod.placement)
    decision = decide(after, pinned(request, node), policy, rng)
    if not isinstance(decision, Placement):  # fit_mask said it fits: decide() asks the same question
        raise AssertionError(f"pod {request.name}: no placement on {node} after evicting its victims")
    victims = sorted(best.victims, key=lambda p: _importance(p, best.costs[p.uid]))
    return Preemption(node, tuple(victims), decision, best.violations, tried)


def _release_node(work: ClusterSnapshot, row: int, pods: list[RunningPod],
                  spent: Mapping[str, int] | None) -> _NodePlan:
    """Release every pod of ``pods`` (the node's lower-priority pods) on ``work``; the node's plan with
    its reprieve order, PDB-protected pods first (see the module docstring)."""
    spec = work.nodes[row]
    costs = {p.uid: gpu_cost(p.placement, spec) for p in pods}
    ranked = sorted(pods, key=lambda p: _importance(p, costs[p.uid]))
    protected = {p.uid for p, v in zip(ranked, count_down(ranked, spent), strict=True) if v}
    order = sorted(ranked, key=lambda p: (p.uid not in protected, *_importance(p, costs[p.uid])))
    for pod in order:
        work.release(pod.request, pod.placement)
    return _NodePlan(row, order, costs)
