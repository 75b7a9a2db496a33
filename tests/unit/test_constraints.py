"""Node constraints: Kubernetes semantics of selectors, affinity, taints, tolerations and cordons,
and the filters that apply them (evaluated per node signature, cached, free when unused)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.constraints import NodeConstraints, Requirement, Taint, Toleration
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import InvalidRequest, PodRequest
from gpupool_sched.placement import nodeaffinity
from gpupool_sched.placement.decide import decide, feasible_nodes
from gpupool_sched.placement.framework import CycleState
from gpupool_sched.placement.nodeaffinity import NodeAffinity, NodeUnschedulable, TaintToleration
from gpupool_sched.placement.registry import build_policy
from tests.support.clusters import gpu_node

LABELS = {"zone": "a", "gpu-gen": "9", "pool": "train"}


def req(key: str, op: str, *values: str) -> Requirement:
    return Requirement(key, op, values)


@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        (req("zone", "In", "a", "b"), True),
        (req("zone", "In", "b"), False),
        (req("missing", "In", "a"), False),
        (req("zone", "NotIn", "b"), True),
        (req("zone", "NotIn", "a"), False),
        (req("missing", "NotIn", "a"), True),
        (req("pool", "Exists"), True),
        (req("missing", "Exists"), False),
        (req("missing", "DoesNotExist"), True),
        (req("pool", "DoesNotExist"), False),
        (req("gpu-gen", "Gt", "8"), True),
        (req("gpu-gen", "Gt", "9"), False),
        (req("gpu-gen", "Lt", "10"), True),
        (req("gpu-gen", "Lt", "9"), False),
        (req("pool", "Gt", "1"), False),  # not an integer label: no match
        (req("missing", "Lt", "100"), False),
        (req("metadata.name", "In", "n1", "n2"), True),
        (req("metadata.name", "NotIn", "n1"), False),
        (req("metadata.name", "NotIn", "other"), True),
    ],
)
def test_requirement_operators(requirement, expected):
    assert requirement.matches("n1", LABELS) is expected


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("zone", "Equals", ("a",)), "unknown operator 'Equals'"),
        (("zone", "In", ()), "In needs at least one value"),
        (("zone", "Exists", ("a",)), "Exists takes no values"),
        (("zone", "Gt", ("1", "2")), "exactly one integer"),
        (("zone", "Lt", ("x",)), "exactly one integer"),
        (("metadata.name", "Exists", ()), "only In and NotIn"),
        (("", "Exists", ()), "key is empty"),
    ],
)
def test_bad_requirements_are_rejected(args, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        Requirement(*args)


def test_bad_taints_and_tolerations_are_rejected():
    with pytest.raises(InvalidRequest, match="unknown effect"):
        Taint("k", effect="NoWay")
    with pytest.raises(InvalidRequest, match="Equal or Exists"):
        Toleration("k", operator="Gt")
    with pytest.raises(InvalidRequest, match="Exists takes no value"):
        Toleration("k", operator="Exists", value="v")
    with pytest.raises(InvalidRequest, match="empty key needs operator Exists"):
        Toleration("", operator="Equal", value="v")
    with pytest.raises(InvalidRequest, match="not a Requirement"):
        NodeConstraints(affinity_terms=(("zone",),))  # type: ignore[arg-type]


def test_selector_and_affinity_terms():
    c = NodeConstraints(
        node_selector=(("pool", "train"),),
        affinity_terms=((req("zone", "In", "b"),), (req("gpu-gen", "Gt", "8"), req("zone", "Exists"))),
    )
    assert c.matches("n", LABELS)  # second term matches
    assert not c.matches("n", {**LABELS, "pool": "infer"})  # selector fails
    assert not c.matches("n", {"pool": "train", "zone": "a", "gpu-gen": "7"})  # no term matches
    assert NodeConstraints(node_selector=(("pool", "train"),)).matches("n", LABELS)
    assert not NodeConstraints(affinity_terms=((),)).matches("n", LABELS)  # an empty term matches nothing
    assert NodeConstraints(node_selector={"zone": "a"}).node_selector == (("zone", "a"),)  # type: ignore[arg-type]


def test_tolerations():
    no_sched, no_exec = Taint("gpu", "true", "NoSchedule"), Taint("maint", "", "NoExecute")
    prefer = Taint("spot", "yes", "PreferNoSchedule")
    taints = (prefer, no_sched, no_exec)
    assert NodeConstraints().untolerated(taints) == no_sched  # PreferNoSchedule never blocks
    assert NodeConstraints().untolerated((prefer,)) is None
    everything = NodeConstraints(tolerations=(Toleration(operator="Exists"),))
    assert everything.untolerated(taints) is None
    equal = NodeConstraints(tolerations=(Toleration("gpu", "Equal", "true", "NoSchedule"),))
    assert equal.untolerated(taints) == no_exec
    wrong_value = NodeConstraints(tolerations=(Toleration("gpu", "Equal", "false"),))
    assert wrong_value.untolerated((no_sched,)) == no_sched
    any_effect = NodeConstraints(tolerations=(Toleration("gpu", "Equal", "true"), Toleration("maint", "Exists")))
    assert any_effect.untolerated(taints) is None
    wrong_effect = NodeConstraints(tolerations=(Toleration("maint", "Exists", effect="NoSchedule"),))
    assert wrong_effect.untolerated((no_exec,)) == no_exec
    key_any_value = NodeConstraints(tolerations=(Toleration("gpu", "Exists"),))
    assert key_any_value.untolerated((Taint("gpu", "whatever"),)) is None


def labelled(name: str, labels: dict[str, str], **kw) -> NodeSpec:
    return replace(gpu_node(name, 2), labels=labels, **kw)


def cluster() -> ClusterSnapshot:
    return ClusterSnapshot(
        [
            labelled("a", {"zone": "a"}),
            labelled("b", {"zone": "b"}),
            labelled("c", {"zone": "a"}, taints=(Taint("dedicated", "infer"),)),
            labelled("d", {"zone": "a"}, unschedulable=True),
        ]
    )


def pod(constraints: NodeConstraints | None = None, name: str = "p") -> PodRequest:
    return PodRequest(name=name, cpu_milli=1000, gpu_count=1, gpu_milli=1000, constraints=constraints)


def test_filters_reject_with_kube_scheduler_reasons_in_kube_scheduler_order():
    snap = cluster()
    c = NodeConstraints(node_selector=(("zone", "b"),))
    d = decide(snap, pod(c), build_policy("best-fit"))
    assert isinstance(d, Placement) and d.node == "b"
    d = decide(snap, pod(NodeConstraints(node_selector=(("zone", "c"),))), build_policy("best-fit"))
    assert isinstance(d, Unschedulable)
    # the cordoned node fails NodeUnschedulable first, though its labels do not match either
    assert d.node_reasons == {
        "a": "node(s) didn't match Pod's node affinity/selector",
        "b": "node(s) didn't match Pod's node affinity/selector",
        "c": "node(s) didn't match Pod's node affinity/selector",
        "d": "node(s) were unschedulable",
    }
    assert d.message == (
        "0/4 nodes are available: 3 node(s) didn't match Pod's node affinity/selector, 1 node(s) were unschedulable."
    )


def test_taints_and_cordons_keep_pods_off_unless_tolerated():
    snap = cluster()
    zone_a = NodeConstraints(node_selector=(("zone", "a"),))
    policy = build_policy("best-fit")
    snap.assume(pod(name="x"), Placement(node="a", gpu_indices=(0, 1), gpu_milli=1000))  # a is full
    d = decide(snap, pod(zone_a), policy)
    assert isinstance(d, Unschedulable)
    assert d.node_reasons["c"] == "node(s) had untolerated taint(s)"
    assert d.node_reasons["d"] == "node(s) were unschedulable"
    tolerant = replace(zone_a, tolerations=(Toleration("dedicated", "Equal", "infer", "NoSchedule"),))
    assert decide(snap, pod(tolerant), policy).node == "c"
    cordon_ok = replace(zone_a, tolerations=(Toleration("node.kubernetes.io/unschedulable", "Exists"),))
    assert decide(snap, pod(cordon_ok), policy).node == "d"
    everything = replace(zone_a, tolerations=(Toleration(operator="Exists"),))
    assert decide(snap, pod(everything), policy).node in {"c", "d"}


def test_match_fields_on_the_node_name():
    snap = cluster()
    policy = build_policy("best-fit")
    only_b = NodeConstraints(affinity_terms=((req("metadata.name", "In", "b", "gone"),),))
    assert decide(snap, pod(only_b), policy).node == "b"
    not_a = NodeConstraints(affinity_terms=((req("metadata.name", "NotIn", "a"), req("zone", "In", "a")),))
    d = decide(snap, pod(not_a), policy)
    assert isinstance(d, Unschedulable)  # c is tainted, d cordoned, a excluded by name, b by label
    assert d.reason_counts["node(s) didn't match Pod's node affinity/selector"] == 2
    either = NodeConstraints(affinity_terms=((req("metadata.name", "In", "a"),), (req("zone", "In", "b"),)))
    mask = nodeaffinity.affinity_mask(snap, either)
    assert mask.tolist() == [True, True, False, False]


def test_constraints_are_evaluated_once_per_node_signature_and_cached(monkeypatch):
    nodes = [labelled(f"n{i:04d}", {"zone": "ab"[i % 2]}) for i in range(1000)]
    snap = ClusterSnapshot(nodes)
    calls = []
    original = Requirement.matches

    def counting(self, name, labels):
        calls.append(name)
        return original(self, name, labels)

    monkeypatch.setattr(Requirement, "matches", counting)
    c = NodeConstraints(affinity_terms=((req("zone", "In", "a"),),))
    state = CycleState(snap, pod(c), None)
    first = NodeAffinity().passes(state)
    assert int(first.sum()) == 500 and len(calls) == 2  # two signatures
    assert NodeAffinity().passes(CycleState(snap, pod(c, "q"), None)) is first and len(calls) == 2
    # a new node with a known signature costs no evaluation; a new signature one
    snap.upsert_node(labelled("new-1", {"zone": "a"}))
    snap.upsert_node(labelled("new-2", {"zone": "c"}))
    mask = NodeAffinity().passes(CycleState(snap, pod(c), None))
    assert len(calls) == 3 and mask.size == 1002 and mask[snap.index["new-1"]] and not mask[snap.index["new-2"]]


def test_relabelled_or_removed_nodes_never_use_stale_masks():
    snap = cluster()
    policy = build_policy("best-fit")
    zone_b = NodeConstraints(node_selector=(("zone", "b"),))
    assert decide(snap, pod(zone_b), policy).node == "b"
    snap.upsert_node(labelled("b", {"zone": "x"}))
    snap.upsert_node(labelled("a", {"zone": "b"}))
    assert decide(snap, pod(zone_b), policy).node == "a"
    snap.remove_node("a")
    d = decide(snap, pod(zone_b), policy)
    assert isinstance(d, Unschedulable) and d.message.startswith("0/3 nodes are available")
    snap.upsert_node(replace(labelled("d", {"zone": "b"}), unschedulable=False))
    assert decide(snap, pod(zone_b), policy).node == "d"
    assert snap.cordoned_nodes == 0 and snap.tainted_nodes == 1


def test_an_unconstrained_pod_on_an_untainted_cluster_skips_the_constraint_filters(monkeypatch):
    snap = ClusterSnapshot([gpu_node("a", 1), gpu_node("b", 1)])

    def boom(self, state):
        raise AssertionError(f"{self.name} evaluated")

    for cls in (NodeUnschedulable, NodeAffinity, TaintToleration):
        monkeypatch.setattr(cls, "passes", boom)
    policy = build_policy("best-fit")
    ok, _ = feasible_nodes(CycleState(snap, pod(), None), policy)
    assert ok.tolist() == [0, 1]
    tolerations_only = NodeConstraints(tolerations=(Toleration(operator="Exists"),))
    ok, _ = feasible_nodes(CycleState(snap, pod(tolerations_only), None), policy)
    assert ok.tolist() == [0, 1]


def test_untolerated_taint_rejects_pods_without_constraints():
    snap = ClusterSnapshot([gpu_node("a", 1), replace(gpu_node("b", 1), taints=(Taint("x", effect="NoExecute"),))])
    state = CycleState(snap, pod(), None)
    assert TaintToleration().applies_to(state) and not NodeUnschedulable().applies_to(state)
    ok, fails = feasible_nodes(state, build_policy("best-fit"))
    assert ok.tolist() == [0] and fails is not None
    soft = ClusterSnapshot([replace(gpu_node("b", 1), taints=(Taint("x", effect="PreferNoSchedule"),))])
    assert not TaintToleration().applies_to(CycleState(soft, pod(), None))
    assert isinstance(decide(soft, pod(), build_policy("best-fit")), Placement)


def test_cached_masks_are_read_only():
    snap = cluster()
    mask = nodeaffinity.affinity_mask(snap, NodeConstraints(node_selector=(("zone", "a"),)))
    with pytest.raises(ValueError):
        mask[0] = False
    assert np.array_equal(mask, [True, False, True, True])
