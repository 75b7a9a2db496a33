"""Gang placement in the core: all of the minimum or nothing, the snapshot untouched, locality."""

from __future__ import annotations

import pytest

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gang import GangPlacement, GangUnschedulable, place_gang
from gpupool_sched.placement.registry import build_policy as _build
from gpupool_sched.placement.workload import default_prior
from tests.support.clusters import assert_same, free_capacity, gpu_node


def build_policy(name: str) -> Policy:
    return _build(name, default_prior())


def whole(name: str, k: int) -> PodRequest:
    return PodRequest(name=name, cpu_milli=1000, gpu_count=k, gpu_milli=1000)


def share(name: str, milli: int) -> PodRequest:
    return PodRequest(name=name, cpu_milli=100, gpu_count=1, gpu_milli=milli)


@pytest.mark.parametrize("policy", ["gpupool", "fgd", "best-fit"])
def test_whole_gang_fits_and_snapshot_is_restored(policy: str) -> None:
    snap = ClusterSnapshot([gpu_node(f"n{i}", 8) for i in range(3)])
    before = free_capacity(snap)
    members = [whole(f"m{i}", 4) for i in range(4)]
    out = place_gang(snap, members, 4, build_policy(policy))
    assert isinstance(out, GangPlacement)
    assert sorted(i for i, _ in out.placements) == [0, 1, 2, 3]
    used = [(p.node, g) for _, p in out.placements for g in p.gpu_indices]
    assert len(used) == len(set(used)) == 16, "no GPU given to two members"
    assert len(out.nodes) == 2, "4 x 4 GPUs pack onto two 8-GPU nodes, not spread over three"
    assert_same(before, free_capacity(snap))


def test_gang_that_does_not_fit_places_nothing_and_says_why() -> None:
    snap = ClusterSnapshot([gpu_node(f"n{i}", 8) for i in range(2)])
    snap.assume(whole("other", 4), Placement(node="n0", gpu_indices=(0, 1, 2, 3), gpu_milli=1000))
    before = free_capacity(snap)
    members = [whole(f"m{i}", 4) for i in range(3)]  # needs 12, 12 free but 3 x 4 needs three 4-blocks: n0 4, n1 8
    out = place_gang(snap, members, 3, build_policy("gpupool"))
    assert isinstance(out, GangPlacement)  # 4 on n0 + 8 on n1 = three 4-GPU members
    members.append(whole("m3", 4))
    out = place_gang(snap, members, 4, build_policy("gpupool"))
    assert isinstance(out, GangUnschedulable)
    assert (out.need, out.placed) == (4, 3)
    assert "3 of the 4 members" in out.message and "Insufficient nvidia.com/gpu" in out.message
    assert_same(before, free_capacity(snap))


def test_more_members_than_the_minimum_are_placed_when_they_fit() -> None:
    snap = ClusterSnapshot([gpu_node("n0", 8)])
    members = [whole(f"m{i}", 2) for i in range(5)]  # 10 GPUs wanted, 8 there
    out = place_gang(snap, members, 3, build_policy("gpupool"))
    assert isinstance(out, GangPlacement)
    assert len(out.placements) == 4
    out = place_gang(snap, members, 5, build_policy("gpupool"))
    assert isinstance(out, GangUnschedulable) and out.placed == 4


def test_members_stay_on_the_gangs_node_when_it_has_room() -> None:
    """FGD alone would spread 1-GPU members over nodes (it keeps whole nodes free only statistically);
    the gang keeps them on one node while that node has room."""
    snap = ClusterSnapshot([gpu_node(f"n{i}", 8) for i in range(4)])
    for i in range(4):  # every node partly used, so no node is an obvious first choice
        snap.assume(share(f"s{i}", 300), Placement(node=f"n{i}", gpu_indices=(7,), gpu_milli=300,
                                                   gpu_memory_mib=12_288))
    members = [whole(f"m{i}", 1) for i in range(6)]
    out = place_gang(snap, members, 6, build_policy("gpupool"))
    assert isinstance(out, GangPlacement)
    assert len(out.nodes) == 1


def test_largest_members_first() -> None:
    """An 8-GPU member and two 1-GPU members on an 8-GPU and a 2-GPU node: the big one must get the 8-GPU
    node even though the small ones come first in the list (placed first, they could take it)."""
    snap = ClusterSnapshot([gpu_node("big", 8), gpu_node("small", 2)])
    members = [whole("a", 1), whole("b", 1), whole("c", 8)]
    out = place_gang(snap, members, 3, build_policy("gpupool"))
    assert isinstance(out, GangPlacement)
    by_member = {members[i].name: p.node for i, p in out.placements}
    assert by_member == {"c": "big", "a": "small", "b": "small"}


def test_shares_and_mixed_members() -> None:
    snap = ClusterSnapshot([gpu_node("n0", 2)])
    members = [whole("trainer", 1), share("server-a", 500), share("server-b", 500)]
    out = place_gang(snap, members, 3, build_policy("gpupool"))
    assert isinstance(out, GangPlacement)
    gpus = {members[i].name: p.gpu_indices for i, p in out.placements}
    assert gpus["server-a"] == gpus["server-b"] != gpus["trainer"]


def test_need_must_be_within_the_members() -> None:
    snap = ClusterSnapshot([gpu_node("n0", 2)])
    with pytest.raises(ValueError, match="cannot need 3"):
        place_gang(snap, [whole("a", 1), whole("b", 1)], 3, build_policy("gpupool"))
    with pytest.raises(ValueError, match="cannot need 0"):
        place_gang(snap, [whole("a", 1)], 0, build_policy("gpupool"))
