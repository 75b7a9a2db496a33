"""`gpupool status` / `kubectl-gpupool status` against the local control plane, as a user who may only
get/list nodes, pods and PriorityClasses (a ServiceAccount token from the TokenRequest API).

The real scheduler places a mixed workload on three fake nodes (two DGX H100, one A100 with MIG); the
command runs as a subprocess and its figures are checked against what the test reads itself: the
assignment annotations, the nodes' inventories, and the placement core's fragmentation measure on a
snapshot the test builds from those (not through the scheduler's ClusterState).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.utils import parse_quantity

from gpupool_common.inventory import NodeInventory, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from gpupool_devcluster.kubeconfig import write_kubeconfig
from gpupool_devcluster.raw import read_json
from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, MigSlice, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.placement.workload import default_prior
from tests.support.scheduler_harness import (
    POOL_LABEL,
    SchedulerProcess,
    add_pool_nodes,
    device_use,
    pod,
    start_scheduler,
    unique,
    wait_bound,
)

BIN = Path(sys.executable).parent
READ_RULES = [
    {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list"]},
    {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get", "list"]},
]
UNIT_MIB = 1024


@dataclass
class Setup:
    pool: str
    nodes: list[str]
    classes: dict[str, int]
    scheduler: SchedulerProcess
    pods: list[dict[str, Any]]
    reader: Path  # kubeconfig of the read-only ServiceAccount
    nobody: Path  # kubeconfig of a ServiceAccount without any role
    reader_token: str
    created: dict[str, float]  # pending pod name -> creation time (time.time())


def token_kubeconfig(kube: ClusterClient, namespace: str, account: str, path: Path) -> str:
    """A kubeconfig with a fresh token of `account` from the TokenRequest API; returns the token."""
    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = str(kube.core.create_namespaced_service_account_token(account, namespace, request).status.token)
    write_kubeconfig(path, server=kube.server, ca_cert=kube.cluster.layout.pki.ca_cert,
                     user=f"system:serviceaccount:{namespace}:{account}", token=token, cluster_name=kube.cluster.name)
    return token


@pytest.fixture(scope="module")
def module_namespace(kube: ClusterClient) -> Iterator[str]:
    """One namespace for the module's tests (they share one set-up), removed as conftest's `namespace` is."""
    name = unique("e2e-status")
    kube.core.create_namespace({"metadata": {"name": name}})
    yield name
    kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    kube.core.delete_namespace(name)
    try:
        kube.core.replace_namespace_finalize(name, {"metadata": {"name": name}, "spec": {"finalizers": []}})
    except client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture(scope="module")
def setup(kube: ClusterClient, module_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    namespace = module_namespace
    tmp_path = tmp_path_factory.mktemp("status")
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    scheduling = client.SchedulingV1Api(kube.api_client)
    role = unique("gpupool-status-reader")
    pool = unique("status")
    classes = {unique("status-high"): 1_000_000, unique("status-low"): 100}
    nodes: list[str] = []
    scheduler = None
    rbac.create_cluster_role({"metadata": {"name": role}, "rules": READ_RULES})
    try:
        for name, value in classes.items():
            scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
        token = token_kubeconfig(kube, namespace, "status-reader", tmp_path / "reader.kubeconfig")
        token_kubeconfig(kube, namespace, "nobody", tmp_path / "nobody.kubeconfig")
        rbac.create_cluster_role_binding({
            "metadata": {"name": role}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                    "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "status-reader", "namespace": namespace}],
        })
        nodes = add_pool_nodes(kube, pool, "dgx-h100", 2) + add_pool_nodes(kube, pool, "a100-mig", 1)
        scheduler = start_scheduler(kube, unique("gpupool"), tmp_path)
        high, low = sorted(classes, key=classes.__getitem__, reverse=True)
        bound = [
            pod("train-4", scheduler.name, pool, gpus=4, priority_class=high),
            pod("train-2", scheduler.name, pool, gpus=2, priority_class=low),
            pod("whole-1", scheduler.name, pool, gpus=1),
            pod("inf-10", scheduler.name, pool, units=10),
            pod("inf-20", scheduler.name, pool, units=20, priority_class=low),
            pod("inf-30", scheduler.name, pool, units=30),
            pod("mig-1g", scheduler.name, pool, mig={"1g.10gb": 1}),
            pod("mig-3g", scheduler.name, pool, mig={"3g.40gb": 1}),
            pod("cpu-only", scheduler.name, pool, cpu="2"),
        ]
        create_pods(kube.core, namespace, bound)
        pods = wait_bound(kube, namespace, len(bound), timeout_s=120)
        created: dict[str, float] = {}
        nowhere = unique("no-such-pool")  # no node has it: these stay pending
        for name, cls in (("p-high-0", high), ("p-high-1", high), ("p-low-0", low)):
            create_pods(kube.core, namespace, [pod(name, scheduler.name, nowhere, gpus=1, priority_class=cls)])
            created[name] = time.time()
            time.sleep(1.1)  # creation timestamps have whole seconds: make the oldest one unambiguous
        yield Setup(pool, nodes, classes, scheduler, pods, tmp_path / "reader.kubeconfig",
                    tmp_path / "nobody.kubeconfig", token, created)
    finally:
        if scheduler is not None:
            scheduler.stop()
        if nodes:
            kube.delete_nodes(nodes)
        for name in classes:
            with contextlib.suppress(client.ApiException):
                scheduling.delete_priority_class(name)
        for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            with contextlib.suppress(client.ApiException):
                delete(role)


def status_cmd(*args: str, kubeconfig: Path | None = None, env_kubeconfig: Path | None = None,
               script: str = "gpupool") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    if env_kubeconfig is not None:
        env["KUBECONFIG"] = str(env_kubeconfig)
    flags = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
    return subprocess.run([str(BIN / script), "status", *flags, *args], capture_output=True, text=True,
                          timeout=120, env=env)


def can_i(kube: ClusterClient, token: str, verb: str, resource: str, group: str = "") -> bool:
    """SelfSubjectAccessReview as the token's user."""
    configuration = client.Configuration()
    configuration.host = kube.api_client.configuration.host
    configuration.ssl_ca_cert = str(kube.cluster.layout.pki.ca_cert)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as api:
        review = client.AuthorizationV1Api(api).create_self_subject_access_review(
            {"spec": {"resourceAttributes": {"verb": verb, "resource": resource, "group": group}}})
    return bool(review.status.allowed)


