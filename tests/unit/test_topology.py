"""Topology scoring and best GPU set (gpupool_common.gpu_sets)."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_common import gpu_sets as topo
from gpupool_common.gpu_sets import best_gpu_set, pair_score, set_score
from gpupool_common.topology import NodeTopology, PcieLevel


def nvlink_pairs() -> NodeTopology:
    """8 PCIe GPUs, NVLink bridges (0,2) (1,3) (4,6) (5,7); switches {0,1} {2,3} {4,5} {6,7}; 2 sockets."""
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    links = []
    for a, b in combinations(range(8), 2):
        nv = 12 if {a, b} in ({0, 2}, {1, 3}, {4, 6}, {5, 7}) else 0
        level = PcieLevel.SINGLE if a // 2 == b // 2 else PcieLevel.NODE if numa[a] == numa[b] else PcieLevel.SYSTEM
        links.append((a, b, nv, level))
    return NodeTopology.from_links(numa, links)


def test_pair_score_orders_links_like_nvidias_best_effort_policy() -> None:
    t = NodeTopology.from_links(
        [0, 0, 0, 0, 0, 0, 1],
        [
            (0, 1, 1, PcieLevel.SYSTEM),
            (0, 2, 0, PcieLevel.INTERNAL),
            (0, 3, 0, PcieLevel.SINGLE),
            (0, 4, 0, PcieLevel.MULTIPLE),
            (0, 5, 0, PcieLevel.HOSTBRIDGE),
            (0, 6, 0, PcieLevel.SYSTEM),
        ],
    )
    scores = [pair_score(t, 0, b) for b in range(1, 7)]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == 6
    # a pair not listed falls back to NUMA: same node (0, 0) -> NODE, across -> SYSTEM
    assert t.pcie[1][2] == PcieLevel.NODE and t.pcie[1][6] == PcieLevel.SYSTEM
    assert pair_score(t, 1, 2) > pair_score(t, 1, 6)


def test_nvlink_count_dominates_pcie() -> None:
    t = NodeTopology.from_links([0, 1, 0], [(0, 1, 1, PcieLevel.SYSTEM), (0, 2, 0, PcieLevel.INTERNAL)])
    assert pair_score(t, 0, 1) > pair_score(t, 0, 2)


def test_best_pair_is_the_linked_one_not_the_lowest_indices() -> None:
    t = nvlink_pairs()
    assert best_gpu_set(t, range(8), 2) == (0, 2)
    # GPU 0 busy: (1,3) (4,6) (5,7) score alike; (1,3) would strand GPU 2 alone on socket 0, while
    # (4,6) leaves 2 next to its switch mate 3, so the tie goes to what the choice leaves behind
    assert best_gpu_set(t, [1, 2, 3, 4, 5, 6, 7], 2) == (4, 6)
    assert best_gpu_set(t, range(8), 2, must_include=[5]) == (5, 7)


def test_four_gpus_stay_on_one_socket_with_two_links() -> None:
    t = nvlink_pairs()
    assert best_gpu_set(t, range(8), 4) == (0, 1, 2, 3)
    assert best_gpu_set(t, [0, 2, 4, 5, 6, 7], 4) == (4, 5, 6, 7)


def test_single_gpu_keeps_intact_pairs_intact() -> None:
    t = nvlink_pairs()
    # GPU 0 is taken: taking 2 (its orphaned partner) keeps (1,3) (4,6) (5,7) whole
    assert best_gpu_set(t, [1, 2, 3, 4, 5, 6, 7], 1) == (2,)
    assert best_gpu_set(t, range(8), 1) == (0,)  # all intact: lowest index


def test_ties_break_to_lowest_indices() -> None:
    t = NodeTopology.uniform(8, nvlinks=18, level=PcieLevel.NODE)
    assert best_gpu_set(t, range(8), 3) == (0, 1, 2)
    assert best_gpu_set(t, [7, 5, 3, 1], 2) == (1, 3)


def test_must_include_and_bad_requests() -> None:
    t = nvlink_pairs()
    assert best_gpu_set(t, [1, 3], 2, must_include=[1]) == (1, 3)
    assert best_gpu_set(t, [], 1, must_include=[6]) == (6,)  # must_include counts as available
    with pytest.raises(ValueError, match="only 2 are available"):
        best_gpu_set(t, [0, 1], 3)
    with pytest.raises(ValueError, match="must_include has 2"):
        best_gpu_set(t, range(8), 1, must_include=[0, 1])
    with pytest.raises(ValueError, match="not on this node"):
        best_gpu_set(t, [0, 9], 1)
    assert best_gpu_set(t, range(8), 0) == ()


def test_topology_must_be_square_and_symmetric() -> None:
    with pytest.raises(ValueError, match="symmetric"):
        NodeTopology((0, 0), ((0, 1), (0, 0)), ((PcieLevel.INTERNAL,) * 2,) * 2)
    with pytest.raises(ValueError, match="2x2"):
        NodeTopology((0, 0), ((0,),), ((PcieLevel.INTERNAL,) * 2,) * 2)


def test_greedy_beyond_the_exhaustive_limit_finds_linked_groups(monkeypatch) -> None:
    # 16 GPUs in 4 NVLink islands of 4; 16 choose 8 = 12870 sets > limit -> greedy
    n = 16
    links = [
        (a, b, 4 if a // 4 == b // 4 else 0, PcieLevel.NODE if a // 8 == b // 8 else PcieLevel.SYSTEM)
        for a, b in combinations(range(n), 2)
    ]
    t = NodeTopology.from_links([g // 8 for g in range(n)], links)
    assert best_gpu_set(t, range(n), 8) == tuple(range(8))
    assert best_gpu_set(t, range(n), 4, must_include=[9]) == (8, 9, 10, 11)
    monkeypatch.setattr(topo, "EXHAUSTIVE_LIMIT", 10**9)
    assert best_gpu_set(t, range(n), 8) == tuple(range(8))  # exhaustive agrees


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_exhaustive_result_is_optimal(data) -> None:
    n = data.draw(st.integers(2, 7))
    numa = [g * 2 // n for g in range(n)]
    links = [
        (a, b, data.draw(st.integers(0, 3)), data.draw(st.sampled_from(list(PcieLevel))))
        for a, b in combinations(range(n), 2)
    ]
    t = NodeTopology.from_links(numa, links)
    available = data.draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True))
    size = data.draw(st.integers(1, len(available)))
    must = data.draw(st.lists(st.sampled_from(available), max_size=size, unique=True))
    chosen = best_gpu_set(t, available, size, must)
    assert len(chosen) == size and set(must) <= set(chosen) <= set(available)
    best = max(set_score(t, c) for c in combinations(sorted(available), size) if set(must) <= set(c))
    assert set_score(t, chosen) == best


def test_remembered_answers_are_the_searchs_answers() -> None:
    """best_gpu_set remembers answers per (topology, free GPUs, size): the same as searching afresh."""
    t = nvlink_pairs()
    for size in (1, 2, 3, 4):
        for pool in combinations(range(8), 6):
            remembered = best_gpu_set(t, pool, size)
            assert remembered == best_gpu_set(t, list(pool), size)
            assert remembered == topo._search.__wrapped__(t, tuple(pool), size, ())
    assert topo._search.cache_info().hits > 0
