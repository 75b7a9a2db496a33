"""The vectorised fragmentation measure against a direct transcription of its definition."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import (
    TaskClass,
    WorkloadProfile,
    cluster_fragmentation_milli,
    fragmentation_model,
    node_fragmentation,
)

MODELS = ("T4", "V100")


def naive_fragment(free: list[int], cpu_free: int, model: str, task: TaskClass) -> int:
    """Definition (FGD, ATC'23): all idle GPU milli when the task cannot run on the node at all,
    else the idle milli of GPUs with less than the task's per-GPU demand."""
    idle = sum(free)
    if task.gpu_milli == 0:
        return idle
    if task.models and model not in task.models:
        return idle
    if cpu_free < task.cpu_milli or sum(1 for g in free if g >= task.gpu_milli) < task.gpu_count:
        return idle
    return sum(g for g in free if g < task.gpu_milli)


def naive_node(free: list[int], cpu_free: int, model: str, profile: WorkloadProfile) -> float:
    return sum(t.count * naive_fragment(free, cpu_free, model, t) for t in profile.classes) / profile.total


task = st.builds(
    TaskClass,
    cpu_milli=st.sampled_from([0, 2000, 8000, 32000]),
    gpu_milli=st.sampled_from([0, 100, 250, 460, 500, 1000]),
    gpu_count=st.integers(1, 4),
    models=st.sampled_from([frozenset(), frozenset({"T4"}), frozenset({"V100"})]),
    count=st.integers(1, 50),
).map(lambda t: t if t.gpu_milli else TaskClass(t.cpu_milli, 0, 0, frozenset(), t.count))
node_state = st.tuples(
    st.sampled_from(MODELS),
    st.lists(st.integers(0, 1000), min_size=0, max_size=8),
    st.integers(0, 64_000),
)


@settings(max_examples=150, deadline=None)
@given(classes=st.lists(task, min_size=1, max_size=6), nodes=st.lists(node_state, min_size=1, max_size=6))
def test_vectorised_fragmentation_equals_the_definition(classes, nodes):
    profile = WorkloadProfile(tuple(classes))
    specs, fills = [], []
    for i, (model, free, cpu_free) in enumerate(nodes):
        specs.append(NodeSpec(f"n{i}", 64_000, 512_000, tuple(GpuSpec(j, model) for j in range(len(free)))))
        fills.append((free, cpu_free))
    snap = ClusterSnapshot(specs)
    for i, (free, cpu_free) in enumerate(fills):
        snap.cpu_free[i] = cpu_free
        snap.free_milli[i, : len(free)] = free
        snap.version[i] += 1
    got = node_fragmentation(snap, profile) / profile.total
    want = [naive_node(free, cpu, model, profile) for (model, free, cpu) in nodes]
    assert np.allclose(got, want)


@settings(max_examples=80, deadline=None)
@given(classes=st.lists(task, min_size=1, max_size=5), state=node_state, take=st.integers(1, 999))
def test_share_delta_equals_recomputing_after_the_placement(classes, state, take):
    profile = WorkloadProfile(tuple(classes))
    model, free, cpu_free = state
    if not free:
        return
    snap = ClusterSnapshot([NodeSpec("n", 64_000, 512_000, tuple(GpuSpec(j, model) for j in range(len(free))))])
    snap.free_milli[0, : len(free)] = free
    snap.cpu_free[0] = cpu_free
    fm = fragmentation_model(snap, profile)
    gpus = np.array([j for j, g in enumerate(free) if g >= take], dtype=np.int64)
    if gpus.size == 0:
        return
    rows = np.zeros_like(gpus)
    after = fm.frag_after_share(snap.free_milli[[0]], np.array([cpu_free - 500]), np.array([0]), take, rows, gpus)
    for value, j in zip(after, gpus, strict=True):
        changed = list(free)
        changed[j] -= take
        assert value / profile.total == naive_node(changed, cpu_free - 500, model, profile)


def test_a_worked_example():
    # one V100 node with GPUs 1000/500/200 milli free and 8 cores; tasks: 1 x whole GPU, share of 400
    profile = WorkloadProfile(
        (TaskClass(4000, 1000, 1, frozenset(), 1), TaskClass(4000, 400, 1, frozenset(), 1)), 0.0, 0.0
    )
    node = NodeSpec("v", 8000, 64_000, tuple(GpuSpec(j, "V100") for j in range(3)))
    snap = ClusterSnapshot([node])
    snap.free_milli[0] = [1000, 500, 200]
    # whole-GPU task: the 500 and 200 are fragments (700); 400-share: only the 200 is (200) -> mean 450
    assert cluster_fragmentation_milli(snap, profile) == 450.0
    pod = PodRequest(name="cpu-hog", cpu_milli=6000)
    snap.assume(pod, Placement(node="v"))
    # 2 cores left: neither task fits any more, all 1700 idle milli are fragments
    assert cluster_fragmentation_milli(snap, profile) == 1700.0


def test_profile_keeps_the_most_frequent_classes_up_to_the_coverage():
    pods = (
        [PodRequest(name=f"a{i}", cpu_milli=1000, gpu_count=1, gpu_milli=500) for i in range(60)]
        + [PodRequest(name=f"b{i}", cpu_milli=2000, gpu_count=1, gpu_milli=1000) for i in range(30)]
        + [PodRequest(name=f"c{i}", cpu_milli=3000) for i in range(10)]
    )
    assert [c.count for c in WorkloadProfile.from_requests(pods, coverage=0.85).classes] == [60, 30]
    full = WorkloadProfile.from_requests(pods, coverage=1.0)
    assert [c.count for c in full.classes] == [60, 30, 10]
    assert full.cpu_per_gpu_milli == (60 * 1000 + 30 * 2000) / (60 * 500 + 30 * 1000)


def test_caches_on_a_snapshot_follow_the_profile_not_its_id():
    snap = ClusterSnapshot([NodeSpec("v", 8000, 64_000, tuple(GpuSpec(j, "V100") for j in range(2)))])
    snap.free_milli[0] = [1000, 300]
    for milli, expected in ((500, 300.0), (200, 0.0), (500, 300.0)):
        profile = WorkloadProfile((TaskClass(1000, milli, 1, frozenset(), 1),))
        assert cluster_fragmentation_milli(snap, profile) == expected
        del profile  # the next profile may reuse the freed object's id


def test_a_copy_carries_per_node_fragmentation_that_stays_right_on_both_sides():
    """`ClusterSnapshot.copy` takes the compiled model and the per-node values along (preemption's copies
    score without recomputing every node): after changes on either side, and a node added to the copy,
    both still answer what a direct computation answers, and the copy worked on the changed rows only."""
    profile = WorkloadProfile((TaskClass(2000, 1000, 1, frozenset(), 3), TaskClass(2000, 400, 1, frozenset({"T4"}), 2)))
    specs = [NodeSpec(f"n{i}", 16_000, 64_000, tuple(GpuSpec(j, MODELS[i % 2]) for j in range(4))) for i in range(6)]
    snap = ClusterSnapshot(specs)
    snap.assume(PodRequest(name="a", cpu_milli=2000, gpu_count=1, gpu_milli=400), Placement("n0", (1,), 400))
    node_fragmentation(snap, profile)  # computed (and cached) before the copy

    def direct(s: ClusterSnapshot) -> np.ndarray:
        return fragmentation_model(s, profile).frag(s.free_milli, s.cpu_free, np.arange(len(s)))

    other = snap.copy()
    worked: list[int] = []
    model = fragmentation_model(other, profile)
    real = model.frag

    def counted(free: np.ndarray, cpu: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        worked.append(len(nodes))
        return real(free, cpu, nodes)

    model.frag = counted  # type: ignore[method-assign]  # the carried model: shared, so counted on both sides
    other.assume(PodRequest(name="b", cpu_milli=9000, gpu_count=2, gpu_milli=1000), Placement("n3", (0, 2), 1000))
    snap.release(PodRequest(name="a", cpu_milli=2000, gpu_count=1, gpu_milli=400), Placement("n0", (1,), 400))
    assert np.array_equal(node_fragmentation(other, profile), real(other.free_milli, other.cpu_free, np.arange(6)))
    assert worked == [1]  # n3 only: the others came with the copy
    assert np.array_equal(node_fragmentation(snap, profile), direct(snap))
    model.frag = real  # type: ignore[method-assign]
    other.upsert_node(NodeSpec("n6", 16_000, 64_000, (GpuSpec(0, "T4"),)))  # a new node set: nothing carried is used
    assert np.array_equal(node_fragmentation(other, profile), direct(other))
