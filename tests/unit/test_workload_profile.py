"""FGD's workload profile learnt from the pods seen (placement/workload.py)."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, NodeSpec
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import WorkloadProfile, cluster_fragmentation_milli
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.workload import (
    PRIOR_CLASSES,
    PRIOR_CPU_PER_GPU_MILLI,
    PRIOR_MEM_PER_GPU_MILLI,
    GpuMemorySizes,
    RollingProfile,
    default_prior,
    forget_profile,
    memory_share_milli,
    typical_gpu_memory_mib,
)
from gpupool_sched.simulate.replay import replay
from gpupool_sched.simulate.trace import read_trace
from tests.support.clusters import gpu_node, mig_node


def share(i: int, milli: int = 250, cpu: int = 2000) -> PodRequest:
    return PodRequest(name=f"s{i}", cpu_milli=cpu, memory_mib=1024, gpu_count=1, gpu_milli=milli)


def whole(i: int, k: int = 1) -> PodRequest:
    return PodRequest(name=f"w{i}", cpu_milli=8000, memory_mib=4096, gpu_count=k, gpu_milli=1000)


def memshare(i: int, mib: int = 10_240) -> PodRequest:
    return PodRequest(name=f"m{i}", cpu_milli=4000, memory_mib=2048, gpu_count=1, gpu_memory_mib=mib)


def mig(i: int) -> PodRequest:
    return PodRequest(name=f"g{i}", cpu_milli=1000, mig_profile="1g.10gb", mig_count=1)


def shapes(profile: WorkloadProfile) -> dict[tuple[int, int, int], int]:
    return {(c.cpu_milli, c.gpu_milli, c.gpu_count): c.count for c in profile.classes}


# ---- WorkloadProfile.from_requests with memory shares ----------------------------------------


def test_memory_shares_stay_out_without_a_conversion():
    pods = [share(0), whole(1), memshare(2), mig(3)]
    profile = WorkloadProfile.from_requests(pods)
    assert shapes(profile) == {(2000, 250, 1): 1, (8000, 1000, 1): 1}
    assert profile.cpu_per_gpu_milli == pytest.approx((2000 + 8000) / 1250)


def test_memory_shares_enter_as_milli_of_a_typical_gpu():
    pods = [memshare(i) for i in range(3)] + [whole(9), mig(10)]
    profile = WorkloadProfile.from_requests(pods, memory_to_milli=lambda mib: memory_share_milli(mib, 40_960))
    assert shapes(profile) == {(4000, 250, 1): 3, (8000, 1000, 1): 1}  # 10 GiB of 40 GiB; MIG left out
    assert profile.cpu_per_gpu_milli == pytest.approx((3 * 4000 + 8000) / (3 * 250 + 1000))
    assert profile.mem_per_gpu_milli == pytest.approx((3 * 2048 + 4096) / (3 * 250 + 1000))


def test_a_conversion_out_of_range_is_an_error():
    with pytest.raises(ValueError, match=r"expected 1\.\.1000"):
        WorkloadProfile.from_requests([memshare(0)], memory_to_milli=lambda mib: 0)


@pytest.mark.parametrize(
    ("mib", "gpu", "milli"), [(10_240, 40_960, 250), (1, 40_960, 1), (50_000, 40_960, 1000), (20_000, 81_920, 244)]
)
def test_memory_share_milli_rounds_down_and_stays_within_one_gpu(mib, gpu, milli):
    assert memory_share_milli(mib, gpu) == milli


def test_the_typical_gpu_memory_is_the_most_common_size():
    nodes = [gpu_node("a", 8, gpu_mem=81_920), gpu_node("b", 2, gpu_mem=40_960), mig_node("c")]
    assert typical_gpu_memory_mib(nodes) == 81_920
    tie = [gpu_node("a", 2, gpu_mem=24_576), gpu_node("b", 2, gpu_mem=49_152)]
    assert typical_gpu_memory_mib(tie) == 49_152
    migs_only = NodeSpec("m", 1000, 1000, gpus=(GpuSpec(0, "A100", 81_920, mig_enabled=True),))
    assert typical_gpu_memory_mib([migs_only, gpu_node("t", 4, gpu_mem=0)]) == 0


def test_gpu_memory_sizes_follow_node_changes_like_a_full_recount():
    sizes = GpuMemorySizes()
    nodes = {"a": gpu_node("a", 8, gpu_mem=81_920), "b": gpu_node("b", 2, gpu_mem=40_960), "c": mig_node("c")}
    steps = [("a", nodes["a"]), ("b", nodes["b"]), ("c", nodes["c"]),
             ("b", gpu_node("b", 16, gpu_mem=40_960)), ("a", None), ("b", gpu_node("b", 2, gpu_mem=24_576)),
             ("b", None), ("c", None)]
    live: dict = {}
    for name, spec in steps:
        sizes.update(name, spec)
        if spec is None:
            live.pop(name, None)
        else:
            live[name] = spec
        assert sizes.typical() == typical_gpu_memory_mib(live.values()), (name, spec)
    assert sizes.typical() == 0


# ---- RollingProfile ----------------------------------------------------------------------------


def test_the_prior_serves_until_enough_pods_were_seen():
    prior = WorkloadProfile.from_requests([whole(0, 8)])
    rolling = RollingProfile(window=100, prior=prior, min_observations=5, refresh_every=10)
    for i in range(4):
        rolling.observe(share(i))
        assert rolling.profile() is prior and rolling.version == 0
    rolling.observe(share(4))
    assert rolling.version == 1
    assert shapes(rolling.profile()) == {(2000, 250, 1): 5}


def test_without_a_prior_the_default_prior_is_used():
    assert RollingProfile().profile() == default_prior()


def test_the_profile_object_is_stable_between_refreshes():
    rolling = RollingProfile(window=100, min_observations=1, refresh_every=10)
    rolling.observe(share(0))
    first = rolling.profile()
    for i in range(1, 10):
        rolling.observe(whole(i))  # the mix changes, but no refresh is due yet
        assert rolling.profile() is first and rolling.version == 1
    rolling.observe(whole(10))
    assert rolling.version == 2 and rolling.profile() is not first
    assert shapes(rolling.profile())[(8000, 1000, 1)] == 10


def test_an_unchanged_mix_keeps_the_object_and_the_version():
    rolling = RollingProfile(window=10, min_observations=10, refresh_every=5)
    for i in range(10):
        rolling.observe(share(i))
    learnt = rolling.profile()
    for i in range(25):
        rolling.observe(share(100 + i))
    assert rolling.profile() is learnt and rolling.version == 1


def test_old_pods_leave_the_window():
    rolling = RollingProfile(window=20, coverage=1.0, min_observations=20, refresh_every=20)
    for i in range(20):
        rolling.observe(share(i))
    assert set(shapes(rolling.profile())) == {(2000, 250, 1)}
    for i in range(19):
        rolling.observe(whole(i))
    rolling.observe(whole(19))  # the refresh: the window now holds only whole-GPU pods
    assert shapes(rolling.profile()) == {(8000, 1000, 1): 20}
    assert rolling.seen == 40 and rolling.window == 20


def test_memory_shares_are_converted_with_the_typical_gpu_memory():
    rolling = RollingProfile(min_observations=4, typical_gpu_memory_mib=40_960)
    for i in range(3):
        rolling.observe(memshare(i, 20_480))
    rolling.observe(whole(3))
    assert shapes(rolling.profile()) == {(4000, 500, 1): 3, (8000, 1000, 1): 1}
    unknown = RollingProfile(min_observations=4)  # no GPU memory known: memory shares stay out
    for i in range(3):
        unknown.observe(memshare(i, 20_480))
    unknown.observe(whole(3))
    assert shapes(unknown.profile()) == {(8000, 1000, 1): 1}


def test_mig_pods_are_not_task_classes():
    prior = default_prior()
    rolling = RollingProfile(prior=prior, min_observations=3, refresh_every=3, typical_gpu_memory_mib=40_960)
    for i in range(6):
        rolling.observe(mig(i))
    assert rolling.profile() is prior and rolling.version == 0  # nothing to learn from: keep the prior
    for i in range(3):
        rolling.observe(share(i))
    assert shapes(rolling.profile()) == {(2000, 250, 1): 3}


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 0}, {"refresh_every": 0}, {"min_observations": 0}, {"coverage": 0}, {"typical_gpu_memory_mib": -1}],
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        RollingProfile(**kwargs)


def test_the_default_prior_is_the_openb_default_mix_by_gpu_shape():
    """The constants in PRIOR_CLASSES are what their comment says: openb default's GPU shapes covering
    95% of its pods plus the 2/4/8-GPU jobs, each with its median CPU, and the trace's ratios."""
    pods = read_trace().pods
    by_shape: dict[tuple[int, int], list[PodRequest]] = {}
    for p in pods:
        by_shape.setdefault((p.gpu_milli if p.gpu_count else 0, p.gpu_count), []).append(p)
    counts = Counter({shape: len(ps) for shape, ps in by_shape.items()})
    chosen, covered = [], 0
    for shape, n in counts.most_common():
        if covered >= 0.95 * len(pods):
            break
        chosen.append(shape)
        covered += n
    chosen += [(1000, k) for k in (2, 4, 8)]
    expected = {
        (int(statistics.median(p.cpu_milli for p in by_shape[s])), s[0], s[1], counts[s]) for s in chosen
    }
    assert set(PRIOR_CLASSES) == expected
    profile = WorkloadProfile.from_requests(pods)
    assert round(profile.cpu_per_gpu_milli, 2) == PRIOR_CPU_PER_GPU_MILLI
    assert round(profile.mem_per_gpu_milli, 2) == PRIOR_MEM_PER_GPU_MILLI
    prior = default_prior()
    assert all(not c.models for c in prior.classes) and prior.total == sum(n for *_, n in PRIOR_CLASSES)


