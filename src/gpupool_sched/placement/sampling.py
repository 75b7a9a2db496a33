"""Score a sample of the feasible nodes, as kube-scheduler's ``percentageOfNodesToScore`` does.

Filters are vectorised and cheap; scoring (FGD's per-GPU fragmentation deltas, topology) costs
about a microsecond per feasible node and is what grows with the cluster. kube-scheduler bounds it
by stopping its filter scan once it has found ``numFeasibleNodesToFind`` feasible nodes.
:class:`NodeSampler` does the same on the ascending feasible indices that ``decide()`` hands its
``sample`` hook:

* **how many**: ``nodes_to_score(num_nodes, percentage)``, kube-scheduler's numFeasibleNodesToFind,
  computed from the number of *all* nodes: every node when there are fewer than 100; else
  ``percentage`` of them (0 = adaptive: ``50 - nodes/125`` percent, at least 5), never fewer than 100.
* **which**: the first ``k`` feasible nodes met when scanning the nodes in scan order (the tie-break
  order for :meth:`NodeSampler.for_snapshot`) circularly from a start position; returned ascending.
* **where the scan starts**: with ``rotate=True`` exactly where kube-scheduler's would
  (nextStartNodeIndex): at the feasible node its previous scan stopped at, the first one beyond the
  ``k`` it kept, so successive decisions look at successive parts of the cluster; a scan that went
  round the whole ring (``k`` or fewer feasible) leaves the start where it was. With ``rotate=False``
  (the default) every scan starts at the beginning of the order.

Why the default does not rotate: a bin-packing policy breaks its many ties by the tie-break order,
so that pods fill the cluster node after node. A rotating window spreads them over the cluster
instead: on the openb default trace (seeds 42-46, adaptive percentage = 497 of 1,213 nodes) FGD
loses 1.5 points of allocated GPU with the rotating start and 0.04 with the fixed one; gpupool,
whose stranding and scarcity terms break most ties, moves by +0.03 / +0.02 either way.
Figures: ``python -m benchmarks.bench_sampling``.

The state is one integer, so a sampler is deterministic and replays reproduce: the same sequence
of feasible sets gives the same samples. It reads no clock and costs O(log n + k) per decision
(O(n) with a scan order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gpupool_sched.model.cluster import ClusterSnapshot

MIN_FEASIBLE_NODES = 100  # kube-scheduler's minFeasibleNodesToFind
MIN_PERCENTAGE = 5  # minFeasibleNodesPercentageToFind
BASE_PERCENTAGE = 50  # adaptive percentage: BASE_PERCENTAGE - nodes / ADAPTIVE_NODES_PER_POINT
ADAPTIVE_NODES_PER_POINT = 125


def nodes_to_score(num_nodes: int, percentage: int = 0) -> int:
    """How many feasible nodes a decision scores in a cluster of ``num_nodes`` (numFeasibleNodesToFind).

    ``percentage`` is 1..100, or 0 for kube-scheduler's adaptive default. Integer arithmetic as in Go."""
    if not 0 <= percentage <= 100:
        raise ValueError(f"percentage of nodes to score must be 0 (adaptive) .. 100, got {percentage}")
    if num_nodes < 0:
        raise ValueError(f"number of nodes must be >= 0, got {num_nodes}")
    if num_nodes < MIN_FEASIBLE_NODES:
        return num_nodes
    if percentage == 0:
        percentage = max(BASE_PERCENTAGE - num_nodes // ADAPTIVE_NODES_PER_POINT, MIN_PERCENTAGE)
    return max(num_nodes * percentage // 100, MIN_FEASIBLE_NODES)


class NodeSampler:
    """``decide(..., sample=sampler)``: keeps the first :meth:`count` feasible nodes of a scan.

    The scan visits node indices in ``order`` (default: ascending index; :meth:`for_snapshot` scans
    in the snapshot's tie-break order), from the beginning of the order, or with ``rotate`` circularly
    from where the previous scan stopped, as kube-scheduler does.

    One sampler belongs to one stream of decisions (a scheduler loop, a replay) on one cluster; call
    :meth:`resize` when nodes join or leave so that the count, the order and the start follow."""

    __slots__ = ("_count", "_order", "_synced", "next_start", "num_nodes", "percentage", "rotate")

    def __init__(
        self,
        num_nodes: int,
        percentage: int = 0,
        *,
        rotate: bool = False,
        order: np.ndarray | None = None,
        start: int = 0,
    ) -> None:
        self.percentage = percentage
        self.rotate = rotate
        self.num_nodes = 0
        self._count = 0
        self._order: np.ndarray | None = None
        self._synced: tuple[int, object] | None = None
        self.next_start = start
        self.resize(num_nodes, order)

    @classmethod
    def for_snapshot(cls, snapshot: ClusterSnapshot, percentage: int = 0, *, rotate: bool = False) -> NodeSampler:
        """A sampler that scans ``snapshot``'s nodes in its tie-break order (see decide())."""
        return cls(0, percentage, rotate=rotate).follow(snapshot)

    def follow(self, snapshot: ClusterSnapshot) -> NodeSampler:
        """Keep up with nodes joining or leaving ``snapshot``: call it before each decision
        (``sample=sampler.follow(snap)``). Re-reads the node count and tie-break order only when
        the snapshot's size or node-set ``generation`` changed; after ``set_tie_order`` call
        :meth:`resize` yourself."""
        key = (len(snapshot), getattr(snapshot, "generation", None))  # generation: snapshots with live nodes
        if key != self._synced:
            self.resize(len(snapshot), np.argsort(snapshot.tie_rank, kind="stable"))
            self._synced = key
        return self

    def resize(self, num_nodes: int, order: np.ndarray | None = None) -> NodeSampler:
        """Follow a cluster that now has ``num_nodes`` nodes (scanned in ``order``, default index
        order); the start position wraps into range."""
        self._count = nodes_to_score(num_nodes, self.percentage)
        self.num_nodes = num_nodes
        if order is None:
            self._order = None
        else:
            order = np.asarray(order, dtype=np.int64)
            if order.shape != (num_nodes,) or not np.array_equal(np.sort(order), np.arange(num_nodes)):
                raise ValueError(f"scan order must be a permutation of 0..{num_nodes - 1}")
            self._order = order
        self.next_start = self.next_start % num_nodes if num_nodes else 0
        return self

    @property
    def count(self) -> int:
        """Feasible nodes scored per decision (all of them when fewer are feasible)."""
        return self._count

    def __call__(self, feasible: np.ndarray) -> np.ndarray:
        """The sample of ``feasible`` (ascending node indices) to score, ascending; advances the start."""
        total = feasible.size
        if total <= self._count:
            return feasible  # the scan went round the whole ring: the start stays
        if int(feasible[-1]) >= self.num_nodes:
            raise ValueError(f"node index {int(feasible[-1])} in a sampler sized for {self.num_nodes} nodes")
        if self._order is None:
            ring = feasible  # scan positions are node indices
        else:
            mask = np.zeros(self.num_nodes, dtype=bool)
            mask[feasible] = True
            ring = np.flatnonzero(mask[self._order])  # scan positions of the feasible nodes, ascending
        pos = int(np.searchsorted(ring, self.next_start if self.rotate else 0))
        end = pos + self._count
        kept = ring[pos:end] if end <= total else np.concatenate((ring[: end - total], ring[pos:]))
        if self.rotate:  # the scan stopped at the next feasible node, which the next scan starts from
            self.next_start = int(ring[end % total])
        if self._order is None:
            return kept
        return np.sort(self._order[kept])
