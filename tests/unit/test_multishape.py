"""Pods whose containers ask for several kinds of GPU demand at once (whole GPUs, a share, MIG)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpupool_common.topology import NodeTopology, PcieLevel
from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, MigSlice, NodeSpec
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import GpuShape, InvalidRequest, PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import POLICIES, build_policy
from tests.support.clusters import gpu_node, mig_node

GB = 1024
WHOLE2 = GpuShape(gpu_count=2, gpu_milli=1000)
WHOLE1 = GpuShape(gpu_count=1, gpu_milli=1000)
MEM10 = GpuShape(gpu_count=1, gpu_memory_mib=10 * GB)
MIG1G = GpuShape(mig_profile="1g.10gb", mig_count=1)
MIG3G = GpuShape(mig_profile="3g.40gb", mig_count=1)
PROFILE = WorkloadProfile.from_requests(
    [PodRequest(name=f"t{i}", cpu_milli=2000, gpu_count=1, gpu_milli=250) for i in range(4)]
    + [PodRequest(name="w", cpu_milli=8000, gpu_count=2, gpu_milli=1000)]
)


def multi(*shapes: GpuShape, name: str = "p", **fields) -> PodRequest:
    return PodRequest.of_shapes(name, shapes, cpu_milli=fields.pop("cpu_milli", 2000), **fields)


# ---- the request ---------------------------------------------------------------------------------
def test_of_shapes_orders_whole_then_share_then_mig_by_profile():
    p = multi(MIG3G, MEM10, MIG1G, WHOLE2)
    assert (p.gpu_count, p.gpu_milli) == (2, 1000) and p.is_whole
    assert p.extra == (MEM10, MIG1G, MIG3G)
    assert p.gpu_shapes() == (WHOLE2, MEM10, MIG1G, MIG3G)
    assert p.gpu_tag() == "2-gpu" and p.gpu_milli_total == 2000  # the primary shape
    migs = multi(MIG3G, MIG1G)
    assert migs.mig_profile == "1g.10gb" and migs.extra == (MIG3G,)
    cpu = PodRequest.of_shapes("c", [], cpu_milli=500)
    assert cpu.gpu_shapes() == () and not cpu.wants_gpu and cpu.extra == () and cpu.gpu_tag() == "cpu"
    single = PodRequest.of_shapes("s", [MEM10])
    assert single == PodRequest(name="s", gpu_count=1, gpu_memory_mib=10 * GB)


@pytest.mark.parametrize(
    ("shapes", "fields", "fragment"),
    [
        ((WHOLE1, WHOLE2), {}, "2 whole-GPU shapes"),
        ((MEM10, GpuShape(gpu_count=1, gpu_milli=300)), {}, "2 GPU-share shapes"),
        ((MIG1G, MIG1G, WHOLE1), {}, "2 shapes of MIG 1g.10gb"),
        ((WHOLE1, GpuShape()), {}, "shape 1 asks for no GPU"),
        ((WHOLE1,), {"gpu_count": 1}, "not as gpu_count"),
        ((WHOLE1,), {"extra": (MEM10,)}, "not as extra"),
    ],
)
def test_of_shapes_rejects_what_one_pod_cannot_ask(shapes, fields, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        PodRequest.of_shapes("p", shapes, **fields)


def test_invalid_shapes_and_extras_are_rejected():
    with pytest.raises(InvalidRequest, match="covers exactly one GPU"):
        GpuShape(gpu_count=2, gpu_milli=500)
    with pytest.raises(InvalidRequest, match="go together"):
        GpuShape(mig_profile="1g.10gb")
    with pytest.raises(InvalidRequest, match="need a primary GPU shape"):
        PodRequest(name="p", cpu_milli=1, extra=(MEM10,))
    with pytest.raises(InvalidRequest, match="2 whole-GPU shapes"):
        PodRequest(name="p", gpu_count=1, gpu_milli=1000, extra=(WHOLE2,))
    with pytest.raises(InvalidRequest, match=r"extra\[0\] asks for no GPU"):
        PodRequest(name="p", gpu_count=1, gpu_milli=1000, extra=(GpuShape(),))
    assert PodRequest(name="p", gpu_count=1, gpu_milli=1000, extra=[MEM10]).extra == (MEM10,)  # type: ignore[arg-type]


# ---- placement -----------------------------------------------------------------------------------
def place(snap: ClusterSnapshot, pod: PodRequest, policy: str = "best-fit") -> Placement | Unschedulable:
    return decide(snap, pod, build_policy(policy, PROFILE), np.random.default_rng(0))


def test_two_whole_gpus_and_a_share_need_three_free_gpus_or_a_used_one():
    pod = multi(WHOLE2, MEM10)
    d = place(ClusterSnapshot([gpu_node("three", 3)]), pod)
    assert isinstance(d, Placement) and d.gpu_indices == (0, 1) and d.gpu_milli == 1000
    (share,) = d.extras
    assert (share.node, share.gpu_indices, share.gpu_memory_mib, share.gpu_milli) == ("three", (2,), 10 * GB, 250)
    assert share.score == 0.0 and not share.breakdown

    d = place(ClusterSnapshot([gpu_node("two", 2)]), pod)
    assert isinstance(d, Unschedulable)
    assert d.message == "0/1 nodes are available: 1 no room for all GPU demands of the pod together."

    snap = ClusterSnapshot([gpu_node("three", 3)])
    used = Placement(node="three", gpu_indices=(1,), gpu_milli=500)
    snap.assume(PodRequest(name="t", gpu_count=1, gpu_milli=500), used)
    d = place(snap, pod)
    assert isinstance(d, Placement) and d.gpu_indices == (0, 2) and d.extras[0].gpu_indices == (1,)


def test_the_node_must_fit_every_shape_even_if_the_policy_prefers_another():
    snap = ClusterSnapshot([gpu_node("tight", 2, cpu=8000), gpu_node("roomy", 4, cpu=96_000)])
    assert place(snap, PodRequest(name="w", cpu_milli=2000, gpu_count=2, gpu_milli=1000)).node == "tight"
    d = place(snap, multi(WHOLE2, MEM10))
    assert isinstance(d, Placement) and d.node == "roomy" and d.extras[0].node == "roomy"
    d = place(ClusterSnapshot([gpu_node("tight", 2), gpu_node("small", 1)]), multi(WHOLE2, MEM10))
    assert isinstance(d, Unschedulable)
    assert d.node_reasons == {
        "tight": "no room for all GPU demands of the pod together",
        "small": "Insufficient nvidia.com/gpu",
    }


def test_the_share_goes_to_the_tightest_gpu_the_whole_gpus_left():
    snap = ClusterSnapshot([gpu_node("a", 4)])
    for gpu, used in ((1, 300), (2, 600)):
        snap.assume(
            PodRequest(name=f"x{gpu}", gpu_count=1, gpu_milli=used),
            Placement(node="a", gpu_indices=(gpu,), gpu_milli=used, gpu_memory_mib=used * 40),
        )
    d = place(snap, multi(WHOLE1, GpuShape(gpu_count=1, gpu_milli=300)))
    assert isinstance(d, Placement) and d.gpu_indices == (0,)
    assert d.extras[0].gpu_indices == (2,) and d.extras[0].gpu_milli == 300


def test_whole_gpus_leave_the_one_gpu_a_large_memory_share_fits_on():
    # GPU 0 has 80 GB, GPU 1 40 GB: the 60 GB share only fits GPU 0, so the whole GPU must be GPU 1,
    # though the policy's selector (lowest free index) would take GPU 0
    node = NodeSpec(
        "mixed",
        cpu_milli=64_000,
        memory_mib=256_000,
        gpus=(GpuSpec(0, "A100", memory_mib=80 * GB), GpuSpec(1, "A100", memory_mib=40 * GB)),
    )
    for policy in ("best-fit", "gpupool", "random"):
        snap = ClusterSnapshot([node])
        pod = multi(WHOLE1, GpuShape(gpu_count=1, gpu_memory_mib=60 * GB))
        d = place(snap, pod, policy)
        assert isinstance(d, Placement), policy
        assert d.gpu_indices == (1,) and d.gpu_memory_mib == 40 * GB and d.gpu_milli == 1000
        assert d.extras[0].gpu_indices == (0,) and d.extras[0].gpu_memory_mib == 60 * GB
        assert d.extras[0].gpu_milli == 750
        snap.assume(pod, d)
        assert snap.gpu_mem_free[0].tolist() == [20 * GB, 0] and snap.free_milli[0].tolist() == [250, 0]


def test_whole_gpus_and_mig_devices_together_and_exact_release():
    snap = ClusterSnapshot([mig_node("m"), gpu_node("g", 4)])
    before = {k: v.copy() for k, v in vars(snap).items() if isinstance(v, np.ndarray) and k != "version"}
    mig_before = {p: v.copy() for p, v in snap.mig_free_by_model.items()}
    pod = multi(WHOLE1, GpuShape(mig_profile="1g.10gb", mig_count=2), MIG3G, cpu_milli=3000, memory_mib=100)
    d = place(snap, pod)
    assert isinstance(d, Placement) and d.node == "m" and d.gpu_indices == (1,)
    assert [e.mig_devices for e in d.extras] == [("MIG-m-0-b", "MIG-m-0-c"), ("MIG-m-0-a",)]
    snap.assume(pod, d)
    assert snap.cpu_free[0] == 64_000 - 3000 and snap.mem_free[0] == 256_000 - 100  # counted once
    assert snap.pods_free[0] == snap.pods_total[0] - 1
    assert snap.free_milli[0, 1] == 0 and snap.mig_free["1g.10gb"][0] == 0 and snap.mig_free["3g.40gb"][0] == 0
    assert snap.mig_taken[0] == {"MIG-m-0-a", "MIG-m-0-b", "MIG-m-0-c"}
    again = place(snap, multi(MIG1G, MIG3G))
    assert isinstance(again, Unschedulable) and again.reason_counts["Insufficient nvidia.com/mig-1g.10gb"] == 2
    snap.release(pod, d)
    for key, value in before.items():
        assert np.array_equal(getattr(snap, key), value), key
    assert all(np.array_equal(snap.mig_free_by_model[k], v) for k, v in mig_before.items())
    assert snap.mig_taken[0] == set() and not snap.gpu_tags[0]


def test_two_mig_profiles_fail_together_with_the_joint_reason():
    snap = ClusterSnapshot([mig_node("m")])
    first = multi(MIG3G)
    snap.assume(first, place(snap, first))
    d = place(snap, multi(MIG1G, MIG3G))
    assert isinstance(d, Unschedulable)
    assert d.node_reasons == {"m": "no room for all GPU demands of the pod together"}


def test_extra_whole_gpus_get_the_best_connected_set():
    # GPU 0 is MIG-split; whole GPUs 1..4 with NVLink pairs (1,3) and (2,4). A pod asking for a MIG
    # slice and two whole GPUs (built directly: the MIG shape is the primary) gets an NVLink pair.
    split = GpuSpec(0, "A100", 81_920, mig_enabled=True, mig_slices=(MigSlice("MIG-0", "1g.10gb", 0),))
    gpus = (split, *(GpuSpec(i, "A100", 81_920) for i in range(1, 5)))
    topo = NodeTopology.from_links([0] * 5, [(1, 3, 12, PcieLevel.NODE), (2, 4, 12, PcieLevel.NODE)])
    snap = ClusterSnapshot([NodeSpec("t", 64_000, 256_000, gpus=gpus, topology=topo)])
    pod = PodRequest(name="p", mig_profile="1g.10gb", mig_count=1, extra=(WHOLE2,))
    d = place(snap, pod)
    assert isinstance(d, Placement) and d.mig_devices == ("MIG-0",) and d.extras[0].gpu_indices == (1, 3)
    snap.assume(pod, d)
    assert snap.free_milli[0].tolist() == [-1, 0, 1000, 0, 1000]


def test_a_placement_must_carry_one_part_per_extra_shape():
    snap = ClusterSnapshot([gpu_node("a", 3)])
    pod = multi(WHOLE2, MEM10)
    with pytest.raises(ValueError, match="0 extra part"):
        snap.assume(pod, Placement(node="a", gpu_indices=(0, 1), gpu_milli=1000))
    bad = Placement(node="a", gpu_indices=(0, 1), gpu_milli=1000, extras=(Placement(node="b", gpu_indices=(2,)),))
    with pytest.raises(ValueError, match="extra part on b"):
        snap.assume(pod, bad)
    assert snap.free_milli[0].tolist() == [1000, 1000, 1000] and snap.cpu_free[0] == 64_000  # nothing applied


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_places_multi_shape_pods_until_full(policy):
    snap = ClusterSnapshot([gpu_node("a", 4), gpu_node("b", 3), gpu_node("c", 2)])
    placed = []
    for i in range(4):
        pod = multi(WHOLE2, MEM10, name=f"p{i}")
        d = place(snap, pod, policy)
        if isinstance(d, Unschedulable):
            break
        gpus = set(d.gpu_indices)
        assert len(gpus) == 2 and not gpus & set(d.extras[0].gpu_indices)
        snap.assume(pod, d)
        placed.append(d.node)
    assert sorted(placed) == ["a", "b"]  # c has only two GPUs
    assert snap.used_gpu_milli() == 2 * 2000 + 250 + 250


def test_mig_fit_counts_only_slices_of_the_allowed_models():
    # node "mixed" has two 1g.10gb slices on an A100 and two on an H100; "a100" has three on A100s.
    # Old behaviour: MigFit counted all four slices on "mixed" and gave the pod only two devices.
    def mig_gpu(index: int, model: str, node: str, slices: int) -> GpuSpec:
        devs = tuple(MigSlice(f"MIG-{node}-{index}-{k}", "1g.10gb", index) for k in range(slices))
        return GpuSpec(index, model, 81_920, mig_enabled=True, mig_slices=devs)

    mixed = NodeSpec("mixed", 64_000, 256_000, gpus=(mig_gpu(0, "A100", "mixed", 2), mig_gpu(1, "H100", "mixed", 2)))
    a100 = NodeSpec("z-a100", 64_000, 256_000, gpus=(mig_gpu(0, "A100", "z", 2), mig_gpu(1, "A100", "z", 1)))
    pod = PodRequest(name="p", mig_profile="1g.10gb", mig_count=3, gpu_models=frozenset({"A100"}))
    for policy in POLICIES:
        d = place(ClusterSnapshot([mixed, a100]), pod, policy)
        assert isinstance(d, Placement) and d.node == "z-a100" and len(d.mig_devices) == 3, policy
    d = place(ClusterSnapshot([mixed]), pod)
    assert isinstance(d, Unschedulable) and d.node_reasons == {"mixed": "Insufficient nvidia.com/mig-1g.10gb"}
    any_model = replace(pod, gpu_models=frozenset())
    d = place(ClusterSnapshot([mixed]), any_model)
    assert isinstance(d, Placement) and len(d.mig_devices) == 3