# ---- caches and the replay -------------------------------------------------------------------


def test_forget_profile_drops_only_that_profiles_caches():
    snap = ClusterSnapshot([gpu_node("a", 4), gpu_node("b", 2)])
    old, new = WorkloadProfile.from_requests([share(0)]), WorkloadProfile.from_requests([whole(0)])
    cluster_fragmentation_milli(snap, old)
    cluster_fragmentation_milli(snap, new)
    before = len(snap.caches)
    assert forget_profile(snap, old) == before // 2
    assert all(entry[0] is new for entry in snap.caches.values())


def test_a_replay_with_a_rolling_profile_rebuilds_the_policy_when_it_changes():
    nodes = [gpu_node(f"n{i}", 4) for i in range(8)]
    arrivals = [share(i, milli=(250, 500)[i % 2]) for i in range(40)] + [whole(100 + i) for i in range(10)]
    rolling = RollingProfile(window=30, min_observations=10, refresh_every=10)
    built: list[WorkloadProfile] = []

    def rebuild(profile: WorkloadProfile):
        built.append(profile)
        return build_policy("fgd", profile)

    trace_profile = WorkloadProfile.from_requests(arrivals)
    result = replay(
        nodes, arrivals, build_policy("fgd", rolling.profile()), trace_profile, rolling=rolling, rebuild=rebuild
    )
    assert len(built) == rolling.version >= 2 and built[-1] is rolling.profile()
    assert rolling.seen == len(arrivals)
    fixed = replay(nodes, arrivals, build_policy("fgd", trace_profile), trace_profile)
    assert int(np.sum(~result.failed)) > 0 and result.total_gpus == fixed.total_gpus == 32


def test_only_the_primary_shape_of_a_multi_shape_pod_counts():
    from gpupool_sched.model.request import GpuShape as gpu_shape
    pod = PodRequest.of_shapes(  # type: ignore[attr-defined]
        "multi",
        [gpu_shape(gpu_count=1, gpu_memory_mib=10_240), gpu_shape(gpu_count=2, gpu_milli=1000)],
        cpu_milli=8000,
        memory_mib=4096,
    )
    assert pod.extra  # the share rides along with the whole GPUs
    profile = WorkloadProfile.from_requests([pod], memory_to_milli=lambda mib: memory_share_milli(mib, 40_960))
    assert shapes(profile) == {(8000, 1000, 2): 1}
    assert profile.cpu_per_gpu_milli == pytest.approx(8000 / 2000)


def test_rolling_profile_follows_the_live_clusters_typical_gpu_memory():
    rolling = RollingProfile()
    rolling.node_changed("a", gpu_node("a", 8, gpu_mem=81_920))
    rolling.node_changed("b", gpu_node("b", 2, gpu_mem=40_960))
    assert rolling.typical_gpu_memory_mib == 81_920
    rolling.node_changed("a", None)
    assert rolling.typical_gpu_memory_mib == 40_960
