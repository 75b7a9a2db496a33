"""Team quotas with borrowing, the decision: may a team's pod start, and whose pods give GPUs back.

Pure, like ``decide()`` and ``plan_preemption()``: quotas, usage and demand in, a verdict out. The
scheduler service resolves GpuQuota objects (their namespace selectors) and its ledger into these
types; the simulator can do the same from a trace. docs/quotas.md tells the policy.

The model is Kueue's cohort, with every quota in one cohort. Two resources are counted, each on its
own: whole GPUs (``nvidia.com/gpu``) and GPU-memory units (``nvidia.com/gpu-memory``). GPU shares
given in milli-GPU and MIG slices are not counted.

* A team may always use up to its ``guaranteed`` amount.
* Beyond it, the team *borrows*: allowed while what it borrows stays within its ``borrowing_limit``
  and the cohort has the room, i.e. the other teams' idle guaranteed amount, net of what others
  already borrow: ``sum(used) + demand <= sum(guaranteed)`` over all quotas.
* A team within its guaranteed amount that finds no room may take borrowed GPUs back
  (:func:`reclaim_candidates`): pods of teams using more than their guaranteed amount.
* Namespaces no quota selects are not limited (and their pods are never reclaimed).
* A namespace selected by several quotas belongs to the first of them by name (:func:`owner`);
  :func:`overlaps` says which namespaces the others lose, for their status.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.preemption import RunningPod

DEFAULT_MEMORY_UNIT_MIB = 1024


@dataclass(frozen=True, slots=True)
class Amount:
    """Whole GPUs and GPU-memory units (each dimension counted on its own)."""

    gpus: int = 0
    memory_units: int = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.gpus + other.gpus, self.memory_units + other.memory_units)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.gpus - other.gpus, self.memory_units - other.memory_units)

    def positive(self) -> Amount:
        """Each dimension clamped at 0 from below."""
        return Amount(max(0, self.gpus), max(0, self.memory_units))

    def within(self, other: Amount) -> bool:
        """Every dimension at most ``other``'s."""
        return self.gpus <= other.gpus and self.memory_units <= other.memory_units

    def overlaps(self, other: Amount) -> bool:
        """Some dimension is positive in both."""
        return (self.gpus > 0 and other.gpus > 0) or (self.memory_units > 0 and other.memory_units > 0)

    @property
    def is_zero(self) -> bool:
        return self.gpus == 0 and self.memory_units == 0

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        if self.memory_units:
            parts.append(f"{self.memory_units} memory unit{'s' if self.memory_units != 1 else ''}")
        return " and ".join(parts) or "nothing"


def total(amounts: Iterable[Amount]) -> Amount:
    out = Amount()
    for amount in amounts:
        out += amount
    return out


