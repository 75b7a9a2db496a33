"""PodGroups and their members as the scheduler keeps them (scheduler/gangs.py), from plain objects."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool_sched.cache.entries import Phase as LedgerPhase
from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL, Gangs, group_of
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest


def pg(name: str, spec: dict[str, Any], uid: str = "u1", ns: str = "team") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "uid": uid}, "spec": spec}


def pod_obj(name: str, group: Any, ns: str = "team") -> dict[str, Any]:
    labels = {} if group is None else {POD_GROUP_LABEL: group}
    return {"metadata": {"name": name, "namespace": ns, "labels": labels}}


def test_group_of_reads_the_label_and_rejects_names_no_object_can_have() -> None:
    assert group_of(pod_obj("p", None)) == (None, None)
    assert group_of(pod_obj("p", "train-1")) == ("team/train-1", None)
    for bad in ("Train", "a_b", "-a", "", "x" * 254):
        key, problem = group_of(pod_obj("p", bad))
        assert key is None and problem and "does not name a PodGroup" in problem, bad


@pytest.mark.parametrize(("spec", "problem"), [
    ({}, "spec.minMember must be an integer >= 1, got None"),
    ({"minMember": 0}, "got 0"),
    ({"minMember": "3"}, "got '3'"),
    ({"minMember": True}, "got True"),
    ({"minMember": 2, "scheduleTimeoutSeconds": 0}, "scheduleTimeoutSeconds must be an integer >= 1"),
])
def test_malformed_groups_carry_their_problem(spec: dict[str, Any], problem: str) -> None:
    gangs = Gangs()
    assert gangs.apply_group("ADDED", pg("g", spec)) == "team/g"
    group = gangs.groups["team/g"]
    assert group.problem is not None and problem in group.problem


def test_updates_wake_members_only_when_the_spec_changes_and_keep_the_wait() -> None:
    gangs = Gangs(clock=lambda: 100.0)
    assert gangs.apply_group("ADDED", pg("g", {"minMember": 2})) == "team/g"
    gangs.started("team/g")
    assert gangs.apply_group("MODIFIED", pg("g", {"minMember": 2})) is None  # e.g. our status write
    assert gangs.groups["team/g"].first_try == 100.0
    assert gangs.apply_group("MODIFIED", pg("g", {"minMember": 3})) == "team/g"
    assert gangs.groups["team/g"].first_try == 100.0
    assert gangs.apply_group("ADDED", pg("g", {"minMember": 3}, uid="u2")) == "team/g"  # recreated
    assert gangs.groups["team/g"].first_try is None
    assert gangs.apply_group("DELETED", pg("g", {"minMember": 3}, uid="u2")) == "team/g"
    assert "team/g" not in gangs.groups


def test_membership_follows_label_changes_and_deletion() -> None:
    gangs = Gangs()
    assert gangs.track("p1", "team/a") == "team/a"
    assert gangs.track("p1", "team/a") is None
    assert gangs.track("p2", "team/a") == "team/a"
    assert gangs.track("p1", "team/b") == "team/b"
    assert gangs.members == {"team/a": {"p2"}, "team/b": {"p1"}}
    gangs.untrack("p2")
    assert gangs.track("p1", None) is None
    assert gangs.members == {} and gangs.member_of("p1") is None


def test_timeout_is_reported_once_per_wait() -> None:
    now = [0.0]
    gangs = Gangs(clock=lambda: now[0])
    gangs.apply_group("ADDED", pg("g", {"minMember": 2, "scheduleTimeoutSeconds": 10}))
    assert gangs.overdue("team/g") is None  # never tried
    gangs.started("team/g")
    now[0] = 9.0
    assert gangs.overdue("team/g") is None
    now[0] = 10.5
    assert gangs.overdue("team/g") is not None
    assert gangs.overdue("team/g") is None
    gangs.scheduled("team/g")
    gangs.started("team/g")
    now[0] = 30.0
    assert gangs.overdue("team/g") is not None


def _entry(state: ClusterState, uid: str, pending: bool) -> None:
    request = PodRequest(name=uid, cpu_milli=100)
    state.pods[uid] = PodEntry(uid, f"team/{uid}", "n0", request, Placement(node="n0"), LedgerPhase.BOUND, True,
                               0.0, pending=pending)


def test_status_phases() -> None:
    gangs = Gangs()
    gangs.apply_group("ADDED", pg("g", {"minMember": 2}))
    group = gangs.groups["team/g"]
    state = ClusterState("gpupool")
    for uid in ("a", "b", "c"):
        gangs.track(uid, "team/g")
    assert gangs.status(group, state, {})["phase"] == "Pending"
    gangs.started("team/g")
    assert gangs.status(group, state, {}) == {"phase": "Scheduling", "scheduled": 0, "running": 0, "succeeded": 0,
                                              "failed": 0}
    _entry(state, "a", pending=True)
    _entry(state, "b", pending=True)
    assert gangs.status(group, state, {})["phase"] == "Scheduled"
    state.pods["a"].pending = False
    assert gangs.status(group, state, {})["phase"] == "Scheduled"
    state.pods["b"].pending = False
    assert gangs.status(group, state, {}) == {"phase": "Running", "scheduled": 2, "running": 2, "succeeded": 0,
                                              "failed": 0}
    del state.pods["a"], state.pods["b"]  # ended: the ledger lets them go
    assert gangs.status(group, state, {"a": "Succeeded", "b": "Succeeded"})["phase"] == "Succeeded"
    assert gangs.status(group, state, {"a": "Succeeded", "b": "Succeeded", "c": "Failed"})["phase"] == "Finished"
