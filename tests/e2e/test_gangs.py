"""Gang scheduling on the local control plane (issue 10, scenario 4b and the gang part of 4e).

Pods labelled `scheduling.x-k8s.io/pod-group: NAME` belong to the PodGroup NAME (scheduler-plugins'
`scheduling.x-k8s.io/v1alpha1`, CRD from deploy/crds/). A gang's minMember are bound together or not
at all, so gangs that cannot all fit never hold parts of the cluster against each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from gpupool_devcluster.fake_pods import create_pods
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    events_for,
    list_pods,
    pod,
    pod_condition,
    priority_classes,
    start_scheduler,
    unique,
    wait_until,
)

LABEL = "scheduling.x-k8s.io/pod-group"
GROUP, VERSION, PLURAL = "scheduling.x-k8s.io", "v1alpha1", "podgroups"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gang-logs")


@pytest.fixture(scope="module")
def pool(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    install_crds(kube.api_client)  # the PodGroup CRD among the project's
    name = unique("gang")
    nodes = add_pool_nodes(kube, name, "dgx-h100", 3)  # 24 GPUs
    yield name, nodes
    kube.delete_nodes(nodes)


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, log_dir: Path, pool: object) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), log_dir)
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def pod_group(kube: ClusterClient, namespace: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PodGroup", "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def group_status(kube: ClusterClient, namespace: str, name: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(kube.api_client).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                                                 name)
    return dict(obj.get("status") or {})


def member(scheduler: str, pool: str, group: str, index: int, gpus: int) -> dict[str, Any]:
    return pod(f"{group}-{index}", scheduler, pool, gpus=gpus, labels={LABEL: group})


def bound_by_group(kube: ClusterClient, namespace: str) -> dict[str, list[str]]:
    """Group -> names of its bound members (groups with none bound included)."""
    out: dict[str, list[str]] = {}
    for p in list_pods(kube, namespace):
        group = (p["metadata"].get("labels") or {}).get(LABEL)
        if group is None:
            continue
        out.setdefault(group, [])
        if p["spec"].get("nodeName"):
            out[group].append(p["metadata"]["name"])
    return out


def delete_group_pods(kube: ClusterClient, namespace: str, group: str) -> None:
    kube.core.delete_collection_namespaced_pod(namespace, label_selector=f"{LABEL}={group}", grace_period_seconds=0)


def test_two_gangs_of_two_thirds_one_runs_whole_the_other_holds_nothing_then_runs(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
) -> None:
    name, _ = pool
    for group in ("ga", "gb"):
        pod_group(kube, namespace, group, {"minMember": 4, "scheduleTimeoutSeconds": 5})
    # 4 x 4 GPUs each: two thirds of the 24; created interleaved, a0 b0 a1 b1 ...
    manifests = [member(scheduler.name, name, g, i, 4) for i in range(4) for g in ("ga", "gb")]
    create_pods(kube.core, namespace, manifests, concurrency=1)

    def one_gang_bound() -> dict[str, list[str]] | None:
        groups = bound_by_group(kube, namespace)
        return groups if sorted(len(v) for v in groups.values()) == [0, 4] else None

    groups = wait_until(one_gang_bound, 60, "one gang bound whole")
    winner = next(g for g, v in groups.items() if len(v) == 4)
    loser = "gb" if winner == "ga" else "ga"
    time.sleep(3)  # the loser keeps holding nothing (no partial binding shows up later)
    assert bound_by_group(kube, namespace)[loser] == []
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    # the winner's 16 GPUs sit on two whole nodes (locality: members share nodes, 4 + 4 + 8 is not used)
    assert len({pods[f"{winner}-{i}"]["spec"]["nodeName"] for i in range(4)}) == 2
    for i in range(4):
        loser_pod = pods[f"{loser}-{i}"]
        condition = pod_condition(loser_pod)
        assert condition and condition["reason"] == "Unschedulable", loser_pod.get("status")
        assert f"PodGroup {namespace}/{loser}" in condition["message"]
        assert "gang does not fit" in condition["message"], condition["message"]
        assert events_for(kube, namespace, f"{loser}-{i}", "FailedScheduling")

    def statuses() -> tuple[dict[str, Any], dict[str, Any]] | None:
        won, lost = group_status(kube, namespace, winner), group_status(kube, namespace, loser)
        ok = won.get("phase") in ("Scheduled", "Running") and won.get("scheduled") == 4 and lost.get("scheduled") == 0
        return (won, lost) if ok and lost.get("phase") in ("Pending", "Scheduling") else None

    won, lost = wait_until(statuses, 20, "PodGroup status written")
    assert won["running"] == 4  # kwok runs them at once
    assert lost["phase"] == "Scheduling" and lost["running"] == 0  # tried, holding nothing
    (timeout,) = wait_until(lambda: events_for(kube, namespace, loser, "ScheduleTimeout"), 30,
                            "the losing gang's ScheduleTimeout Event (scheduleTimeoutSeconds: 5)")
    assert timeout["involvedObject"]["kind"] == "PodGroup" and "gang does not fit" in timeout["message"]

    delete_group_pods(kube, namespace, winner)  # the first gang finishes
    wait_until(lambda: len(bound_by_group(kube, namespace).get(loser, [])) == 4, 60, "the second gang bound whole")
    wait_until(lambda: group_status(kube, namespace, loser).get("phase") == "Running", 20, "second gang Running")
    assert scheduler.metric("gpupool_scheduler_gang_wait_duration_seconds_count") >= 2


def test_twenty_interleaved_gangs_never_deadlock_and_never_bind_partially(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
) -> None:
    name, _ = pool
    groups = [f"g{k:02d}" for k in range(20)]
    for group in groups:
        pod_group(kube, namespace, group, {"minMember": 2})
    # each gang: 2 x 4 GPUs (a third of the pool); 3 fit at once; members created round-robin
    manifests = [member(scheduler.name, name, g, i, 4) for i in range(2) for g in groups]
    create_pods(kube.core, namespace, manifests, concurrency=4)
    finished: set[str] = set()
    deadline = time.monotonic() + 240
    while len(finished) < len(groups):
        assert time.monotonic() < deadline, f"only {len(finished)} of 20 gangs ran: {bound_by_group(kube, namespace)}"
        state = bound_by_group(kube, namespace)
        # a gang's Bindings go out together but land one by one (and its deletion, too): a gang seen
        # with one member bound must have both within seconds; one that stays at one is held partially
        partial = sorted(g for g, v in state.items() if len(v) == 1 and g not in finished)
        for group in partial:
            wait_until(lambda group=group: len(bound_by_group(kube, namespace).get(group, [])) == 2, 10,
                       f"gang {group} bound partially: its second member bound within seconds")
        if partial:
            continue
        running = sorted(g for g, v in state.items() if len(v) == 2)
        assert len(running) <= 3
        if running:
            for group in running:
                delete_group_pods(kube, namespace, group)
                finished.add(group)
        time.sleep(0.3)
    assert not any(bound_by_group(kube, namespace).values())


def test_malformed_gangs_get_clear_events_and_other_pods_carry_on(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
) -> None:
    name, _ = pool
    pod_group(kube, namespace, "no-min", {"scheduleTimeoutSeconds": 30})  # the CRD lets minMember out
    bad = [
        pod("bad-label", scheduler.name, name, gpus=1, labels={LABEL: "Not_A_Name"}),
        pod("no-group", scheduler.name, name, gpus=1, labels={LABEL: "missing"}),
        pod("no-min-0", scheduler.name, name, gpus=1, labels={LABEL: "no-min"}),
        pod("plain", scheduler.name, name, gpus=1),
    ]
    create_pods(kube.core, namespace, bad, concurrency=1)
    wait_until(lambda: any(p["metadata"]["name"] == "plain" and p["spec"].get("nodeName")
                           for p in list_pods(kube, namespace)), 30, "the plain pod bound")
    expected = {
        "bad-label": "does not name a PodGroup",
        "no-group": f"PodGroup {namespace}/missing not found",
        "no-min-0": "spec.minMember must be an integer >= 1",
    }
    for pod_name, text in expected.items():
        def told(pod_name: str = pod_name, text: str = text) -> bool:
            return any(text in e.get("message", "") for e in events_for(kube, namespace, pod_name, "FailedScheduling"))

        wait_until(told, 30, f"{pod_name}: FailedScheduling saying {text!r}")
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    assert all(not pods[n]["spec"].get("nodeName") for n in expected)
    # the missing group appears: its member is scheduled without a restart
    pod_group(kube, namespace, "missing", {"minMember": 1})
    wait_until(lambda: any(p["metadata"]["name"] == "no-group" and p["spec"].get("nodeName")
                           for p in list_pods(kube, namespace)), 60, "no-group bound once its PodGroup exists")
    assert json.dumps(scheduler.metric("gpupool_scheduler_schedule_attempts_total", result="error")) == "0.0"


@pytest.fixture
def low_and_high(kube: ClusterClient) -> Iterator[tuple[str, ...]]:
    with priority_classes(kube, 100, 1000000, prefix="gang") as names:
        yield names


def test_a_high_priority_gang_preempts_for_its_minimum_and_nothing_for_half_a_gang(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
    low_and_high: tuple[str, ...],
) -> None:
    """24 one-GPU pods of priority 100 fill the pool's 3 nodes. Gang `train` (2 x 8 GPUs, priority
    1,000,000) evicts exactly two nodes' pods and binds both members together there. Gang `more` (same
    shape and priority) would need two more nodes: only one still runs pods of lower priority, so it
    evicts nobody and waits."""
    name, nodes = pool
    low, high = low_and_high
    fill = [pod(f"low-{i}", scheduler.name, name, gpus=1, priority_class=low) for i in range(24)]
    create_pods(kube.core, namespace, fill, concurrency=8)
    wait_until(lambda: sum(1 for p in list_pods(kube, namespace) if p["spec"].get("nodeName")) == 24, 60,
               "the pool filled with 24 low-priority pods")
    placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in list_pods(kube, namespace)}
    assert sorted(placed.values()).count(nodes[0]) == 8  # every GPU of every node taken

    pod_group(kube, namespace, "train", {"minMember": 2})
    create_pods(kube.core, namespace, [pod(f"train-{i}", scheduler.name, name, gpus=8, priority_class=high,
                                           labels={LABEL: "train"}) for i in range(2)])
    wait_until(lambda: len(bound_by_group(kube, namespace).get("train", [])) == 2, 60, "gang train bound whole")
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    low_left = {n: p["spec"]["nodeName"] for n, p in pods.items() if n.startswith("low-")}
    assert len(low_left) == 8 and len(set(low_left.values())) == 1  # exactly two nodes' pods evicted
    train_nodes = {pods[f"train-{i}"]["spec"]["nodeName"] for i in range(2)}
    assert len(train_nodes) == 2 and not train_nodes & set(low_left.values())
    preempting = [e for i in range(2) for e in events_for(kube, namespace, f"train-{i}", "Preempting")]
    assert len(preempting) == 2, preempting  # one per member, each naming its node's victims
    assert scheduler.metric("gpupool_scheduler_preemption_attempts_total", result="planned") >= 2

    pod_group(kube, namespace, "more", {"minMember": 2})
    create_pods(kube.core, namespace, [pod(f"more-{i}", scheduler.name, name, gpus=8, priority_class=high,
                                           labels={LABEL: "more"}) for i in range(2)])
    wait_until(lambda: events_for(kube, namespace, "more-0", "FailedScheduling"), 30, "gang more unschedulable")
    time.sleep(3)  # an eviction started for half a gang would show by now
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    assert {n for n in pods if n.startswith("low-")} == set(low_left)
    assert not any(pods[n]["metadata"].get("deletionTimestamp") for n in low_left)
    assert bound_by_group(kube, namespace)["more"] == []
    condition = pod_condition(pods["more-0"])
    assert condition and "gang does not fit" in condition["message"], condition
