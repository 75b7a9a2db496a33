"""A live snapshot: nodes come, change and go while pods are assumed and released."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool_common.topology import NodeTopology
from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, MigSlice, NodeSpec, UnknownNode
from gpupool_sched.model.constraints import NodeConstraints, Taint, Toleration
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import GpuShape, PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import build_policy
from tests.support.clusters import gpu_node, mig_node

GB = 1024
WHOLE = PodRequest(name="w", cpu_milli=1000, gpu_count=1, gpu_milli=1000)
PROFILE = WorkloadProfile.from_requests(
    [PodRequest(name=f"s{i}", cpu_milli=2000, gpu_count=1, gpu_milli=300) for i in range(3)]
    + [PodRequest(name="w", cpu_milli=8000, gpu_count=2, gpu_milli=1000)]
)


# ---- the two wrong decisions of before ------------------------------------------------------------
def test_whole_gpus_take_each_gpus_own_memory():
    # one 80 GB and one 40 GB GPU: the old code took the first GPU's 80 GB from both
    node = NodeSpec("mixed", 64_000, 256_000, gpus=(GpuSpec(0, "A100", 81_920), GpuSpec(1, "A100", 40_960)))
    snap = ClusterSnapshot([node])
    pod = PodRequest(name="p", gpu_count=2, gpu_milli=1000)
    d = decide(snap, pod, build_policy("best-fit"))
    assert isinstance(d, Placement) and d.gpu_indices == (0, 1)
    snap.assume(pod, d)
    assert snap.gpu_mem_free[0].tolist() == [0, 0]
    snap.release(pod, d)
    assert snap.gpu_mem_free[0].tolist() == [81_920, 40_960]


def test_unhealthy_gpus_take_no_new_pods():
    node = replace(gpu_node("a", 2), gpus=(GpuSpec(0, "A100", 40 * GB), GpuSpec(1, "A100", 40 * GB, healthy=False)))
    sick_mig = replace(mig_node("m"), gpus=tuple(replace(g, healthy=g.index != 0) for g in mig_node("m").gpus))
    snap = ClusterSnapshot([node, sick_mig])
    policy = build_policy("best-fit")
    assert isinstance(decide(snap, PodRequest(name="w2", gpu_count=2, gpu_milli=1000), policy), Unschedulable)
    d = decide(snap, PodRequest(name="w1", gpu_count=1, gpu_milli=1000), policy)
    assert isinstance(d, Placement) and (d.node, d.gpu_indices) == ("a", (0,))
    mig = PodRequest(name="g", mig_profile="1g.10gb", mig_count=1)
    assert isinstance(decide(snap, mig, policy), Unschedulable) and snap.mig_free["1g.10gb"].tolist() == [0, 0]
    before = {k: v.copy() for k, v in vars(snap).items() if isinstance(v, np.ndarray) and k != "version"}
    running = Placement(node="m", mig_devices=("MIG-m-0-b",))  # a pod that ran there before the GPU failed
    snap.assume(mig, running)
    assert snap.mig_taken[1] == {"MIG-m-0-b"} and snap.mig_free["1g.10gb"][1] == 0
    snap.release(mig, running)
    assert all(np.array_equal(getattr(snap, k), v) for k, v in before.items()) and not snap.mig_taken[1]
    assert snap.total_gpu_milli == 4000 and snap.used_gpu_milli() == 0


# ---- node changes --------------------------------------------------------------------------------
def test_added_nodes_are_placed_on_and_ranked_by_name():
    snap = ClusterSnapshot([gpu_node("b", 1), gpu_node("d", 1)])
    snap.upsert_node(gpu_node("a", 1))
    snap.upsert_node(gpu_node("c", 1))
    assert snap.node_names == ("b", "d", "a", "c") and snap.index == {"b": 0, "d": 1, "a": 2, "c": 3}
    assert snap.tie_rank.tolist() == [1, 3, 0, 2]
    assert decide(snap, WHOLE, build_policy("best-fit")).node == "a"  # all tie; "a" comes first by name
    custom = ClusterSnapshot([gpu_node("a", 1), gpu_node("b", 1)], tie_order=["0900-a", "0100-b"])
    custom.upsert_node(gpu_node("c", 1))  # later nodes use their name, after the "0..." keys
    custom.upsert_node(gpu_node("0500", 1))
    assert custom.tie_rank.tolist() == [2, 0, 3, 1]
    custom.remove_node("b")
    assert sorted(custom.tie_rank.tolist()) == [0, 1, 2] and custom.tie_rank[custom.index["0500"]] == 0


def test_upsert_of_a_known_node_replaces_its_spec_and_resets_only_its_allocation():
    snap = ClusterSnapshot([gpu_node("a", 2), gpu_node("b", 2)])
    for node in ("a", "b"):
        snap.assume(WHOLE, Placement(node=node, gpu_indices=(0,), gpu_milli=1000))
    version_b = int(snap.version[1])
    high = int(snap.version.max())
    snap.upsert_node(gpu_node("a", 4, cpu=8000))
    assert len(snap) == 2 and snap.nodes[0].cpu_milli == 8000 and snap.gpu_count.tolist() == [4, 2]
    assert snap.free_milli[0].tolist() == [1000] * 4 and snap.cpu_free[0] == 8000 and snap.pods_free[0] == 110
    assert snap.free_milli[1].tolist()[:2] == [0, 1000] and snap.cpu_free[1] == 63_000  # b untouched
    assert snap.version[0] > high and snap.version[1] == version_b
    assert snap.gpu_slots == 4 and snap.free_milli[1].tolist() == [0, 1000, -1, -1]


def test_removed_nodes_are_gone_from_decisions_messages_and_figures():
    snap = ClusterSnapshot([gpu_node("a", 2), gpu_node("b", 4), gpu_node("c", 1)])
    snap.assume(WHOLE, Placement(node="a", gpu_indices=(1,), gpu_milli=1000))
    snap.remove_node("a")
    assert snap.node_names == ("c", "b") and snap.index == {"c": 0, "b": 1} and len(snap) == 2
    assert snap.total_gpu_milli == 5000 and snap.used_gpu_milli() == 0
    for policy in ("best-fit", "random", "gpupool"):
        d = decide(snap, PodRequest(name="p", gpu_count=2, gpu_milli=1000), build_policy(policy, PROFILE))
        assert isinstance(d, Placement) and d.node == "b"
    d = decide(snap, PodRequest(name="p", gpu_count=8, gpu_milli=1000), build_policy("best-fit"))
    assert isinstance(d, Unschedulable) and d.message == "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    snap.remove_node("b")
    snap.remove_node("c")
    assert len(snap) == 0 and snap.total_gpu_milli == 0
    d = decide(snap, WHOLE, build_policy("best-fit"))
    assert isinstance(d, Unschedulable) and d.message == "0/0 nodes are available: the cluster has no nodes."
    snap.upsert_node(gpu_node("z", 1))
    assert decide(snap, WHOLE, build_policy("gpupool", PROFILE)).node == "z"


def test_unknown_nodes_are_clear_errors():
    snap = ClusterSnapshot([gpu_node("a", 1)])
    version = int(snap.version[0])
    with pytest.raises(UnknownNode, match="node 'x' is not in the cluster snapshot"):
        snap.assume(WHOLE, Placement(node="x", gpu_indices=(0,), gpu_milli=1000))
    with pytest.raises(UnknownNode, match="'x'"):
        snap.release(WHOLE, Placement(node="x", gpu_indices=(0,), gpu_milli=1000))
    with pytest.raises(UnknownNode, match="'x'"):
        snap.remove_node("x")
    with pytest.raises(ValueError, match="has no GPU 3"):
        snap.assume(WHOLE, Placement(node="a", gpu_indices=(3,), gpu_milli=1000))
    mig = PodRequest(name="m", mig_profile="1g.10gb", mig_count=1)
    with pytest.raises(ValueError, match="has no MIG device MIG-nope"):
        snap.assume(mig, Placement(node="a", mig_devices=("MIG-nope",)))
    assert snap.pods_free[0] == 110 and snap.version[0] == version  # nothing applied
    with pytest.raises(ValueError, match="GPU indices must be"):
        snap.upsert_node(NodeSpec("bad", 1, 1, gpus=(GpuSpec(1, "A100"),)))
    assert snap.node_names == ("a",)


def test_new_models_profiles_and_wider_nodes_extend_the_snapshot():
    snap = ClusterSnapshot([gpu_node("a", 2, model="T4")])
    snap.upsert_node(gpu_node("h", 16, model="H100"))
    snap.upsert_node(mig_node("m"))
    assert snap.models == ["T4", "H100", "A100-80GB"] and snap.gpu_slots == 16
    assert snap.mig_total["1g.10gb"].tolist() == [0, 0, 2]
    policy = build_policy("best-fit")
    d = decide(snap, PodRequest(name="p", gpu_count=12, gpu_milli=1000, gpu_models=frozenset({"H100"})), policy)
    assert isinstance(d, Placement) and d.node == "h" and d.gpu_indices == tuple(range(12))
    d = decide(snap, PodRequest(name="q", mig_profile="3g.40gb", mig_count=1), policy)
    assert isinstance(d, Placement) and d.mig_devices == ("MIG-m-0-a",)
    assert snap.free_milli[0].tolist() == [1000, 1000] + [-1] * 14


def test_growth_keeps_rows_and_reallocates_rarely():
    snap = ClusterSnapshot([gpu_node("n000", 1)])
    buffers = set()
    for i in range(1, 300):
        snap.upsert_node(gpu_node(f"n{i:03d}", 1 + i % 3, cpu=1000 + i))
        snap.assume(WHOLE, Placement(node=f"n{i:03d}", gpu_indices=(0,), gpu_milli=1000))
        buffers.add(id(snap.cpu_free.base))
    assert len(buffers) <= 6  # capacity doubles: 16, 32, ..., 512
    assert snap.cpu_total.tolist() == [64_000] + [1000 + i for i in range(1, 300)]
    assert snap.cpu_free.tolist() == [64_000] + [i for i in range(1, 300)]
    assert snap.tie_rank.tolist() == list(range(300))


def test_node_changes_drop_derived_caches_and_never_reuse_versions():
    snap = ClusterSnapshot([gpu_node("a", 2), gpu_node("b", 2), gpu_node("c", 2)])
    policy = build_policy("gpupool", PROFILE)
    share = PodRequest(name="s", cpu_milli=2000, gpu_count=1, gpu_milli=300)
    placed = [Placement(node="c", gpu_indices=(1,), gpu_milli=300)]
    snap.assume(share, placed[0])
    for _ in range(4):
        d = decide(snap, share, policy)
        snap.assume(share, d)
        placed.append(d)
    assert snap.caches
    old_versions = set(snap.version.tolist())
    version_b, generation = int(snap.version[1]), snap.generation
    snap.remove_node("a")  # c moves into row 0: a FGD memo entry for row 0 must not be reused
    assert not snap.caches and snap.generation == generation + 1
    assert snap.index["c"] == 0 and int(snap.version[0]) not in old_versions and snap.version[1] == version_b
    fresh = ClusterSnapshot([gpu_node("b", 2), gpu_node("c", 2)])
    for d in placed:
        if d.node != "a":
            fresh.assume(share, d)
    for _ in range(3):
        ours, theirs = decide(snap, share, policy), decide(fresh, share, policy)
        assert (ours.node, ours.gpu_indices, ours.score) == (theirs.node, theirs.gpu_indices, theirs.score)
        snap.assume(share, ours)
        fresh.assume(share, theirs)


def test_copy_is_independent_of_node_changes():
    snap = ClusterSnapshot([gpu_node("a", 1), gpu_node("b", 1)])
    other = snap.copy()
    other.remove_node("a")
    other.upsert_node(gpu_node("c", 2, model="H100"))
    other.assume(WHOLE, Placement(node="b", gpu_indices=(0,), gpu_milli=1000))
    assert snap.node_names == ("a", "b") and snap.models == ["A100"] and snap.free_milli[:, 0].tolist() == [1000] * 2
    assert other.node_names == ("b", "c") and other.free_milli[0, 0] == 0


# ---- random sequences against a snapshot built from scratch ---------------------------------------
TOPO4 = NodeTopology.from_links([0, 0, 1, 1], [(0, 1, 4, "NODE"), (2, 3, 4, "NODE")])


def _mixed_mig(name: str) -> NodeSpec:
    a = tuple(MigSlice(f"MIG-{name}-0-{k}", "1g.10gb", 0) for k in range(3))
    h = (MigSlice(f"MIG-{name}-1-0", "1g.10gb", 1), MigSlice(f"MIG-{name}-1-1", "2g.20gb", 1))
    return NodeSpec(
        name,
        cpu_milli=32_000,
        memory_mib=128_000,
        gpus=(
            GpuSpec(0, "A100", 40 * GB, mig_enabled=True, mig_slices=a),
            GpuSpec(1, "H100", 80 * GB, mig_enabled=True, mig_slices=h),
            GpuSpec(2, "H100", 80 * GB),
        ),
    )


def spec_variants(name: str) -> list[NodeSpec]:
    """What a node of this name may look like (upserts pick among these)."""
    return [
        gpu_node(name, 2, cpu=16_000),
        gpu_node(name, 4, model="H100", gpu_mem=80 * GB),
        replace(gpu_node(name, 4), topology=TOPO4, labels={"zone": "a"}),
        replace(gpu_node(name, 1, model="T4", gpu_mem=16 * GB), taints=(Taint("spot", "yes"),)),
        replace(gpu_node(name, 8, cpu=96_000), unschedulable=True),
        mig_node(name),
        _mixed_mig(name),
        NodeSpec(name, cpu_milli=8000, memory_mib=16_000, labels={"zone": "b"}),
        NodeSpec(
            name, 64_000, 256_000, gpus=(GpuSpec(0, "A100", 80 * GB), GpuSpec(1, "A100", 40 * GB), GpuSpec(2, "L4", 0))
        ),
    ]


TOLERANT = NodeConstraints(tolerations=(Toleration(operator="Exists"),))
PODS = [
    PodRequest(name="cpu", cpu_milli=3000, memory_mib=1000),
    PodRequest(name="milli", cpu_milli=1000, gpu_count=1, gpu_milli=300),
    PodRequest(name="mem", cpu_milli=1000, gpu_count=1, gpu_memory_mib=12 * GB),
    PodRequest(name="w1", cpu_milli=2000, gpu_count=1, gpu_milli=1000, constraints=TOLERANT),
    PodRequest(name="w2", cpu_milli=4000, gpu_count=2, gpu_milli=1000),
    PodRequest(name="mig", mig_profile="1g.10gb", mig_count=2, gpu_models=frozenset({"A100"})),
    PodRequest.of_shapes("w+mem", [GpuShape(2, 1000), GpuShape(1, gpu_memory_mib=30 * GB)], cpu_milli=500),
    PodRequest.of_shapes("w+mig", [GpuShape(1, 1000), GpuShape(mig_profile="1g.10gb", mig_count=1)]),
    PodRequest.of_shapes(
        "mig+mig", [GpuShape(mig_profile="2g.20gb", mig_count=1), GpuShape(mig_profile="1g.10gb", mig_count=1)]
    ),
    PodRequest(name="zone-a", cpu_milli=100, gpu_count=1, gpu_milli=500, constraints=NodeConstraints((("zone", "a"),))),
]
PROBES = [*PODS, PodRequest(name="huge", gpu_count=16, gpu_milli=1000)]


def canonical(snap: ClusterSnapshot) -> dict[str, object]:
    """Everything a snapshot says about each node, by name (row numbers and model ids aside)."""
    assert len(snap.node_names) == len(snap) == len(snap.index) == len(snap.nodes)
    assert sorted(snap.tie_rank.tolist()) == list(range(len(snap)))
    out: dict[str, object] = {}
    for i, name in enumerate(snap.node_names):
        assert snap.index[name] == i and snap.nodes[i].name == name
        spec, g = snap.nodes[i], int(snap.gpu_count[i])
        assert g == len(spec.gpus)
        assert (snap.free_milli[i, g:] == -1).all() and not snap.gpu_usable[i, g:].any()
        assert (snap.gpu_mem_free[i, g:] == 0).all() and (snap.gpu_model[i, g:] == -1).all()
        pairs = {(s.profile, gpu.model) for gpu in spec.gpus for s in gpu.mig_slices}
        out[name] = (
            spec,
            int(snap.cpu_total[i]),
            int(snap.cpu_free[i]),
            int(snap.mem_total[i]),
            int(snap.mem_free[i]),
            int(snap.pods_total[i]),
            int(snap.pods_free[i]),
            snap.free_milli[i, :g].tolist(),
            snap.gpu_mem_free[i, :g].tolist(),
            snap.gpu_mem_total[i, :g].tolist(),
            snap.gpu_usable[i, :g].tolist(),
            [snap.models[m] for m in snap.gpu_model[i, :g]],
            {p: (int(snap.mig_total[p][i]), int(snap.mig_free[p][i])) for p, _ in pairs},
            {pm: int(snap.mig_free_by_model[pm][i]) for pm in pairs},
            frozenset(snap.mig_taken[i]),
            dict(snap.gpu_tags[i]),
            snap.signatures[int(snap.node_signature[i])],
        )
    out["#tie-order"] = [snap.node_names[i] for i in np.argsort(snap.tie_rank)]
    out["#totals"] = (snap.total_gpu_milli, snap.used_gpu_milli(), snap.tainted_nodes, snap.cordoned_nodes)
    return out


def outcome(d: Placement | Unschedulable) -> object:
    if isinstance(d, Unschedulable):
        return d.message, d.node_reasons
    return (d.node, d.gpu_indices, d.gpu_milli, d.gpu_memory_mib, d.mig_devices, d.score, d.extras)


def rebuilt(specs: dict[str, NodeSpec], pods: list[tuple[PodRequest, Placement]]) -> ClusterSnapshot:
    """A snapshot built from scratch from the surviving nodes, with the surviving pods assumed."""
    fresh = ClusterSnapshot(sorted(specs.values(), key=lambda s: s.name))
    for pod, d in pods:
        fresh.assume(pod, d)
    return fresh


OPS = st.lists(
    st.tuples(st.sampled_from(["assume"] * 4 + ["release", "add", "upsert", "remove"]), st.integers(0, 10**6)),
    min_size=5,
    max_size=40,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(initial=st.lists(st.integers(0, 8), min_size=1, max_size=5), ops=OPS)
def test_random_node_and_pod_changes_match_a_snapshot_built_from_scratch(initial, ops):
    names = iter(f"node-{k:03d}" for k in range(1000))
    specs = {}
    for v in initial:
        name = next(names)
        specs[name] = spec_variants(name)[v]
    snap = ClusterSnapshot(list(specs.values()))
    policies = [build_policy("best-fit"), build_policy("gpupool", PROFILE)]
    pods: list[tuple[PodRequest, Placement]] = []  # in the order assumed
    fresh = rebuilt(specs, pods)
    for op, r in ops:
        if op == "assume":
            pod = PODS[r % len(PODS)]
            d = decide(snap, pod, policies[r % 2], np.random.default_rng(r))
            if isinstance(d, Placement):
                snap.assume(pod, d)
                pods.append((pod, d))
        elif op == "release" and pods:
            pod, d = pods.pop(r % len(pods))
            snap.release(pod, d)
        elif op == "add":
            name = next(names)
            specs[name] = spec_variants(name)[r % 9]
            snap.upsert_node(specs[name])
        elif op == "upsert" and specs:
            name = sorted(specs)[r % len(specs)]
            old, new = specs[name], spec_variants(name)[(r // 7) % 9]
            specs[name] = new
            snap.upsert_node(new)
            kept = [(p, d) for p, d in pods if d.node != name]
            if new.gpus == old.gpus:  # the caller re-applies the pods it knows there
                for p, d in pods:
                    if d.node == name:
                        snap.assume(p, d)
                        kept.append((p, d))
            pods = kept
        elif op == "remove" and specs:
            name = sorted(specs)[r % len(specs)]
            del specs[name]
            snap.remove_node(name)
            pods = [(p, d) for p, d in pods if d.node != name]
        fresh = rebuilt(specs, pods)
        assert canonical(snap) == canonical(fresh), (op, r)

    for probe in PROBES:
        for policy in policies:
            ours = decide(snap, probe, policy, np.random.default_rng(0))
            theirs = decide(fresh, probe, policy, np.random.default_rng(0))
            assert outcome(ours) == outcome(theirs), (probe.name, policy.name)
    for pod, d in reversed(pods):  # releasing everything empties the live snapshot
        snap.release(pod, d)
    empty = ClusterSnapshot(sorted(specs.values(), key=lambda s: s.name))
    assert canonical(snap) == canonical(empty)


# ---- fits: exact devices, as a reservation holds them ---------------------------------------------------
def test_fits_says_whether_exact_devices_take_a_pod_and_changes_nothing():
    node = NodeSpec("n", 16_000, 64_000, gpus=(GpuSpec(0, "L40S", 45_056), GpuSpec(1, "L40S", 45_056)))
    snap = ClusterSnapshot([node])
    share = PodRequest(name="s", cpu_milli=1000, gpu_count=1, gpu_memory_mib=30 * GB)
    on = [Placement("n", (j,), 0, 30 * GB) for j in (0, 1)]
    assert snap.fits(share, on[0]) and snap.fits(share, on[1])
    snap.assume(share, on[0])
    before = (snap.gpu_mem_free.copy(), snap.cpu_free.copy(), snap.pods_free.copy())
    assert not snap.fits(share, on[0])  # 15 GB left on GPU 0
    assert snap.fits(share, on[1])
    assert not snap.fits(share, Placement("n", (7,), 0, 30 * GB))  # no such GPU
    assert not snap.fits(share, Placement("elsewhere", (0,), 0, 30 * GB))  # no such node
    assert not snap.fits(replace(share, cpu_milli=20_000), on[1])  # not the node's CPU
    after = (snap.gpu_mem_free, snap.cpu_free, snap.pods_free)
    assert all((a == b).all() for a, b in zip(before, after, strict=True))


def test_fits_refuses_a_mig_device_taken():
    snap = ClusterSnapshot([mig_node("m")])
    slice_pod = PodRequest(name="g", mig_profile="1g.10gb", mig_count=1)
    at = Placement("m", mig_devices=("MIG-m-0-b",))
    assert snap.fits(slice_pod, at)
    snap.assume(slice_pod, at)
    assert not snap.fits(slice_pod, at)
    assert snap.fits(slice_pod, Placement("m", mig_devices=("MIG-m-0-c",)))
