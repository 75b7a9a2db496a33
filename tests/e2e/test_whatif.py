"""`gpupool simulate --from-cluster` against the local control plane: its answer for the current policy is
what the live scheduler then does.

Two fake DGX H100 nodes; a first scheduler process binds low-priority pods (12 whole GPUs and a memory
share) and stops. Pods created while no scheduler runs stay pending: a high-priority pod that needs a
whole node (so a preemption), and smaller ones. The what-if runs as a ServiceAccount that may only get
and list, with `--policy current` (the chart's scheduler ConfigMap, created here, says gpupool); then a
fresh scheduler process starts and binds them. Pod by pod, its Bindings (node and the gpupool.io/assignment
annotation, which names each GPU by UUID) must equal the what-if's decisions, the pods the what-if leaves
pending must stay so, and the pods it evicted must be the what-if's victims: the high-priority pod's one
round of preemption (three pods on one node; the free GPUs its plan counts on are held for it meanwhile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool_common.handshake import ASSIGNMENT_ANNOTATION
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from tests.support.readers import account_kubeconfig, read_only_kubeconfig
from tests.support.scheduler_harness import (
    add_pool_nodes,
    list_pods,
    pod,
    priority_classes,
    start_scheduler,
    stop_scheduler,
    unique,
    wait_bound,
    wait_until,
)

pytestmark = pytest.mark.e2e

CLI = "import sys; from gpupool_sched.cli import main; sys.exit(main())"
CHART_LABELS = {"app.kubernetes.io/name": "gpupool", "app.kubernetes.io/component": "scheduler"}


def simulate(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """`gpupool simulate` from this checkout (PYTHONPATH), as the read-only user."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return subprocess.run([sys.executable, "-c", CLI, "simulate", "--from-cluster", "--kubeconfig", str(kubeconfig),
                           *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def pool(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    name = unique("whatif")
    nodes = add_pool_nodes(kube, name, "dgx-h100", 2)
    yield name, nodes
    kube.delete_nodes(nodes)


def test_what_if_for_the_current_policy_is_what_the_scheduler_then_does(
        kube: ClusterClient, namespace: str, pool: tuple[str, list[str]], tmp_path: Path) -> None:
    pool_name, _ = pool
    name = unique("gpupool-whatif")
    with priority_classes(kube, 100, 1_000_000, prefix="whatif") as (low, high), \
            read_only_kubeconfig(kube, namespace, tmp_path / "reader.kubeconfig", unique("whatif-reader")) as reader:
        kube.core.create_namespaced_config_map(namespace, {
            "metadata": {"name": "gpupool-scheduler-policy", "labels": CHART_LABELS},
            "data": {"policy": "gpupool", "percentage-of-nodes-to-score": "0"}})
        first = start_scheduler(kube, name, tmp_path)
        try:
            running = [pod(f"run-{i}", name, pool_name, gpus=2, priority_class=low) for i in range(6)]
            running.append(pod("run-share", name, pool_name, units=20, priority_class=low))
            create_pods(kube.core, namespace, running)
            wait_bound(kube, namespace, len(running), timeout_s=60)
        finally:
            stop_scheduler(first)

        pending = [pod("crit", name, pool_name, gpus=8, priority_class=high),
                   pod("p-two", name, pool_name, gpus=2),
                   pod("p-one", name, pool_name, gpus=1),
                   pod("p-share-10", name, pool_name, units=10),
                   pod("p-share-30", name, pool_name, units=30, priority_class=low)]
        create_pods(kube.core, namespace, pending)
        before = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}

        done = simulate("--scheduler-name", name, "--policy", "current", "--continue", "0", "--json", "-",
                        kubeconfig=reader)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        [answer] = report["policies"]
        assert answer["policy"] == "gpupool"
        decided = {d["pod"].partition("/")[2]: d for d in answer["decisions"]}
        # it wrote nothing: the pending pods are still pending, the running ones untouched
        after = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
        assert sorted(after) == sorted(before)
        assert all(not after[p["metadata"]["name"]]["spec"].get("nodeName") for p in pending)
        assert all(after[k]["metadata"]["resourceVersion"] == before[k]["metadata"]["resourceVersion"] for k in after)

        # the high-priority pod preempts once, the least it can: three pods on one node (its plan counts on
        # that node's free GPUs too, which are held for it while it waits, as kube-scheduler holds a
        # nominated pod's room against pods of lower or equal priority); nobody placed meanwhile is
        # evicted by a second round. The smaller pods then find no room (nobody they may preempt)
        assert answer["pending"] == len(pending) and decided["crit"].get("node"), decided
        victims = sorted(v.partition("/")[2] for v in decided["crit"].get("victims", ()))
        assert len(victims) == 3 and answer["preemptions"] == len(victims), decided["crit"]
        assert {before[v]["spec"]["nodeName"] for v in victims} == {decided["crit"]["node"]}, decided["crit"]
        assert not [k for k, d in decided.items() if d.get("evicted_by")], decided
        placed = sorted(p["metadata"]["name"] for p in pending if decided[p["metadata"]["name"]].get("node"))
        assert answer["pending_placed"] == len(placed) and "crit" in placed

        # every policy, and a continuation drawn from the cluster's mix: a table, still nothing written
        table = simulate("--scheduler-name", name, "--policy", "current,best-fit,fgd", "--continue", "6",
                         "--seed", "1", "--candidate=--policy best-fit --defrag off", kubeconfig=reader)
        assert table.returncode == 0, table.stderr
        print(table.stdout)
        rows = [line for line in table.stdout.splitlines() if line.startswith("│")]
        assert [r.split("│")[1].strip() for r in rows] == ["gpupool", "best-fit", "fgd",
                                                           "[--policy best-fit --defrag off]"], table.stdout
        assert all(r.split("│")[3].strip().endswith("/6") for r in rows), table.stdout
        assert all(not p["spec"].get("nodeName") for p in list_pods(kube, namespace) if p["metadata"]["name"]
                   in decided)

        live = start_scheduler(kube, name, tmp_path)
        try:
            def all_bound() -> list[dict[str, Any]] | None:
                pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
                # the end the what-if predicts (else this times out and the pods' places are shown): the
                # victims gone, the pods it places bound (a pod it leaves pending, bound while crit waited
                # on the room held for it, fails below)
                if any(v in pods for v in victims) or any(
                        not (pods.get(k) or {}).get("spec", {}).get("nodeName") for k in placed):
                    return None
                return list(pods.values())
            try:
                now = wait_until(all_bound, 45, "the pending pods bound by the live scheduler")
            except AssertionError:
                where = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in list_pods(kube, namespace)}
                raise AssertionError(f"live: {where}\nwhat-if: {decided}\n{live.tail(60)}") from None
        finally:
            stop_scheduler(live)

        bound = {p["metadata"]["name"]: p for p in now}
        for obj in pending:
            key = obj["metadata"]["name"]
            if key not in placed:
                assert key in bound and not bound[key]["spec"].get("nodeName"), (
                    f"the what-if leaves {key} pending, the scheduler placed it: {bound.get(key, {}).get('spec')}")
                continue
            got = bound[key]
            assert decided[key].get("node") == got["spec"]["nodeName"], (key, decided[key], got["spec"]["nodeName"])
            assert decided[key].get("assignment") == got["metadata"]["annotations"][ASSIGNMENT_ANNOTATION], key
        gone = sorted(set(before) - set(bound))
        assert gone == victims


def test_without_read_rights_it_is_one_line(kube: ClusterClient, namespace: str, tmp_path: Path) -> None:
    nobody = account_kubeconfig(kube, namespace, "nobody", tmp_path / "nobody.kubeconfig")
    done = simulate("--policy", "gpupool", kubeconfig=nobody)
    assert done.returncode == 2, done
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("gpupool simulate: error: reading the cluster failed: 403 Forbidden: "), lines[0]
    assert "cannot list resource" in lines[0] and "the what-if needs get/list on nodes, pods" in lines[0], lines[0]
