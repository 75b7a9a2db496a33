"""Each policy's decision on small hand-made clusters."""

from __future__ import annotations

import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import POLICIES, build_policy
from tests.support.clusters import gpu_node, mig_node

GB = 1024

# a workload of mostly 10 GB inference tenants, some 35 GB jobs and some whole-GPU training
MIX = (
    [PodRequest(name=f"t{i}", cpu_milli=2000, gpu_count=1, gpu_milli=250) for i in range(6)]
    + [PodRequest(name=f"j{i}", cpu_milli=4000, gpu_count=1, gpu_milli=875) for i in range(2)]
    + [PodRequest(name=f"w{i}", cpu_milli=8000, gpu_count=1, gpu_milli=1000) for i in range(2)]
)
PROFILE = WorkloadProfile.from_requests(MIX)
PACKING_AWARE = [p for p in POLICIES if p != "random"]


def place_all(snap: ClusterSnapshot, policy_name: str, pods: list[PodRequest]) -> list[Placement | Unschedulable]:
    policy = build_policy(policy_name, PROFILE)
    out = []
    for pod in pods:
        d = decide(snap, pod, policy, np.random.default_rng(1))
        if isinstance(d, Placement):
            snap.assume(pod, d)
        out.append(d)
    return out


@pytest.mark.parametrize("policy", PACKING_AWARE)
@pytest.mark.parametrize("share", ["memory", "milli"])
def test_three_10gb_tenants_do_not_block_a_35gb_job(policy, share):
    """The seed case: tenants share one 40 GB card, so a 35 GB job still finds the other card free."""
    snap = ClusterSnapshot([gpu_node("node-a", 2, gpu_mem=40 * GB)])
    if share == "memory":
        tenants = [PodRequest(name=f"t{i}", cpu_milli=1000, gpu_count=1, gpu_memory_mib=10 * GB) for i in range(3)]
        job = PodRequest(name="job", cpu_milli=1000, gpu_count=1, gpu_memory_mib=35 * GB)
    else:
        tenants = [PodRequest(name=f"t{i}", cpu_milli=1000, gpu_count=1, gpu_milli=250) for i in range(3)]
        job = PodRequest(name="job", cpu_milli=1000, gpu_count=1, gpu_milli=875)
    decisions = place_all(snap, policy, [*tenants, job])
    assert all(isinstance(d, Placement) for d in decisions), [getattr(d, "message", d) for d in decisions]
    tenant_gpus = {d.gpu_indices for d in decisions[:3]}
    assert len(tenant_gpus) == 1, f"{policy} spread the tenants over {tenant_gpus}"
    assert decisions[3].gpu_indices != decisions[0].gpu_indices


def test_a_35gb_job_fails_with_a_reason_when_both_cards_hold_tenants():
    snap = ClusterSnapshot([gpu_node("node-a", 2, gpu_mem=40 * GB)])
    pods = [PodRequest(name=f"t{i}", gpu_count=1, gpu_memory_mib=10 * GB) for i in range(2)]
    policy = build_policy("best-fit")
    for pod, gpu in zip(pods, (0, 1), strict=True):
        snap.assume(pod, Placement(node="node-a", gpu_indices=(gpu,), gpu_milli=250, gpu_memory_mib=10 * GB))
    d = decide(snap, PodRequest(name="big", gpu_count=1, gpu_memory_mib=35 * GB), policy)
    assert isinstance(d, Unschedulable)
    assert d.message == "0/1 nodes are available: 1 no GPU with 35840 MiB of GPU memory free."
    assert d.node_reasons == {"node-a": "no GPU with 35840 MiB of GPU memory free"}


def test_best_fit_prefers_the_node_with_least_left_over():
    snap = ClusterSnapshot([gpu_node("roomy", 8, cpu=96_000), gpu_node("tight", 2, cpu=16_000)])
    d = decide(snap, PodRequest(name="p", cpu_milli=4000, gpu_count=1, gpu_milli=1000), build_policy("best-fit"))
    assert isinstance(d, Placement) and d.node == "tight" and d.gpu_indices == (0,)


