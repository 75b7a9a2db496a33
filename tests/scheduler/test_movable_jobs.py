"""Which Jobs' pods may move to defragment (framework/plugins/movers.py): a batch/v1 Job whose
podFailurePolicy ignores DisruptionTarget before any rule that could match an evicted pod; the
`gpupool.io/movable` annotation overrides either way; a Job that appears or goes re-judges its pods.
Through the service: tests/scheduler/test_defrag.py."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

import pytest

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.movers import Movers, movable_kind, tolerates_disruption
from gpupool_sched.framework.plugins.victims import DisruptionBudgets
from tests.support.objects import bump, node_obj, pod_obj

_n = itertools.count()
NOW = datetime(2026, 11, 30, 10, 10, tzinfo=UTC).timestamp()  # pods started at 10:00 ran 10 minutes

IGNORE_DISRUPTION = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
FAIL_ON_ERRORS = {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "NotIn", "values": [0]}}


def job(*rules: dict[str, Any], uid: str = "job-1") -> dict[str, Any]:
    spec: dict[str, Any] = {"template": {"spec": {"restartPolicy": "Never"}}}
    if rules:
        spec["podFailurePolicy"] = {"rules": list(rules)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"namespace": "ns", "name": "train", "uid": uid},
            "spec": spec}


@pytest.mark.parametrize(("rules", "tolerates"), [
    pytest.param([IGNORE_DISRUPTION], True, id="ignore-disruption"),
    pytest.param([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}], True,
                 id="status-true"),
    pytest.param([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}], False,
                 id="status-false"),
    pytest.param([{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "Unknown"}]}],
                 False, id="status-unknown"),
    pytest.param([{"action": "Ignore", "onPodConditions": [{"type": "ConfigIssue"}, {"type": "DisruptionTarget"}]}],
                 True, id="one-pattern-of-several"),
    pytest.param([{"action": "Count", "onPodConditions": [{"type": "DisruptionTarget"}]}], False, id="count"),
    pytest.param([{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}], False, id="fail-job"),
    # the first matching rule wins: the evicted pod's exit code (143 after SIGTERM) matches NotIn [0] first
    pytest.param([FAIL_ON_ERRORS, IGNORE_DISRUPTION], False, id="failjob-on-exit-codes-first"),
    # the Kubernetes documentation's example: a workload that exits 42 when terminated fails the Job
    pytest.param([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}, IGNORE_DISRUPTION], False,
                 id="failjob-on-42-first"),
    pytest.param([{"action": "Count", "onPodConditions": [{"type": "Ready", "status": "False"}]}, IGNORE_DISRUPTION],
                 False, id="count-on-another-condition-first"),
    pytest.param([IGNORE_DISRUPTION, FAIL_ON_ERRORS], True, id="ignore-first-then-failjob"),
    pytest.param([{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [3]}}, IGNORE_DISRUPTION], True,
                 id="an-ignore-rule-before-it"),
    pytest.param([FAIL_ON_ERRORS], False, id="no-ignore-rule"),
    pytest.param([], False, id="no-policy"),
])
def test_which_pod_failure_policies_tolerate_a_disruption(rules: list[dict[str, Any]], tolerates: bool) -> None:
    assert tolerates_disruption(job(*rules)) is tolerates


@pytest.mark.parametrize("obj", [
    {}, {"spec": None}, {"spec": {"podFailurePolicy": None}}, {"spec": {"podFailurePolicy": {"rules": None}}},
    {"spec": {"podFailurePolicy": {"rules": "x"}}},
    {"spec": {"podFailurePolicy": {"rules": ["Ignore", IGNORE_DISRUPTION]}}},
    {"spec": {"podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": {"type": "DisruptionTarget"}}]}}},
    {"spec": {"podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}],
                                              "onExitCodes": {"operator": "In", "values": [1]}}]}}},  # both: invalid
])
def test_a_malformed_policy_tolerates_nothing(obj: dict[str, Any]) -> None:
    assert tolerates_disruption(obj) is False


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def world() -> tuple[ClusterState, Movers]:
    clock = Clock()
    state = ClusterState("gpupool", clock=clock)
    state.apply_node(node_obj("n1"))
    state.apply_node(node_obj("n2"))
    return state, Movers(state, DisruptionBudgets(), DefragConfig(min_runtime_s=300), clock=clock, wall=lambda: NOW)


def job_pod(job_uid: str = "job-1", *, api_version: str = "batch/v1", node: str = "n1",
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    obj = pod_obj(f"train-{next(_n)}", gpus=1, node=node, phase="Running", annotations=annotations)
    obj["metadata"]["ownerReferences"] = [{"apiVersion": api_version, "kind": "Job", "name": "train",
                                           "uid": job_uid, "controller": True}]
    obj["status"]["startTime"] = "2026-11-30T10:00:00Z"
    return obj


def candidates(movers: Movers) -> set[str]:
    return {m.pod.uid for m in movers.candidates(priority=0)}


def test_a_jobs_pods_move_while_their_job_tolerates_a_disruption() -> None:
    state, movers = world()
    before = job_pod()
    state.apply_pod(before)  # its pods are seen before the Job (two watches: any order)
    assert candidates(movers) == set()
    movers.on_job("ADDED", job(IGNORE_DISRUPTION))
    after = job_pod()
    state.apply_pod(after)
    assert candidates(movers) == {before["metadata"]["uid"], after["metadata"]["uid"]}
    movers.on_job("DELETED", {"metadata": {"namespace": "ns", "name": "train", "uid": "job-1"}})
    assert candidates(movers) == set() and not movers.tolerant_jobs
    state.apply_pod(before, deleted=True)
    state.apply_pod(after, deleted=True)
    assert not movers.job_pods and not movers.pod_job  # the index forgets pods that left the ledger


def test_a_job_without_the_policy_and_a_namesake_kind_do_not_move_their_pods() -> None:
    state, movers = world()
    movers.on_job("ADDED", job(FAIL_ON_ERRORS, IGNORE_DISRUPTION))  # FailJob first: not tolerant
    movers.on_job("ADDED", job(IGNORE_DISRUPTION, uid="job-2"))
    state.apply_pod(job_pod("job-1"))
    state.apply_pod(job_pod("job-2", api_version="example.com/v1"))  # a "Job" of another API group
    assert candidates(movers) == set()
    assert movers.tolerant_jobs == {"job-2"}


def test_the_annotation_overrides_the_jobs_policy() -> None:
    state, movers = world()
    movers.on_job("ADDED", job(IGNORE_DISRUPTION))
    movers.on_job("ADDED", job(uid="job-2"))  # no podFailurePolicy
    says_no = job_pod("job-1", annotations={"gpupool.io/movable": "false"})
    says_yes = job_pod("job-2", annotations={"gpupool.io/movable": "true"})
    state.apply_pod(says_no)
    state.apply_pod(says_yes)
    assert candidates(movers) == {says_yes["metadata"]["uid"]}
    entries = {uid: state.pods[uid] for uid in (says_no["metadata"]["uid"], says_yes["metadata"]["uid"])}
    assert not movable_kind(entries[says_no["metadata"]["uid"]], movers.tolerant_jobs)
    assert movable_kind(entries[says_yes["metadata"]["uid"]], ())


def test_a_change_to_a_known_pod_is_judged_again() -> None:
    """A pod already in the ledger that later says `gpupool.io/movable: "true"` (or whose controller reference
    changes) is tracked anew: the ledger tells its watchers (an entry gpupool assumed knew only its owner)."""
    state, movers = world()
    bare = pod_obj("bare", gpus=1, node="n1", phase="Running")
    bare["status"]["startTime"] = "2026-11-30T10:00:00Z"
    state.apply_pod(bare)
    assert candidates(movers) == set()
    state.apply_pod(bump(bare, annotations={"gpupool.io/movable": "true"}))
    assert candidates(movers) == {bare["metadata"]["uid"]}