def expected_fragmentation(kube: ClusterClient, setup: Setup) -> tuple[float, float]:
    """(fragmentation %, allocated %) of the pool by the placement core, on a snapshot built here from
    the nodes' inventories and the pods' assignment annotations, with the scheduler's prior profile."""
    specs = []
    for name in setup.nodes:
        obj = read_json(kube.core.read_node(name, _preload_content=False))
        inventory = parse_inventory(obj["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
        alloc = obj["status"]["allocatable"]
        gpus = tuple(GpuSpec(g.index, g.product, memory_mib=g.memory_mib // UNIT_MIB * UNIT_MIB, uuid=g.uuid,
                             numa_node=g.numa_node, mig_enabled=g.mig_enabled,
                             mig_slices=tuple(MigSlice(d.uuid, d.profile, g.index) for d in g.mig_devices)
                             if g.mig_enabled else ())
                     for g in inventory.gpus)
        specs.append(NodeSpec(name, cpu_milli=int(parse_quantity(alloc["cpu"]) * 1000),
                              memory_mib=int(parse_quantity(alloc["memory"]) // 2**20), gpus=gpus,
                              max_pods=int(alloc["pods"])))
    snap = ClusterSnapshot(specs)
    by_node = {s.name: s for s in specs}
    gpus_held, migs_held = device_use(kube, setup.pods)
    holdings: dict[str, list[Placement]] = {}
    for (node, uuid), use in gpus_held.items():
        gpu = next(g for g in by_node[node].gpus if g.uuid == uuid)
        for key in use.whole:
            holdings.setdefault(key, []).append(Placement(node, (gpu.index,), 1000, gpu.memory_mib))
        for key, units in use.units.items():
            mib = units * UNIT_MIB
            holdings.setdefault(key, []).append(
                Placement(node, (gpu.index,), min(1000, max(1, mib * 1000 // gpu.memory_mib)), mib))
    for (node, uuid), keys in migs_held.items():
        holdings.setdefault(keys[0], []).append(Placement(node, mig_devices=(uuid,)))
    for p in setup.pods:
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        cpu = int(parse_quantity(p["spec"]["containers"][0]["resources"]["requests"]["cpu"]) * 1000)
        parts = holdings.get(key, [])
        node = p["spec"]["nodeName"]
        if not parts:
            snap.assume(PodRequest(key, cpu_milli=cpu, memory_mib=64), Placement(node))
        elif parts[0].mig_devices:
            profile = next(s.profile for g in by_node[node].gpus for s in g.mig_slices
                           if s.uuid in parts[0].mig_devices)
            snap.assume(PodRequest(key, cpu_milli=cpu, memory_mib=64, mig_profile=profile, mig_count=1), parts[0])
        elif parts[0].gpu_milli == 1000:
            indices = tuple(sorted(i for part in parts for i in part.gpu_indices))
            whole = Placement(node, indices, 1000, parts[0].gpu_memory_mib)
            snap.assume(PodRequest(key, cpu_milli=cpu, memory_mib=64, gpu_count=len(indices), gpu_milli=1000), whole)
        else:
            share = parts[0]
            snap.assume(PodRequest(key, cpu_milli=cpu, memory_mib=64, gpu_count=1,
                                   gpu_memory_mib=share.gpu_memory_mib), share)
    total = snap.total_gpu_milli
    frag = cluster_fragmentation_milli(snap, default_prior())
    return 100.0 * frag / total, 100.0 * snap.used_gpu_milli() / total


def test_status_with_read_only_rights(kube: ClusterClient, setup: Setup) -> None:
    # the user really has read rights only
    assert can_i(kube, setup.reader_token, "list", "pods") and can_i(kube, setup.reader_token, "get", "nodes")
    for verb, resource, group in (("watch", "pods", ""), ("watch", "nodes", ""), ("get", "leases",
                                  "coordination.k8s.io"), ("create", "pods/binding", ""), ("patch", "nodes", "")):
        assert not can_i(kube, setup.reader_token, verb, resource, group), f"the reader may {verb} {resource}"

    started = time.time()
    done = status_cmd("--selector", f"{POOL_LABEL}={setup.pool}", "--scheduler-name", setup.scheduler.name,
                      "--output", "json", kubeconfig=setup.reader)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    status = json.loads(done.stdout)

    # per node and GPU, against the assignment annotations and the inventories
    gpus_held, migs_held = device_use(kube, setup.pods)
    nodes = {n["name"]: n for n in status["nodes"]}
    assert sorted(nodes) == sorted(setup.nodes)
    inventories: dict[str, NodeInventory] = {}
    for name in setup.nodes:
        obj = read_json(kube.core.read_node(name, _preload_content=False))
        inventories[name] = parse_inventory(obj["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
    for name, inventory in inventories.items():
        n = nodes[name]
        assert n["gpus"] == len(inventory.gpus) == len(n["gpu_list"])
        whole = shared = mig = units = 0
        for g, got in zip(inventory.gpus, n["gpu_list"], strict=True):
            use = gpus_held.get((name, g.uuid))
            assert (got["index"], got["uuid"], got["model"], got["health"]) == (g.index, g.uuid, g.product, "healthy")
            if g.mig_enabled:
                mig += 1
                assert got["use"] == "mig"
                assert [(s["uuid"], s["profile"]) for s in got["mig"]] == [(d.uuid, d.profile) for d in g.mig_devices]
                for s in got["mig"]:
                    holders = migs_held.get((name, s["uuid"]), [])
                    assert s["pod"] == (holders[0] if holders else None)
            elif use is not None and use.whole:
                whole += 1
                assert (got["use"], got["pods"]) == ("whole", use.whole)
            elif use is not None and use.units:
                shared += 1
                assert (got["use"], got["memory_units_used"]) == ("shared", sum(use.units.values()))
                assert got["pods"] == sorted(use.units)
                units += sum(use.units.values())
            else:
                assert (got["use"], got["pods"], got["memory_units_used"]) == ("free", [], 0)
            if not g.mig_enabled:
                assert got["memory_units_total"] == g.memory_mib // UNIT_MIB
        assert (n["whole"], n["shared"], n["mig"], n["memory_units_used"]) == (whole, shared, mig, units)
        assert n["free"] == n["gpus"] - whole - shared - mig
        assert n["mig_slices_used"] == sum(1 for (node, _), _pods in migs_held.items() if node == name)
    t = status["totals"]
    assert (t["nodes"], t["gpus"]) == (3, 24)
    assert t["whole"] == 4 + 2 + 1
    assert t["memory_units_used"] == 10 + 20 + 30
    assert t["shared"] == len({g for (node, g), u in gpus_held.items() if u.units})
    assert t["mig"] == sum(1 for inv in inventories.values() for g in inv.gpus if g.mig_enabled) > 0
    assert t["mig_slices_used"] == 2
    assert t["memory_units_total"] == sum(g.memory_mib // UNIT_MIB for inv in inventories.values()
                                          for g in inv.gpus if not g.mig_enabled)

    # pending pods by priority: the test's classes (other pending pods of the cluster may be listed too)
    high, low = sorted(setup.classes, key=setup.classes.__getitem__, reverse=True)
    groups = {g["priority_class"]: g for g in status["pending"]}
    assert (groups[high]["priority"], groups[high]["pods"]) == (1_000_000, 2)
    assert (groups[low]["priority"], groups[low]["pods"]) == (100, 1)
    namespace = setup.pods[0]["metadata"]["namespace"]
    assert groups[high]["oldest_pod"] == f"{namespace}/p-high-0"
    age = time.time() - setup.created["p-high-0"]
    assert age - 2.5 <= groups[high]["oldest_age_seconds"] <= age + 1.5
    priorities = [g["priority"] for g in status["pending"]]
    assert priorities == sorted(priorities, reverse=True)

    # fragmentation: the placement core's figure on the same cluster, computed here
    frag, allocated = expected_fragmentation(kube, setup)
    f = status["fragmentation"]
    assert f["profile"] == "prior" and f["pods_observed"] == len(setup.pods) + 3
    assert frag > 0
    assert f["percent"] == pytest.approx(frag, abs=1e-9)
    assert f["allocated_percent"] == pytest.approx(allocated, abs=1e-9)
    assert status["selector"] == f"{POOL_LABEL}={setup.pool}"
    assert time.time() - started < 60


def test_table_and_kubectl_plugin(kube: ClusterClient, setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    selector = f"{POOL_LABEL}={setup.pool}"
    dgx = setup.nodes[2]  # the A100 node: MIG layout, whole and shared GPUs in one listing
    # kubectl runs `kubectl-gpupool status ...` with the user's environment: $KUBECONFIG, no flag
    table = status_cmd("--selector", selector, "--scheduler-name", setup.scheduler.name, "--node", dgx,
                       env_kubeconfig=setup.reader, script="kubectl-gpupool")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(line for line in lines if len(line) > 80)
    for name in setup.nodes:
        assert any(line.startswith(name) for line in lines), name
    assert any(line.startswith(f"node {dgx}:") for line in lines)
    uses = ("whole", "shared", "free", "mig")
    gpu_lines = [line for line in lines if line[:5].strip().isdigit() and line.split()[1] in uses]
    assert len(gpu_lines) == 8
    as_json = json.loads(status_cmd("--selector", selector, "--scheduler-name", setup.scheduler.name, "-o", "json",
                                    env_kubeconfig=setup.reader, script="kubectl-gpupool").stdout)
    assert as_json["totals"]["gpus"] == 24
    with capsys.disabled():  # the worked example of docs/status.md comes from here
        print(f"\n$ kubectl gpupool status -l {selector} --node {dgx}\n{table.stdout}")


def test_status_without_rights_is_one_line(setup: Setup) -> None:
    done = status_cmd(kubeconfig=setup.nobody)
    assert done.returncode == 2, done
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("gpupool status: error: listing priorityclasses failed: 403 Forbidden")
    assert "needs get/list on nodes, pods and priorityclasses" in lines[0]


def test_unknown_node_is_an_error(setup: Setup) -> None:
    done = status_cmd("--selector", f"{POOL_LABEL}={setup.pool}", "--node", "no-such-node", kubeconfig=setup.reader)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"gpupool status: error: no node 'no-such-node' matching "
                                   f"'{POOL_LABEL}={setup.pool}'")