def test_best_fit_and_packing_put_a_share_on_the_tightest_gpu():
    for name in ("best-fit", "gpu-packing", "dot-product", "gpu-clustering"):
        snap = ClusterSnapshot([gpu_node("a", 4)])
        for gpu, used in ((1, 500), (2, 700)):
            snap.assume(
                PodRequest(name=f"x{gpu}", gpu_count=1, gpu_milli=used),
                Placement(node="a", gpu_indices=(gpu,), gpu_milli=used),
            )
        d = decide(snap, PodRequest(name="p", gpu_count=1, gpu_milli=300), build_policy(name))
        assert isinstance(d, Placement) and d.gpu_indices == (2,), name


def test_packing_prefers_partly_used_gpus_then_busy_nodes_then_idle_nodes():
    snap = ClusterSnapshot([gpu_node("idle", 2), gpu_node("busy", 2), gpu_node("shared", 2)])
    snap.assume(
        PodRequest(name="w", gpu_count=1, gpu_milli=1000), Placement(node="busy", gpu_indices=(0,), gpu_milli=1000)
    )
    snap.assume(
        PodRequest(name="s", gpu_count=1, gpu_milli=400), Placement(node="shared", gpu_indices=(1,), gpu_milli=400)
    )
    policy = build_policy("gpu-packing")
    share = decide(snap, PodRequest(name="p", gpu_count=1, gpu_milli=500), policy)
    assert isinstance(share, Placement) and (share.node, share.gpu_indices) == ("shared", (1,))
    whole = decide(snap, PodRequest(name="q", gpu_count=1, gpu_milli=1000), policy)
    assert isinstance(whole, Placement) and whole.node in {"busy", "shared"}
    assert whole.breakdown["GpuPacking"] == 49


def test_clustering_keeps_request_kinds_together():
    snap = ClusterSnapshot([gpu_node("shares", 4), gpu_node("wholes", 4), gpu_node("idle", 4)])
    snap.assume(
        PodRequest(name="s", gpu_count=1, gpu_milli=300), Placement(node="shares", gpu_indices=(0,), gpu_milli=300)
    )
    snap.assume(
        PodRequest(name="w", gpu_count=1, gpu_milli=1000), Placement(node="wholes", gpu_indices=(0,), gpu_milli=1000)
    )
    policy = build_policy("gpu-clustering")
    d = decide(snap, PodRequest(name="p", gpu_count=1, gpu_milli=200), policy)
    assert isinstance(d, Placement) and d.node == "shares"
    d = decide(snap, PodRequest(name="q", gpu_count=1, gpu_milli=1000), policy)
    assert isinstance(d, Placement) and d.node == "wholes"
    d = decide(snap, PodRequest(name="r", gpu_count=2, gpu_milli=1000), policy)
    assert isinstance(d, Placement) and d.node == "idle"


def test_dot_product_sends_a_cpu_heavy_pod_where_cpu_is_scarce_relative_to_gpu():
    # the pod is CPU-heavy; the node with less free CPU has the smaller dot product
    snap = ClusterSnapshot([gpu_node("cpu-rich", 2, cpu=96_000), gpu_node("cpu-poor", 2, cpu=24_000)])
    d = decide(snap, PodRequest(name="p", cpu_milli=16_000, gpu_count=1, gpu_milli=1000), build_policy("dot-product"))
    assert isinstance(d, Placement) and d.node == "cpu-poor"


def test_random_fit_only_picks_feasible_nodes_and_is_seeded():
    nodes = [gpu_node(f"n{i}", 1) for i in range(6)] + [gpu_node("full", 1, cpu=1000)]
    pod = PodRequest(name="p", cpu_milli=2000, gpu_count=1, gpu_milli=1000)
    policy = build_policy("random")
    picks = {decide(ClusterSnapshot(nodes), pod, policy, np.random.default_rng(s)).node for s in range(40)}
    assert "full" not in picks and len(picks) >= 4
    again = [decide(ClusterSnapshot(nodes), pod, policy, np.random.default_rng(7)).node for _ in range(3)]
    assert len(set(again)) == 1


