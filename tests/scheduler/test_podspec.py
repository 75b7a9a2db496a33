"""plan_pod: a pod's JSON -> PodPlan, every error, and garbage in (hypothesis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool_sched.kube.podspec import (
    ClusterFacts,
    ContainerDemand,
    InvalidPod,
    PodPlan,
    plan_pod,
    pod_revision,
)
from gpupool_sched.model.constraints import NodeConstraints, Requirement, Toleration
from gpupool_sched.model.request import GpuShape, WorkloadKind

H100 = "NVIDIA-H100-80GB-HBM3"
A100_80 = "NVIDIA-A100-SXM4-80GB"
A100_40 = "NVIDIA-A100-SXM4-40GB"
L40S = "NVIDIA-L40S"
FACTS = ClusterFacts(1024, frozenset({H100, A100_80, A100_40, L40S}), frozenset({"1g.10gb", "3g.40gb"}), 79)


def ctr(name: str, limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None,
        **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": name, "image": "x", "resources": resources, **extra}


def sidecar(name: str, limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None) -> dict[str, Any]:
    return ctr(name, limits, requests, restartPolicy="Always")


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), annotations: dict[str, Any] | None = None,
        **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1", "creationTimestamp": "2026-01-02T03:04:05Z",
                     "annotations": annotations or {}},
        "spec": {"schedulerName": "gpupool", "containers": list(containers), "initContainers": list(init), **spec},
    }


def invalid(obj: Any, facts: ClusterFacts = FACTS, classes: dict[str, int] | None = None, *,
            strict: bool = True) -> InvalidPod:
    with pytest.raises(InvalidPod) as info:
        plan_pod(obj, facts, classes, strict=strict)
    return info.value


# ---- identity ------------------------------------------------------------------------------------


def test_identity_fields():
    plan = plan_pod(pod(ctr("a")), FACTS)
    assert (plan.uid, plan.namespace, plan.name, plan.key) == ("uid-1", "ns", "p", "ns/p")
    assert plan.created == 1767323045.0
    assert plan.memory_unit_mib == 1024
    assert plan.request.name == "p" and plan.request.namespace == "ns"
    assert plan.containers == (ContainerDemand("a", False, False),)


@pytest.mark.parametrize("obj", [None, [], "pod", {"metadata": {}}, {"spec": {}},
                                 {"metadata": {"name": "p"}, "spec": {}},
                                 {"metadata": {"name": "p", "uid": 5}, "spec": {}},
                                 {"metadata": {"name": "", "uid": "u"}, "spec": {}},
                                 {"metadata": {"name": "p", "uid": "u", "namespace": 3}, "spec": {}},
                                 {"metadata": {"name": "p", "uid": "u"}, "spec": []}])
@pytest.mark.parametrize("strict", [True, False])
def test_not_a_pod(obj, strict):
    exc = invalid(obj, strict=strict)
    assert exc.permanent and str(exc).startswith("not a pod")


def test_unreadable_timestamp_is_zero():
    obj = pod(ctr("a"))
    obj["metadata"]["creationTimestamp"] = "yesterday"
    assert plan_pod(obj, FACTS).created == 0.0


# ---- CPU and memory ------------------------------------------------------------------------------


def test_requests_default_to_limits_per_resource():
    plan = plan_pod(pod(ctr("a", limits={"cpu": "2", "memory": "4Gi"}, requests={"cpu": "500m"})), FACTS)
    assert (plan.request.cpu_milli, plan.request.memory_mib) == (500, 4096)


@pytest.mark.parametrize(("cpu", "milli"), [("1", 1000), ("0.1", 100), ("1m", 1), ("1.0001", 1001), (2, 2000),
                                            (0.25, 250), ("1k", 1_000_000)])
def test_cpu_quantities_round_up_to_milli(cpu, milli):
    assert plan_pod(pod(ctr("a", requests={"cpu": cpu})), FACTS).request.cpu_milli == milli


@pytest.mark.parametrize(("mem", "mib"), [("1Gi", 1024), ("1.5Mi", 2), ("100M", 96), ("1", 1), ("0", 0),
                                          ("2Ti", 2 * 1024 * 1024)])
def test_memory_quantities_round_up_to_mib(mem, mib):
    assert plan_pod(pod(ctr("a", requests={"memory": mem})), FACTS).request.memory_mib == mib


def test_app_containers_add_up_and_init_containers_take_the_max():
    p = pod(ctr("a", requests={"cpu": "1", "memory": "1Gi"}), ctr("b", requests={"cpu": "2", "memory": "1Gi"}),
            init=(ctr("i", requests={"cpu": "4", "memory": "512Mi"}),))
    plan = plan_pod(p, FACTS)
    assert (plan.request.cpu_milli, plan.request.memory_mib) == (4000, 2048)


@pytest.mark.parametrize(
    ("init", "app_cpu", "expected"),
    [
        # KEP-753: sidecars add to the app sum; a later init container runs beside the earlier sidecars
        ((sidecar("s", requests={"cpu": "1"}), ctr("i", requests={"cpu": "2"})), "3", 4000),
        ((sidecar("s", requests={"cpu": "1"}), ctr("i", requests={"cpu": "5"})), "1", 6000),
        ((ctr("i", requests={"cpu": "5"}), sidecar("s", requests={"cpu": "1"})), "1", 5000),
        ((sidecar("s1", requests={"cpu": "1"}), sidecar("s2", requests={"cpu": "2"}),
          ctr("i", requests={"cpu": "1"})), "1", 4000),
    ],
)
def test_sidecar_accounting_matches_kubernetes(init, app_cpu, expected):
    plan = plan_pod(pod(ctr("a", requests={"cpu": app_cpu}), init=init), FACTS)
    assert plan.request.cpu_milli == expected


def test_overhead_is_added():
    p = pod(ctr("a", requests={"cpu": "1", "memory": "1Gi"}), overhead={"cpu": "250m", "memory": "120Mi"})
    plan = plan_pod(p, FACTS)
    assert (plan.request.cpu_milli, plan.request.memory_mib) == (1250, 1144)


def test_pod_level_resources_replace_the_container_sum():
    p = pod(ctr("a", requests={"cpu": "1", "memory": "1Gi"}), resources={"limits": {"cpu": "3"}},
            overhead={"cpu": "100m"})
    plan = plan_pod(p, FACTS)
    assert (plan.request.cpu_milli, plan.request.memory_mib) == (3100, 1024)


@pytest.mark.parametrize("value", ["12x", "abc", "", True, [1], {"a": 1}, "NaN", "-1", "Infinity", b"1",
                                   "1e999999999", "9" * 30])
def test_malformed_quantity_is_permanent(value):
    exc = invalid(pod(ctr("app", requests={"cpu": value})))
    assert exc.permanent
    assert "container 'app'" in str(exc) and "cpu" in str(exc)


def test_malformed_quantity_is_zero_when_not_strict():
    plan = plan_pod(pod(ctr("app", requests={"cpu": "12x", "memory": "1Gi"})), FACTS, strict=False)
    assert (plan.request.cpu_milli, plan.request.memory_mib) == (0, 1024)


# ---- GPU demand ----------------------------------------------------------------------------------


def test_whole_gpus_add_up_over_app_and_sidecar_containers():
    p = pod(ctr("a", limits={"nvidia.com/gpu": "2"}), ctr("b", limits={"nvidia.com/gpu": 1}),
            init=(sidecar("s", limits={"nvidia.com/gpu": "1"}),))
    plan = plan_pod(p, FACTS)
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=4, gpu_milli=1000),)
    assert plan.request.kind == WorkloadKind.TRAINING
    assert [c.gpus for c in plan.containers] == [1, 2, 1]
    assert plan.containers[0] == ContainerDemand("s", True, True, gpus=1)


def test_gpu_count_from_limits_else_requests():
    plan = plan_pod(pod(ctr("a", requests={"nvidia.com/gpu": "3"})), FACTS)
    assert plan.request.gpu_count == 3
    plan = plan_pod(pod(ctr("a", limits={"nvidia.com/gpu": "2"}, requests={"nvidia.com/gpu": "7"})), FACTS)
    assert plan.request.gpu_count == 2


def test_memory_units_of_all_containers_share_one_gpu():
    p = pod(ctr("a", limits={"nvidia.com/gpu-memory": "10"}), ctr("b", limits={"nvidia.com/gpu-memory": "5"}),
            init=(sidecar("s", limits={"nvidia.com/gpu-memory": "3"}),))
    plan = plan_pod(p, ClusterFacts(512, FACTS.models, FACTS.mig_profiles, 158))
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=1, gpu_memory_mib=18 * 512),)
    assert plan.memory_units() == 18 and plan.memory_unit_mib == 512
    assert plan.request.kind == WorkloadKind.INFERENCE


def test_mig_devices_add_up_per_profile():
    p = pod(ctr("a", limits={"nvidia.com/mig-1g.10gb": "2"}), ctr("c", limits={"nvidia.com/mig-3g.40gb": "1"}),
            ctr("b", limits={"nvidia.com/mig-1g.10gb": "1"}))
    plan = plan_pod(p, FACTS)
    assert plan.request.gpu_shapes() == (GpuShape(mig_profile="1g.10gb", mig_count=3),
                                         GpuShape(mig_profile="3g.40gb", mig_count=1))
    assert plan.containers[0].mig == (("1g.10gb", 2),)
    assert plan.request.kind == WorkloadKind.INFERENCE


@pytest.mark.parametrize("limits", [
    {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1"},
    {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"},
])
def test_one_gpu_resource_per_container(limits: dict[str, str]) -> None:
    """The kubelet keeps only one NVIDIA_VISIBLE_DEVICES per container (seen with the real devicemanager)."""
    with pytest.raises(InvalidPod, match="one GPU resource only") as err:
        plan_pod(pod(ctr("a", limits=limits)), FACTS)
    assert err.value.permanent
    plan_pod(pod(ctr("a", limits=limits)), FACTS, strict=False)  # a bound pod is still accounted


def test_mixed_pod_from_the_handshake_worked_example():
    p = pod(ctr("server", limits={"nvidia.com/gpu-memory": 20}), ctr("trainer", limits={"nvidia.com/gpu": 2}),
            init=(ctr("fetch-weights", limits={"nvidia.com/gpu-memory": 2}),))
    plan = plan_pod(p, FACTS)
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=2, gpu_milli=1000),
                                         GpuShape(gpu_count=1, gpu_memory_mib=20 * 1024))
    assert [(c.name, c.init, c.memory_units, c.gpus) for c in plan.containers] == [
        ("fetch-weights", True, 2, 0), ("server", False, 20, 0), ("trainer", False, 0, 2)]
    assert plan.request.kind == WorkloadKind.TRAINING


def test_cpu_pod_has_no_shapes_and_unknown_kind():
    plan = plan_pod(pod(ctr("a", requests={"cpu": "1"})), FACTS)
    assert plan.request.gpu_shapes() == () and plan.request.kind == WorkloadKind.UNKNOWN


@pytest.mark.parametrize("value", ["0", 0, "-1", "1.5", "abc", "500m", False])
@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "nvidia.com/gpu-memory", "nvidia.com/mig-1g.10gb"])
def test_bad_device_count_is_permanent_and_named(resource, value):
    exc = invalid(pod(ctr("worker", limits={resource: value})))
    assert exc.permanent
    assert "container 'worker'" in str(exc) and resource in str(exc)


def test_bad_device_count_is_ignored_when_not_strict():
    plan = plan_pod(pod(ctr("w", limits={"nvidia.com/gpu": "0"}), ctr("v", limits={"nvidia.com/gpu": "1"})),
                    FACTS, strict=False)
    assert plan.request.gpu_count == 1


def test_integral_quantity_forms_count():
    assert plan_pod(pod(ctr("a", limits={"nvidia.com/gpu": "1000m"})), FACTS).request.gpu_count == 1


def test_huge_device_count_is_permanent():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/gpu": "1e30"})))
    assert exc.permanent and "too large" in str(exc)


def test_gpu_and_memory_units_in_one_container_is_permanent():
    exc = invalid(pod(ctr("mix", limits={"nvidia.com/gpu": 1, "nvidia.com/gpu-memory": 4})))
    assert exc.permanent and "'mix'" in str(exc) and "separate containers" in str(exc)


def test_gpu_and_memory_units_in_one_container_kept_when_not_strict():
    plan = plan_pod(pod(ctr("mix", limits={"nvidia.com/gpu": 1, "nvidia.com/gpu-memory": 4})), FACTS, strict=False)
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=1, gpu_milli=1000),
                                         GpuShape(gpu_count=1, gpu_memory_mib=4096))


def test_unknown_mig_profile_is_not_permanent_and_lists_profiles():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/mig-2g.20gb": 1})))
    assert not exc.permanent
    assert str(exc) == "unknown MIG profile '2g.20gb'; the cluster has: 1g.10gb, 3g.40gb"
    exc = invalid(pod(ctr("a", limits={"nvidia.com/mig-2g.20gb": 1})), ClusterFacts())
    assert str(exc) == "unknown MIG profile '2g.20gb'; the cluster has: none"


def test_unknown_mig_profile_kept_when_not_strict():
    plan = plan_pod(pod(ctr("a", limits={"nvidia.com/mig-2g.20gb": 1})), FACTS, strict=False)
    assert plan.request.gpu_shapes() == (GpuShape(mig_profile="2g.20gb", mig_count=1),)


def test_mig_resource_without_profile_is_permanent():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/mig-": 1})))
    assert exc.permanent and "names no MIG profile" in str(exc)
    plan = plan_pod(pod(ctr("a", limits={"nvidia.com/mig-": 1, "nvidia.com/gpu": 1})), FACTS, strict=False)
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=1, gpu_milli=1000),)


def test_too_many_units_for_any_gpu_is_not_permanent():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/gpu-memory": 60}), ctr("b", limits={"nvidia.com/gpu-memory": 30})))
    assert not exc.permanent
    assert str(exc) == "asks for 90 nvidia.com/gpu-memory units (90 GiB) on one GPU; the largest GPU offers 79"
    assert plan_pod(pod(ctr("a", limits={"nvidia.com/gpu-memory": 79})), FACTS).memory_units() == 79


def test_units_without_any_sharing_gpu_is_not_permanent():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/gpu-memory": 3})), ClusterFacts(512))
    assert not exc.permanent
    assert "(1536 MiB)" in str(exc) and "no GPU of the cluster offers nvidia.com/gpu-memory" in str(exc)


def test_units_limit_ignored_when_not_strict():
    plan = plan_pod(pod(ctr("a", limits={"nvidia.com/gpu-memory": 90})), FACTS, strict=False)
    assert plan.request.gpu_memory_mib == 90 * 1024


def test_permanent_problems_win_over_cluster_problems():
    p = pod(ctr("a", limits={"nvidia.com/mig-7g.80gb": 1}), ctr("b", limits={"nvidia.com/gpu": "0"}))
    exc = invalid(p)
    assert exc.permanent and "7g.80gb" not in str(exc)


def test_several_problems_are_all_named():
    exc = invalid(pod(ctr("a", limits={"nvidia.com/gpu": "0"}), ctr("b", requests={"cpu": "x"})))
    assert "'a'" in str(exc) and "'b'" in str(exc)


# ---- init containers (handshake rule 3) ----------------------------------------------------------


def test_init_container_reuses_the_next_containers_gpus():
    p = pod(ctr("app", limits={"nvidia.com/gpu": 2}), init=(ctr("warm", limits={"nvidia.com/gpu": 1}),))
    plan = plan_pod(p, FACTS)
    assert plan.request.gpu_count == 2
    assert plan.containers[0] == ContainerDemand("warm", True, False, gpus=1)


def test_init_chain_and_init_before_sidecar():
    p = pod(ctr("app", limits={"nvidia.com/gpu": 3}),
            init=(ctr("i1", limits={"nvidia.com/gpu": 1}), ctr("i2", limits={"nvidia.com/gpu": 2}),
                  ctr("i3", limits={"nvidia.com/mig-1g.10gb": 1}), sidecar("s", limits={"nvidia.com/mig-1g.10gb": 1})))
    plan = plan_pod(p, FACTS)
    assert plan.request.gpu_shapes() == (GpuShape(gpu_count=3, gpu_milli=1000),
                                         GpuShape(mig_profile="1g.10gb", mig_count=1))


def test_init_container_asking_more_than_the_next_is_permanent():
    p = pod(ctr("app", limits={"nvidia.com/gpu": 2}), init=(ctr("warm", limits={"nvidia.com/gpu": 4}),))
    exc = invalid(p)
    assert exc.permanent
    assert "init container 'warm' asks for 4 nvidia.com/gpu, more than the 2 of the next container" in str(exc)
    assert "'app'" in str(exc)


def test_init_memory_units_more_than_the_next_is_permanent():
    p = pod(ctr("server", limits={"nvidia.com/gpu-memory": 20}),
            init=(ctr("fetch", limits={"nvidia.com/gpu-memory": 30}),))
    assert "init container 'fetch' asks for 30 nvidia.com/gpu-memory" in str(invalid(p))


def test_init_container_without_a_later_taker_is_permanent():
    p = pod(ctr("app", limits={"nvidia.com/gpu-memory": 4}), init=(ctr("warm", limits={"nvidia.com/gpu": 1}),))
    exc = invalid(p)
    assert exc.permanent and "init container 'warm' asks for 1 nvidia.com/gpu but no later container does" in str(exc)


def test_next_container_is_the_next_asking_for_the_same_resource():
    # i1's next nvidia.com/gpu container is i2 (1 GPU), not app (4 GPUs)
    p = pod(ctr("app", limits={"nvidia.com/gpu": 4}),
            init=(ctr("i1", limits={"nvidia.com/gpu": 2}), ctr("i2", limits={"nvidia.com/gpu": 1})))
    assert "'i1' asks for 2 nvidia.com/gpu, more than the 1 of the next container asking for it ('i2')" in str(
        invalid(p))


def test_init_violation_takes_the_kubernetes_max_when_not_strict():
    p = pod(ctr("app", limits={"nvidia.com/gpu": 2}), init=(ctr("warm", limits={"nvidia.com/gpu": 4}),))
    assert plan_pod(p, FACTS, strict=False).request.gpu_count == 4


@st.composite
def gpu_layouts(draw: st.DrawFn) -> tuple[list[tuple[str, bool, bool, int]], ...]:
    """(name, init, sidecar, GPUs) per container, kubelet order."""
    inits = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 4)), max_size=4))
    apps = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    out = [(f"i{k}", True, sc, n) for k, (sc, n) in enumerate(inits)]
    return out + [(f"a{k}", False, False, n) for k, n in enumerate(apps)]


@given(gpu_layouts())
def test_whole_gpu_demand_matches_rule_3(layout):
    inits = tuple(sidecar(n, limits={"nvidia.com/gpu": g} if g else {}) if sc else
                  ctr(n, limits={"nvidia.com/gpu": g} if g else {}) for n, init, sc, g in layout if init)
    apps = [ctr(n, limits={"nvidia.com/gpu": g} if g else {}) for n, init, _, g in layout if not init]
    p = pod(*apps, init=inits)
    # the rule, stated directly: each plain init container's count fits in the next container asking for GPUs
    ok = all(
        any(g2 > 0 for *_, g2 in layout[k + 1:]) and next(g2 for *_, g2 in layout[k + 1:] if g2 > 0) >= g
        for k, (_, init, sc, g) in enumerate(layout) if init and not sc and g > 0
    )
    held = sum(g for _, init, sc, g in layout if not init or sc)
    if ok:
        assert plan_pod(p, FACTS).request.gpu_count == held
    else:
        assert invalid(p).permanent
        assert plan_pod(p, FACTS, strict=False).request.gpu_count >= held


# ---- the model annotation ------------------------------------------------------------------------


def gpu_pod(models: Any) -> dict[str, Any]:
    return pod(ctr("a", limits={"nvidia.com/gpu": 1}), annotations={"gpupool.io/gpu-model": models})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("H100", {H100}),
        ("h100", {H100}),
        ("A100-80GB", {A100_80}),
        ("A100_40GB", {A100_40}),
        ("a100 80gb", {A100_80}),
        ("A100", {A100_80, A100_40}),
        ("H100, A100-80GB", {H100, A100_80}),
        ("NVIDIA-L40S", {L40S}),
        ("80GB", {H100, A100_80}),
    ],
)
def test_model_entries_match_by_tokens(value, expected):
    assert plan_pod(gpu_pod(value), FACTS).request.gpu_models == frozenset(expected)


def test_partial_token_does_not_match():
    exc = invalid(gpu_pod("A100-4"))
    assert not exc.permanent and "unknown GPU model 'A100-4'" in str(exc)


def test_unknown_model_is_not_permanent_and_lists_models():
    exc = invalid(gpu_pod("H100,V100"))
    assert not exc.permanent
    assert str(exc) == f"unknown GPU model 'V100'; the cluster has: {A100_40}, {A100_80}, {H100}, {L40S}"


def test_unknown_model_ignored_when_not_strict():
    assert plan_pod(gpu_pod("H100,V100"), FACTS, strict=False).request.gpu_models == frozenset({H100})
    assert plan_pod(gpu_pod("V100"), FACTS, strict=False).request.gpu_models == frozenset()


@pytest.mark.parametrize("value", ["", "  ", "H100,", ",H100", "H100,,A100", "-", 5, ["H100"]])
def test_malformed_model_annotation_is_permanent(value):
    exc = invalid(gpu_pod(value))
    assert exc.permanent and "gpupool.io/gpu-model" in str(exc)


def test_model_annotation_on_a_cpu_pod_is_checked_but_not_matched():
    obj = pod(ctr("a", requests={"cpu": "1"}), annotations={"gpupool.io/gpu-model": "V100"})
    assert plan_pod(obj, FACTS).request.gpu_models == frozenset()
    obj = pod(ctr("a", requests={"cpu": "1"}), annotations={"gpupool.io/gpu-model": ""})
    assert invalid(obj).permanent


# ---- workload kind and priority ------------------------------------------------------------------


@pytest.mark.parametrize(("value", "kind"), [("training", WorkloadKind.TRAINING),
                                             ("inference", WorkloadKind.INFERENCE)])
def test_workload_annotation(value, kind):
    obj = pod(ctr("a", limits={"nvidia.com/gpu-memory": 1}), annotations={"gpupool.io/workload": value})
    assert plan_pod(obj, FACTS).request.kind == kind


@pytest.mark.parametrize("value", ["Training", "batch", "", 1])
def test_bad_workload_annotation_is_permanent(value):
    obj = pod(ctr("a"), annotations={"gpupool.io/workload": value})
    exc = invalid(obj)
    assert exc.permanent and "gpupool.io/workload" in str(exc)


def test_annotations_must_be_an_object():
    obj = pod(ctr("a"))
    obj["metadata"]["annotations"] = ["x"]
    assert "metadata.annotations must be an object" in str(invalid(obj))


def test_priority_from_spec_then_class_then_zero():
    classes = {"high": 1000, "low": -5}
    assert plan_pod(pod(ctr("a"), priority=7, priorityClassName="high"), FACTS, classes).priority == 7
    assert plan_pod(pod(ctr("a"), priorityClassName="high"), FACTS, classes).priority == 1000
    assert plan_pod(pod(ctr("a"), priorityClassName="low"), FACTS, classes).request.priority == -5
    assert plan_pod(pod(ctr("a")), FACTS, classes).priority == 0
    assert plan_pod(pod(ctr("a"), priority=3), FACTS).request.priority == 3


def test_unknown_priority_class_is_permanent():
    exc = invalid(pod(ctr("a"), priorityClassName="urgent"), classes={"high": 1})
    assert exc.permanent and "priority class 'urgent' does not exist" in str(exc)
    assert invalid(pod(ctr("a"), priorityClassName="urgent")).permanent
    assert plan_pod(pod(ctr("a"), priorityClassName="urgent"), FACTS, strict=False).priority == 0


@pytest.mark.parametrize("value", [True, "5", 1.5, 2**31, -(2**31) - 1])
def test_bad_spec_priority_is_permanent(value):
    assert invalid(pod(ctr("a"), priority=value)).permanent


# ---- node constraints ----------------------------------------------------------------------------


def test_no_constraints_is_none():
    assert plan_pod(pod(ctr("a")), FACTS).request.constraints is None


def test_selector_affinity_and_tolerations():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]},
                              {"key": "gpu", "operator": "Exists"}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n7"]}],
         "matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["8"]}]},
    ]}, "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {}}]}}
    tolerations = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                   {"key": "team", "value": "ml"},
                   {"operator": "Exists"},
                   {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                    "tolerationSeconds": 300}]
    obj = pod(ctr("a"), nodeSelector={"pool": "gpu", "arch": "amd64"}, affinity=affinity, tolerations=tolerations)
    assert plan_pod(obj, FACTS).request.constraints == NodeConstraints(
        node_selector=(("arch", "amd64"), ("pool", "gpu")),
        affinity_terms=(
            (Requirement("zone", "In", ("a", "b")), Requirement("gpu", "Exists")),
            (Requirement("cores", "Gt", ("8",)), Requirement("metadata.name", "In", ("n7",))),
        ),
        tolerations=(Toleration("gpu", "Exists", "", "NoSchedule"), Toleration("team", "Equal", "ml", ""),
                     Toleration("", "Exists", "", ""),
                     Toleration("node.kubernetes.io/not-ready", "Exists", "", "NoExecute")),
    )


def _affinity(*terms: Any) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"nodeSelector": ["a"]}, "spec.nodeSelector must be an object"),
        ({"nodeSelector": {"pool": 5}}, "spec.nodeSelector"),
        ({"affinity": "x"}, "spec.affinity must be an object"),
        ({"affinity": _affinity()}, "must list at least one term"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}},
         "must list at least one term"),
        ({"affinity": _affinity("term")}, "nodeSelectorTerms[0] must be an object"),
        ({"affinity": _affinity({"matchExpressions": {"key": "a"}})}, "matchExpressions must be a list"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "Is", "values": ["x"]}]})},
         "operator must be one of"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "In"}]})}, "operator In needs values"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]})},
         "takes no values"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["x"]}]})},
         "exactly one integer value"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "Lt", "values": ["1", "2"]}]})},
         "exactly one integer value"),
        ({"affinity": _affinity({"matchExpressions": [{"operator": "Exists"}]})}, "key must be a non-empty string"),
        ({"affinity": _affinity({"matchExpressions": [{"key": "a", "operator": "In", "values": [1]}]})},
         "values must be strings"),
        ({"affinity": _affinity({"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["x"]}]})},
         "matchFields supports only the key metadata.name"),
        ({"affinity": _affinity({"matchFields": [{"key": "metadata.name", "operator": "Exists"}]})},
         "operator must be one of In, NotIn"),
        ({"affinity": _affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]})},
         "exactly one node name"),
        ({"tolerations": {"key": "x"}}, "spec.tolerations must be a list"),
        ({"tolerations": ["x"]}, "spec.tolerations[0] must be an object"),
        ({"tolerations": [{"key": "x", "operator": "Matches"}]}, "operator must be Exists or Equal"),
        ({"tolerations": [{"key": "x", "effect": "NoWay"}]}, "effect must be"),
        ({"tolerations": [{"key": "x", "operator": "Exists", "value": "v"}]}, "operator Exists takes no value"),
        ({"tolerations": [{"value": "v"}]}, "without a key must use operator Exists"),
        ({"tolerations": [{"key": 5}]}, "must be strings"),
        ({"tolerations": [{"key": "x", "tolerationSeconds": "300"}]}, "tolerationSeconds must be an integer"),
    ],
)
def test_malformed_constraints_are_permanent(spec, says):
    exc = invalid(pod(ctr("a"), **spec))
    assert exc.permanent and says in str(exc)


def test_malformed_constraints_dropped_when_not_strict():
    obj = pod(ctr("a"), nodeSelector={"pool": "gpu"}, tolerations=[{"key": "x", "effect": "NoWay"}, {"key": "ok"}])
    assert plan_pod(obj, FACTS, strict=False).request.constraints == NodeConstraints(
        node_selector=(("pool", "gpu"),), tolerations=(Toleration("ok"),))


# ---- structure -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"containers": []}, "the pod has no containers"),
        ({"containers": None}, "the pod has no containers"),
        ({"containers": "a"}, "spec.containers must be a list"),
        ({"containers": [5]}, "spec.containers[0] is not an object"),
        ({"containers": [{"image": "x"}]}, "spec.containers[0] has no name"),
        ({"containers": [ctr("a"), ctr("a")]}, "container name 'a' is used twice"),
        ({"containers": [ctr("a")], "initContainers": [ctr("a")]}, "container name 'a' is used twice"),
        ({"containers": [ctr("a")], "initContainers": [ctr("i", restartPolicy="Never")]}, "restartPolicy 'Never'"),
        ({"containers": [{"name": "a", "resources": []}]}, "resources must be an object"),
        ({"containers": [{"name": "a", "resources": {"limits": ["cpu"]}}]}, "resources.limits must be an object"),
        ({"containers": [{"name": "a", "resources": {"limits": {5: "1"}}}]}, "resource name 5 is not a string"),
        ({"containers": [ctr("a")], "overhead": "lots"}, "spec.overhead must be an object"),
    ],
)
def test_malformed_structure_is_permanent(spec, says):
    obj = pod()
    obj["spec"].update(spec)
    exc = invalid(obj)
    assert exc.permanent and says in str(exc)


def test_long_values_are_shortened_in_messages():
    exc = invalid(pod(ctr("a", requests={"cpu": "x" * 5000})))
    assert len(str(exc)) < 200


# ---- garbage in: only PodPlan or InvalidPod ------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["1", "0", "-1", "2Gi", "500m", "1e999999999", "NaN", "1.5", "Always",
                                           "In", "Exists", "nvidia.com/gpu", "H100", "training", "1g.10gb"]),
)
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)


def _mostly(valid: st.SearchStrategy[Any], garbage: st.SearchStrategy[Any] = _json) -> st.SearchStrategy[Any]:
    """Plausible values 15 times in 16, so that garbage meets code that runs past the first checks."""
    return st.integers(0, 15).flatmap(lambda k: garbage if k == 7 else valid)  # 0 and 15 come up more often


_resource_names = _mostly(
    st.sampled_from(["cpu", "memory", "nvidia.com/gpu", "nvidia.com/gpu-memory", "nvidia.com/mig-1g.10gb"]),
    st.sampled_from(["nvidia.com/mig-", "nvidia.com/mig-9g.99gb", "example.com/foo", "nvidia.com/gpu-memory"]))
_quantities = _mostly(st.integers(1, 4).map(str), _scalars)
_resources = st.fixed_dictionaries({}, optional={
    "limits": _mostly(st.dictionaries(_resource_names, _quantities, max_size=3)),
    "requests": _mostly(st.dictionaries(_resource_names, _quantities, max_size=3)),
})
_container = _mostly(st.fixed_dictionaries(
    {"name": _mostly(st.text("abcdefgh", min_size=1, max_size=3), _scalars)},
    optional={"resources": _mostly(_resources), "restartPolicy": _mostly(st.just("Always"), _scalars)},
))
_selector_terms = st.lists(st.fixed_dictionaries({}, optional={
    "matchExpressions": _mostly(st.lists(st.fixed_dictionaries(
        {"key": _mostly(st.sampled_from(["zone", "gpu"]), _scalars),
         "operator": _mostly(st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]), _scalars)},
        optional={"values": _mostly(st.lists(st.sampled_from(["a", "1", "x"]), max_size=2))}), max_size=2)),
    "matchFields": _mostly(st.lists(st.fixed_dictionaries(
        {"key": _mostly(st.just("metadata.name"), _scalars), "operator": _mostly(st.just("In"), _scalars),
         "values": _mostly(st.lists(st.just("n1"), max_size=2))}), max_size=1)),
}), max_size=2)
_affinity_json = st.fixed_dictionaries({"nodeAffinity": _mostly(st.fixed_dictionaries({
    "requiredDuringSchedulingIgnoredDuringExecution": _mostly(st.fixed_dictionaries({
        "nodeSelectorTerms": _mostly(_selector_terms)}))}))})
_spec = st.fixed_dictionaries(
    {"containers": _mostly(st.lists(_container, min_size=1, max_size=3))},
    optional={
        "initContainers": _mostly(st.lists(_container, max_size=3)),
        "priority": _mostly(st.integers(-10, 10), _scalars),
        "priorityClassName": _mostly(st.sampled_from(["high", "nope"]), _scalars),
        "nodeSelector": _mostly(st.dictionaries(st.text(max_size=5), st.text(max_size=3), max_size=3)),
        "affinity": _mostly(_affinity_json),
        "tolerations": _mostly(st.lists(_mostly(st.fixed_dictionaries({}, optional={
            "key": _mostly(st.sampled_from(["", "gpu"]), _scalars),
            "operator": _mostly(st.sampled_from(["Exists", "Equal"]), _scalars),
            "value": _mostly(st.sampled_from(["", "v"]), _scalars),
            "effect": _mostly(st.sampled_from(["", "NoSchedule", "NoExecute"]), _scalars),
            "tolerationSeconds": _mostly(st.integers(0, 100), _scalars)})), max_size=2)),
        "overhead": _mostly(st.dictionaries(_resource_names, _quantities, max_size=2)),
        "resources": _mostly(_resources),
    },
)
_meta = st.fixed_dictionaries(
    {"name": _mostly(st.just("p"), _scalars), "uid": _mostly(st.just("u"), _scalars)},
    optional={"namespace": _mostly(st.just("ns"), _scalars),
              "creationTimestamp": _mostly(st.just("2026-01-01T00:00:00Z")),
              "annotations": _mostly(st.dictionaries(st.sampled_from(["gpupool.io/gpu-model", "gpupool.io/workload",
                                                                      "x"]),
                                                     _mostly(st.sampled_from(["H100", "A100,L40S", "training",
                                                                              "inference", "V100", ""]), _scalars),
                                                     max_size=3))},
)
_pods = _mostly(st.fixed_dictionaries({"metadata": _mostly(_meta), "spec": _mostly(_spec)}))


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(_pods)
def test_anything_a_pod_says_gives_a_plan_or_invalid_pod(obj):
    for strict in (True, False):
        try:
            plan = plan_pod(obj, FACTS, {"high": 10}, strict=strict)
        except InvalidPod as exc:
            assert isinstance(exc.permanent, bool) and str(exc)
            if not strict:
                assert str(exc).startswith("not a pod")
        else:
            assert isinstance(plan, PodPlan)
            assert plan.request.cpu_milli >= 0 and plan.request.memory_mib >= 0


# ---- revision ------------------------------------------------------------------------------------


def test_revision_ignores_status_and_resource_version():
    a = pod(ctr("a", limits={"nvidia.com/gpu": 1}))
    b = {**a, "status": {"conditions": [{"type": "PodScheduled", "status": "False"}]},
         "metadata": {**a["metadata"], "resourceVersion": "99", "managedFields": [{"x": 1}]}}
    assert pod_revision(a) == pod_revision(b) is not None
    c = pod(ctr("a", limits={"nvidia.com/gpu": 2}))
    d = {**a, "metadata": {**a["metadata"], "annotations": {"gpupool.io/gpu-model": "H100"}}}
    assert len({pod_revision(a), pod_revision(c), pod_revision(d)}) == 3


def test_revision_of_garbage_is_none_or_stable():
    assert pod_revision({"metadata": {("a",): 1}, "spec": {}}) is None
    assert pod_revision({"metadata": {"a": {1, 2}}}) == pod_revision({"metadata": {"a": {1, 2}}})