@dataclass(frozen=True, slots=True)
class Quota:
    """A valid GpuQuota with its selector resolved to the namespaces it selects now."""

    name: str
    namespaces: frozenset[str]
    guaranteed: Amount
    borrowing_limit: Amount = Amount()

    def __post_init__(self) -> None:
        for label, amount in (("guaranteed", self.guaranteed), ("borrowing limit", self.borrowing_limit)):
            if amount.gpus < 0 or amount.memory_units < 0:
                raise ValueError(f"quota {self.name}: negative {label} {amount}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """``admit``'s answer. ``quota``: the quota that governs the namespace (None: not limited).
    ``borrowed``: how much of the team's usage would be borrowed with the demand admitted.
    ``over``: by how much the demand exceeds what may be given (zero when ``ok``)."""

    ok: bool
    quota: str | None = None
    message: str = ""
    borrowed: Amount = Amount()
    over: Amount = Amount()


# ---- what pods hold and ask for ---------------------------------------------------------------

def held_by(placement: Placement, memory_unit_mib: int = DEFAULT_MEMORY_UNIT_MIB) -> Amount:
    """What a placed pod counts against its quota: whole GPUs (parts at 1000 milli) and memory units
    (parts holding a memory share, ``gpu_memory_mib // memory_unit_mib`` per GPU)."""
    gpus = units = 0
    for part in placement.parts():
        if not part.gpu_indices:
            continue
        if part.gpu_milli >= MILLI:
            gpus += len(part.gpu_indices)
        elif part.gpu_memory_mib:
            units += len(part.gpu_indices) * (part.gpu_memory_mib // memory_unit_mib)
    return Amount(gpus, units)


def demand_of(request: PodRequest, memory_unit_mib: int = DEFAULT_MEMORY_UNIT_MIB) -> Amount:
    """What a pod asks for, counted as :func:`held_by` counts it once placed."""
    gpus = units = 0
    for shape in request.gpu_shapes():
        if shape.is_whole:
            gpus += shape.gpu_count
        elif shape.gpu_memory_mib:
            units += shape.gpu_count * (shape.gpu_memory_mib // memory_unit_mib)
    return Amount(gpus, units)


# ---- which quota governs a namespace ------------------------------------------------------------

def owner(quotas: Iterable[Quota], namespace: str) -> Quota | None:
    """The quota that governs ``namespace``: of those selecting it, the first by name."""
    found = [q for q in quotas if namespace in q.namespaces]
    return min(found, key=lambda q: q.name) if found else None


def owners(quotas: Iterable[Quota]) -> dict[str, str]:
    """namespace -> the name of the quota that governs it (see :func:`owner`)."""
    out: dict[str, str] = {}
    for quota in sorted(quotas, key=lambda q: q.name):
        for namespace in quota.namespaces:
            out.setdefault(namespace, quota.name)
    return out


def overlaps(quotas: Iterable[Quota]) -> dict[str, dict[str, str]]:
    """For each quota that selects namespaces governed by another: {namespace: governing quota}."""
    quotas = list(quotas)
    governing = owners(quotas)
    out: dict[str, dict[str, str]] = {}
    for quota in quotas:
        lost = {ns: governing[ns] for ns in sorted(quota.namespaces) if governing[ns] != quota.name}
        if lost:
            out[quota.name] = lost
    return out


def usage(quotas: Iterable[Quota], pods: Iterable[tuple[str, Amount]]) -> dict[str, Amount]:
    """What each quota's namespaces hold, from (namespace, amount) of every running or assumed pod.
    Every quota gets an entry; pods of namespaces no quota governs are left out."""
    quotas = list(quotas)
    governing = owners(quotas)
    out: dict[str, Amount] = {q.name: Amount() for q in quotas}
    for namespace, amount in pods:
        name = governing.get(namespace)
        if name is not None:
            out[name] += amount
    return out


def borrowed(quota: Quota, used: Amount) -> Amount:
    """What ``quota``'s team uses beyond its guaranteed amount."""
    return (used - quota.guaranteed).positive()


# ---- the decisions --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Cohort:
    """What :func:`admit` otherwise derives from all the quotas on every call (O(quotas)), given by a
    caller that keeps it up to date as usage changes (the scheduler's QuotaBook): the quota governing each
    namespace (:func:`owners`), and the sums over every quota of ``guaranteed`` and of ``used``."""

    owners: Mapping[str, Quota]
    guaranteed: Amount
    used: Amount


def admit(quotas: Sequence[Quota], used: Mapping[str, Amount], demand: Amount, namespace: str, *,
          cohort: Cohort | None = None) -> Verdict:
    """May a pod (or a gang, summed) of ``namespace`` asking for ``demand`` start, given what every
    quota's team uses now (``used``, e.g. from :func:`usage`; missing quotas use nothing)? With ``cohort``
    (consistent with ``quotas`` and ``used``) the answer is the same, in O(1).

    Each dimension on its own: within the team's guaranteed amount it may; beyond it only while the
    borrowed part stays within the borrowing limit and the cohort has room (the others' idle
    guaranteed amount, less what others already borrow). The message of a refusal names the quota
    and says by how much the demand is over."""
    quota = cohort.owners.get(namespace) if cohort is not None else owner(quotas, namespace)
    if quota is None:
        return Verdict(True)
    mine = used.get(quota.name, Amount())
    after = mine + demand
    would_borrow = borrowed(quota, after)
    if demand.is_zero or after.within(quota.guaranteed):
        return Verdict(True, quota.name, borrowed=would_borrow)
    # room to lend in the cohort: the others' guaranteed amount less everything they use
    if cohort is not None:
        lendable = (cohort.guaranteed - quota.guaranteed) - (cohort.used - mine)
    else:
        others = [q for q in quotas if q.name != quota.name]
        lendable = total(q.guaranteed for q in others) - total(used.get(q.name, Amount()) for q in others)
    lendable = lendable.positive()
    lendable_to_me = Amount(min(lendable.gpus, quota.borrowing_limit.gpus),
                            min(lendable.memory_units, quota.borrowing_limit.memory_units))
    # by how much the demand is over (the team may be over already, e.g. after its quota shrank)
    over = (would_borrow - lendable_to_me).positive()
    over = Amount(min(over.gpus, demand.gpus), min(over.memory_units, demand.memory_units))
    if over.is_zero:
        return Verdict(True, quota.name, borrowed=would_borrow)
    already = borrowed(quota, mine)
    reasons = []
    for dim, unit in (("gpus", "GPU"), ("memory_units", "memory unit")):
        excess = getattr(over, dim)
        if not excess:
            continue
        need, have, now = getattr(demand, dim), getattr(mine, dim), getattr(already, dim)
        guaranteed, limit = getattr(quota.guaranteed, dim), getattr(quota.borrowing_limit, dim)
        idle = max(0, getattr(lendable, dim) - now)
        more = max(0, min(getattr(lendable, dim), limit) - now)
        reasons.append(
            f"needs {need} {unit}{'s' if need != 1 else ''}, uses {have} of {guaranteed} guaranteed and may "
            f"borrow {more} more (borrowing limit {limit}, {idle} idle in the other quotas): {excess} over")
    return Verdict(False, quota.name, f"GpuQuota {quota.name}: " + "; ".join(reasons),
                   borrowed=would_borrow, over=over)


def reclaim_candidates(
    quotas: Sequence[Quota],
    used: Mapping[str, Amount],
    pods: Sequence[RunningPod],
    demand: Amount,
    namespace: str,
    *,
    memory_unit_mib: int = DEFAULT_MEMORY_UNIT_MIB,
) -> list[RunningPod]:
    """Running pods that may be preempted so that ``namespace``'s team gets ``demand`` back, lowest
    priority first, then the newest; empty when the team may not reclaim.

    Only a team that stays within its guaranteed amount with ``demand`` may reclaim (a borrower
    waits), and only from teams that borrow in a dimension the demand needs. Of each such team, its
    pods are taken in that order while the team still uses more than its guaranteed amount in a
    dimension the pod holds and the demand needs: the pods that are "borrowed" (the last one may
    take the team below its guarantee, as Kueue's reclaim does). Pods of the reclaiming team, of
    namespaces no quota governs, and pods holding nothing the demand needs are never candidates.

    Every such pod is returned, not just enough of them: which of them to evict, and on which node,
    is plan_preemption's choice (pass it these with a priority above all of them; it evicts only
    what the pod needs on one node, and nothing when even all of them would not make room).
    ``pods``: the running pods (RunningPod.request.namespace is each pod's namespace)."""
    quota = owner(quotas, namespace)
    if quota is None or demand.is_zero:
        return []
    if not (used.get(quota.name, Amount()) + demand).within(quota.guaranteed):
        return []
    governing = owners(quotas)
    by_name = {q.name: q for q in quotas}
    teams: dict[str, list[RunningPod]] = defaultdict(list)
    for pod in pods:
        team = governing.get(pod.request.namespace)
        if team is not None and team != quota.name:
            teams[team].append(pod)
    out: list[RunningPod] = []
    for team, members in sorted(teams.items()):
        excess = borrowed(by_name[team], used.get(team, Amount()))
        for pod in sorted(members, key=_victim_order):
            held = held_by(pod.placement, memory_unit_mib)
            relevant = Amount(held.gpus if demand.gpus else 0, held.memory_units if demand.memory_units else 0)
            if not excess.overlaps(relevant):
                continue
            out.append(pod)
            excess = (excess - held).positive()
    return sorted(out, key=_victim_order)


def _victim_order(pod: RunningPod) -> tuple[int, float, str]:
    """Lowest priority first, then the latest start, then UID (for a stable order)."""
    return (pod.priority, -pod.start_time, pod.uid)
