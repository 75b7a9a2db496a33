import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from tests.support.clusters import gpu_node, mig_node


def test_assume_then_release_restores_the_state():
    snap = ClusterSnapshot([gpu_node("a", 2), mig_node("m")])
    before = {k: v.copy() for k, v in vars(snap).items() if isinstance(v, np.ndarray) and k != "version"}
    share = PodRequest(name="s", cpu_milli=4000, memory_mib=1000, gpu_count=1, gpu_milli=250)
    placement = Placement(node="a", gpu_indices=(1,), gpu_milli=250, gpu_memory_mib=10_240)
    mig = PodRequest(name="g", mig_profile="1g.10gb", mig_count=1)
    mig_place = Placement(node="m", mig_devices=("MIG-m-0-b",))
    versions = snap.version.tolist()
    snap.assume(share, placement)
    snap.assume(mig, mig_place)
    assert snap.free_milli[0, 1] == 750 and snap.gpu_mem_free[0, 1] == 40_960 - 10_240
    assert snap.cpu_free[0] == 60_000 and snap.pods_free[0] == snap.pods_total[0] - 1
    assert snap.mig_free["1g.10gb"][1] == 1 and "MIG-m-0-b" in snap.mig_taken[1]
    assert snap.used_gpu_milli() == 250
    snap.release(share, placement)
    snap.release(mig, mig_place)
    for key, value in before.items():
        assert np.array_equal(getattr(snap, key), value), key
    after = snap.version.tolist()  # each change gave its row a version no row had before
    assert all(a > b for a, b in zip(after, versions, strict=True)) and len(set(after + versions)) == 4


def test_copy_is_independent():
    snap = ClusterSnapshot([gpu_node("a", 1)])
    other = snap.copy()
    other.assume(
        PodRequest(name="w", gpu_count=1, gpu_milli=1000), Placement(node="a", gpu_indices=(0,), gpu_milli=1000)
    )
    assert snap.free_milli[0, 0] == 1000 and other.free_milli[0, 0] == 0


def test_copies_share_per_node_sets_until_either_changes_a_row():
    snap = ClusterSnapshot([gpu_node("a", 2), mig_node("m")])
    mig = PodRequest(name="g", mig_profile="1g.10gb", mig_count=1)
    share = PodRequest(name="s", gpu_count=1, gpu_milli=250)
    snap.assume(mig, Placement(node="m", mig_devices=("MIG-m-0-b",)))
    other = snap.copy()
    third = other.copy()
    other.release(mig, Placement(node="m", mig_devices=("MIG-m-0-b",)))
    other.assume(share, Placement(node="a", gpu_indices=(0,), gpu_milli=250, gpu_memory_mib=1024))
    assert "MIG-m-0-b" in snap.mig_taken[1] and "MIG-m-0-b" in third.mig_taken[1]
    assert not other.mig_taken[1] and other.gpu_tags[0] == {"share": 1}
    assert not snap.gpu_tags[0] and not third.gpu_tags[0]
    snap.assume(mig, Placement(node="m", mig_devices=("MIG-m-0-a",)))  # the original writes its own too
    assert third.mig_taken[1] == {"MIG-m-0-b"} and not other.mig_taken[1]
    assert snap.mig_taken[1] == {"MIG-m-0-a", "MIG-m-0-b"}
    snap.remove_node("a")  # row 1 moves to row 0, its ownership with it
    snap.release(mig, Placement(node="m", mig_devices=("MIG-m-0-a",)))
    assert snap.mig_taken[0] == {"MIG-m-0-b"} and third.mig_taken[1] == {"MIG-m-0-b"}


def test_mig_gpu_is_not_offered_whole_or_shared():
    snap = ClusterSnapshot([mig_node("m")])
    assert snap.gpu_usable.tolist() == [[False, True]]
    assert snap.free_milli[0, 0] < 0 and snap.mig_total["3g.40gb"].tolist() == [1]


def test_duplicate_names_and_bad_tie_order_are_errors():
    with pytest.raises(ValueError, match="duplicate node names: a"):
        ClusterSnapshot([gpu_node("a", 1), gpu_node("a", 2)])
    with pytest.raises(ValueError, match="tie order has 1 entries for 2 nodes"):
        ClusterSnapshot([gpu_node("a", 1), gpu_node("b", 2)], tie_order=["x"])


def test_tie_order_ranks_by_the_given_names():
    snap = ClusterSnapshot([gpu_node("a", 1), gpu_node("b", 1)], tie_order=["0900-a", "0100-b"])
    assert snap.tie_rank.tolist() == [1, 0]