def test_fgd_keeps_a_whole_node_free_for_a_multi_gpu_job():
    # a share could go to the idle 8-GPU node or next to an existing share on the 4-GPU node;
    # FGD keeps the 8-GPU node whole because 8-GPU jobs are in the workload
    workload = [PodRequest(name=f"e{i}", cpu_milli=8000, gpu_count=8, gpu_milli=1000) for i in range(3)] + [
        PodRequest(name=f"s{i}", cpu_milli=2000, gpu_count=1, gpu_milli=500) for i in range(3)
    ]
    profile = WorkloadProfile.from_requests(workload)
    snap = ClusterSnapshot([gpu_node("big", 8, cpu=96_000), gpu_node("small", 4, cpu=96_000)])
    snap.assume(workload[3], Placement(node="small", gpu_indices=(0,), gpu_milli=500))
    d = decide(snap, PodRequest(name="new", cpu_milli=2000, gpu_count=1, gpu_milli=500), build_policy("fgd", profile))
    assert isinstance(d, Placement) and (d.node, d.gpu_indices) == ("small", (0,))
    assert d.score > 50


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_reports_why_nothing_fits(policy):
    snap = ClusterSnapshot([gpu_node("a", 1, model="T4"), gpu_node("b", 2, model="A100", cpu=2000)])
    d = decide(
        snap,
        PodRequest(name="p", cpu_milli=4000, gpu_count=1, gpu_milli=1000, gpu_models=frozenset({"A100"})),
        build_policy(policy, PROFILE),
    )
    assert isinstance(d, Unschedulable)
    assert d.node_reasons == {"a": "node(s) didn't have GPU model A100", "b": "Insufficient cpu"}
    assert d.message.startswith("0/2 nodes are available: ")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_places_mig_and_whole_gpu_pods(policy):
    snap = ClusterSnapshot([mig_node("m"), gpu_node("g", 2)])
    p = build_policy(policy, PROFILE)
    mig = decide(snap, PodRequest(name="m1", mig_profile="1g.10gb", mig_count=2), p, np.random.default_rng(0))
    assert isinstance(mig, Placement) and mig.node == "m" and len(mig.mig_devices) == 2
    snap.assume(PodRequest(name="m1", mig_profile="1g.10gb", mig_count=2), mig)
    again = decide(snap, PodRequest(name="m2", mig_profile="1g.10gb", mig_count=1), p)
    assert isinstance(again, Unschedulable) and "Insufficient nvidia.com/mig-1g.10gb" in again.message
    whole = decide(snap, PodRequest(name="w", gpu_count=2, gpu_milli=1000), p, np.random.default_rng(0))
    assert isinstance(whole, Placement) and whole.node == "g" and whole.gpu_indices == (0, 1)


def test_nodes_without_gpus_never_take_gpu_pods():
    snap = ClusterSnapshot([NodeSpec(name="cpu-only", cpu_milli=64_000, memory_mib=1000), gpu_node("g", 1)])
    d = decide(snap, PodRequest(name="p", gpu_count=1, gpu_milli=100), build_policy("best-fit"))
    assert isinstance(d, Placement) and d.node == "g"


def test_a_memory_share_counts_only_the_gpus_that_can_host_it():
    # node "small" has one 80 GB GPU and an empty second slot; node "big" two 40 GB GPUs
    snap = ClusterSnapshot([gpu_node("small", 1, gpu_mem=80 * GB), gpu_node("big", 2, gpu_mem=40 * GB)])
    from gpupool_sched.placement.framework import CycleState

    state = CycleState(snap, PodRequest(name="m", gpu_count=1, gpu_memory_mib=20 * GB), None)
    assert state.milli_taken(np.array([0, 1])).tolist() == [250, 500]
    d = decide(snap, state.request, build_policy("gpupool", PROFILE))
    assert isinstance(d, Placement) and d.gpu_milli in (250, 500)
