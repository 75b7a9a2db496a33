"""How many nodes a preemption search tries: kube-scheduler DefaultPreemption's candidate sampling.

kube-scheduler does not dry-run preemption on every node that might serve. It computes a number of
candidates from the potential nodes (``minCandidateNodesPercentage`` of them, at least
``minCandidateNodesAbsolute``, at most all of them: defaults 10 % and 100), starts at a random offset
among them, and stops once it has found that many nodes where the pod fits with its lower-priority pods
gone; the best victims are then chosen among those only. ``plan_preemption`` does the same with a
:class:`CandidateBudget`: its potential nodes are those that pass its cheap bound, tried in chunks from
:func:`start_offset`. When no more nodes are viable than the count, every potential node is tried and
the answer is exactly the full search's (see docs/preemption.md, "Candidate sampling").
"""

from __future__ import annotations

import copy
import sys
import zlib
from dataclasses import dataclass

import numpy as np

MIN_CANDIDATE_NODES_PERCENTAGE = 10  # kube-scheduler's DefaultPreemptionArgs defaults
MIN_CANDIDATE_NODES_ABSOLUTE = 100


@dataclass(frozen=True, slots=True)
class CandidateBudget:
    """``min_percentage`` (0..100) of the potential nodes, at least ``min_absolute``, at most all of them:
    how many viable candidates end the search. ``seconds``: also end it once this much time is spent and
    at least one viable node is found (checked between chunks; None: no time limit, the result then
    depends only on the inputs)."""

    min_percentage: int = MIN_CANDIDATE_NODES_PERCENTAGE
    min_absolute: int = MIN_CANDIDATE_NODES_ABSOLUTE
    seconds: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_percentage <= 100:
            raise ValueError(f"minimum candidate nodes percentage must be 0..100, got {self.min_percentage}")
        if self.min_absolute < 0:
            raise ValueError(f"minimum candidate nodes must be >= 0, got {self.min_absolute}")
        if self.min_percentage == 0 and self.min_absolute == 0:
            raise ValueError("minimum candidate nodes percentage and absolute cannot both be 0")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"preemption search budget must be > 0 seconds, got {self.seconds}")

    def count(self, potential: int) -> int:
        """How many viable candidates end a search among ``potential`` nodes (calculateNumCandidates)."""
        n = max(potential * self.min_percentage // 100, self.min_absolute, 1)
        return min(n, potential)


# every potential node: the search as it was before sampling (tests and benchmarks compare against it)
FULL_SEARCH = CandidateBudget(min_absolute=sys.maxsize)


def start_offset(name: str, potential: int, rng: np.random.Generator | None) -> int:
    """Where in the potential nodes a sampled search starts: a stable hash of the pod's name (CRC-32,
    not Python's salted ``hash``), plus a draw from a *copy* of ``rng`` when one is given, so that the
    caller's stream is not advanced and the preemptor's placement is drawn as without sampling."""
    if potential <= 0:
        return 0
    offset = zlib.crc32(name.encode())
    if rng is not None:
        offset += int(copy.deepcopy(rng).integers(1 << 62))
    return offset % potential
