"""Topology score of a GPU set and the best set for a multi-GPU request. Pure: no I/O.

Pair score follows NVIDIA's "best effort" allocator: each NVLink is worth 100, and the PCIe path
adds 60 (same board) / 50 (one switch) / 40 (several switches) / 30 (host bridge) / 20 (same NUMA
node) / 10 (across sockets). A set scores the sum of its pairs. Used by the device plugin's
GetPreferredAllocation and by the scheduler's placement policies, so both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations
from math import comb

from gpupool_common.topology import NodeTopology, PcieLevel

NVLINK_SCORE = 100
PCIE_SCORE: dict[PcieLevel, int] = {
    PcieLevel.INTERNAL: 60,
    PcieLevel.SINGLE: 50,
    PcieLevel.MULTIPLE: 40,
    PcieLevel.HOSTBRIDGE: 30,
    PcieLevel.NODE: 20,
    PcieLevel.SYSTEM: 10,
}
# Above this many candidate sets the search is greedy instead of exhaustive (8 choose 4 = 70).
EXHAUSTIVE_LIMIT = 5000


def pair_score(topology: NodeTopology, a: int, b: int) -> int:
    if a == b:
        return 0
    return NVLINK_SCORE * topology.nvlinks[a][b] + PCIE_SCORE[topology.pcie[a][b]]


def set_score(topology: NodeTopology, gpus: Sequence[int]) -> int:
    return sum(pair_score(topology, a, b) for a, b in combinations(gpus, 2))


def _score_matrix(topology: NodeTopology) -> list[list[int]]:
    n = topology.gpu_count
    return [[pair_score(topology, a, b) for b in range(n)] for a in range(n)]


def best_gpu_set(
    topology: NodeTopology, available: Sequence[int], size: int, must_include: Sequence[int] = ()
) -> tuple[int, ...]:
    """The `size` GPUs (sorted indices) with the highest set score, containing `must_include`.

    Ties are broken first by what the choice leaves behind (prefer the set whose remaining GPUs keep
    the best pairs: taking one GPU of a broken NVLink pair before splitting an intact one), then by
    the lowest indices. Exhaustive up to EXHAUSTIVE_LIMIT candidate sets, greedy beyond.
    """
    must = tuple(sorted(set(must_include)))
    pool = sorted(set(available) | set(must))
    for g in pool:
        if not 0 <= g < topology.gpu_count:
            raise ValueError(f"GPU index {g} is not on this node ({topology.gpu_count} GPUs)")
    if size < len(must):
        raise ValueError(f"must_include has {len(must)} GPUs but only {size} are requested")
    if size > len(pool):
        raise ValueError(f"{size} GPUs requested but only {len(pool)} are available")
    if size == len(must):
        return must
    return _search(topology, tuple(pool), size, must)


# A placement policy asks this for every candidate node of every multi-GPU decision, and the nodes of a
# cluster share a handful of (topology, free GPUs) combinations: the answer is remembered (one decision
# for a 4-GPU pod on 1,000 empty dgx-h100 nodes: 109 ms before, 12 ms with it; docs/benchmarks.md).
@lru_cache(maxsize=8192)
def _search(topology: NodeTopology, pool: tuple[int, ...], size: int, must: tuple[int, ...]) -> tuple[int, ...]:
    free = [g for g in pool if g not in must]
    need = size - len(must)
    scores = _score_matrix(topology)
    if comb(len(free), need) <= EXHAUSTIVE_LIMIT:
        return _exhaustive(scores, list(pool), free, need, must)
    return _greedy(scores, free, need, must)


def _exhaustive(
    scores: list[list[int]], pool: list[int], free: list[int], need: int, must: tuple[int, ...]
) -> tuple[int, ...]:
    best: list[tuple[int, ...]] = []
    best_score = -1
    for extra in combinations(free, need):
        chosen = tuple(sorted(must + extra))
        score = sum(scores[a][b] for a, b in combinations(chosen, 2))
        if score > best_score:
            best, best_score = [chosen], score
        elif score == best_score:
            best.append(chosen)
    if len(best) == 1:
        return best[0]
    # candidates are generated in lexicographic order, so max() keeps the lowest indices on ties
    return max(best, key=lambda chosen: _leftover_quality(scores, pool, chosen))


def _leftover_quality(scores: list[list[int]], pool: list[int], chosen: tuple[int, ...]) -> int:
    """Sum over the GPUs left available of their best pair score with another left-over GPU."""
    rest = [g for g in pool if g not in chosen]
    return sum(max((scores[g][h] for h in rest if h != g), default=0) for g in rest)


def _greedy(scores: list[list[int]], free: list[int], need: int, must: tuple[int, ...]) -> tuple[int, ...]:
    chosen = list(must)
    remaining = list(free)
    if not chosen:
        # seed with the best pair (lowest indices on ties), or the lowest GPU for a single GPU
        if need == 1:
            return (remaining[0],)
        a, b = max(combinations(remaining, 2), key=lambda p: (scores[p[0]][p[1]], -p[0], -p[1]))
        chosen, need = [a, b], need - 2
        remaining = [g for g in remaining if g not in (a, b)]
    for _ in range(need):
        g = max(remaining, key=lambda c: (sum(scores[c][x] for x in chosen), -c))
        chosen.append(g)
        remaining.remove(g)
    return tuple(sorted(chosen))
