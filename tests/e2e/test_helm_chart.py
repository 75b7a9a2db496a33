"""The Helm chart (deploy/helm/gpupool) on the local control plane, installed with the pinned helm.

No container runs here (no Docker; kwok nodes at most), so the proof runs the chart's programs as local
processes with the chart's identities: each process gets a kubeconfig holding a token of the chart's
ServiceAccount (TokenRequest API, RBAC on), never admin, and the command line of the chart's own
Deployment / DaemonSet (read back from the API server, `$(VAR)` expanded as the kubelet would, from
the chart's ConfigMaps). Only the kubelet-side paths, the metrics ports and the kubeconfig are local.

* `test_chart_identities_do_the_whole_job`: two scheduler replicas (one holds the Lease) and the device
  plugin (fake NVML behind the kubelet stand-in) publish the inventory and labels, bind pods with
  assignments, write acks, post Events, mark an impossible pod unschedulable; then every (verb, resource)
  the chart's Roles grant is compared with the kube-apiserver's audit log of those ServiceAccounts.
* `test_upgrade_and_uninstall_leave_nothing_behind`: every kind the chart creates, listed before
  install, after install, after an upgrade with changed values, after uninstall.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import parse_ack, parse_assignment
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import discard, read_json
from tests.support.chart import (
    CHART,
    PROFILE,
    bare_gpu_node,
    helm,
    one_container,
    service_account_kubeconfig,
    start_chart_plugin,
    start_chart_scheduler,
)
from tests.support.kubelet_standin import KubeletStandin
from tests.support.node_kubelet import NodeKubelet
from tests.support.scheduler_harness import events_for, list_pods, pod, wait_until

GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"

# Granted (apiGroup, resource, verb) that the run below does not exercise, each with the reason it is
# granted anyway. Everything else the chart grants must show up in the audit log.
NOT_EXERCISED: dict[str, dict[tuple[str, str, str], str]] = {
    "scheduler": {
        # preemption only: evict the victims (Eviction API) of a higher-priority pod; the preemption
        # path is proven with admin credentials in tests/e2e/test_preemption.py
        ("", "pods/eviction", "create"): "preemption victims",
        # gangs only: the status of a PodGroup (phase, scheduled, running); proven in the gang e2e tests
        ("scheduling.x-k8s.io", "podgroups/status", "patch"): "PodGroup status",
        # quotas only: the status of a GpuQuota (used, borrowed, conditions); proven in
        # tests/scheduler/test_quotas.py and tests/e2e/test_quotas.py
        ("gpupool.io", "gpuquotas/status", "patch"): "GpuQuota status",
        # the count of a FailedScheduling repeated a minute or more after it was posted;
        # proven against a real HTTP server in tests/scheduler/test_recorder.py
        ("", "events", "patch"): "repeated FailedScheduling count",
        # make-before-break migration only (gpupool.io/migrate: surge): a mover's ReplicaSet and Deployment,
        # the namespace's HPAs, the Deployment's scale, the deletion cost of the pod that goes; proven in
        # tests/scheduler/test_defrag.py and tests/e2e/test_defrag.py; elastic inference reads and scales an
        # elastic Deployment and sets its given-back replicas' deletion cost through the same grants (no elastic
        # Deployment in this run; proven in tests/scheduler/test_elastic.py and tests/e2e/test_elastic.py)
        ("apps", "replicasets", "get"): "surge: the ReplicaSet's Deployment",
        ("apps", "deployments", "get"): "surge: the Deployment's annotation and rollout",
        ("apps", "deployments/scale", "patch"): "surge: one replica more, and back",
        ("apps", "replicasets", "patch"): "surge: its record on the mover's ReplicaSet (gpupool.io/surge)",
        # a leader's look for surges left unfinished (only with --defrag on, and it may not have come yet)
        ("apps", "replicasets", "list"): "surge: the ReplicaSets labelled gpupool.io/surging",
        # elastic inference with an HPA on the Deployment only: its maxReplicas read and moved; proven in
        # tests/scheduler/test_elastic.py and tests/e2e/test_elastic.py (HPAs are listed and watched in every run)
        ("autoscaling", "horizontalpodautoscalers", "get"): "elastic: the HPA's maxReplicas, read",
        ("autoscaling", "horizontalpodautoscalers", "patch"): "elastic: the HPA's maxReplicas, lent and lowered",
        ("", "pods", "patch"): "surge's pod-deletion-cost; a migration's record of its holds on the blocked pod",
    },
    "deviceplugin": {},
}


# ---- the audit log -----------------------------------------------------------------------------------
def audit_events(kube: ClusterClient, users: set[str]) -> list[dict[str, Any]]:
    path = kube.cluster.audit_log
    assert path.is_file(), (f"no audit log at {path}: this dev cluster was started without it (before the "
                            "audit option existed?); restart it (make cluster-down && make cluster-up) or run "
                            "with GPUPOOL_E2E_FRESH=1")
    found = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("user", {}).get("username") in users:
            found.append(event)
    return found


def used_by(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    used = set()
    for event in events:
        ref = event.get("objectRef")
        if not ref:
            continue  # discovery and other non-resource URLs
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, event["verb"]))
    return used


def denied(events: list[dict[str, Any]]) -> list[str]:
    return sorted({f"{e['verb']} {e['requestURI']}" for e in events
                   if e.get("responseStatus", {}).get("code") == 403})


def granted_to(kube: ClusterClient, namespace: str, account: str) -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the RBAC objects of the cluster grant to one ServiceAccount."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)

    def bound(binding: dict[str, Any]) -> bool:
        return any(s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace") == namespace
                   for s in binding.get("subjects") or ())

    rules: list[dict[str, Any]] = []
    for binding in read_json(rbac.list_cluster_role_binding(_preload_content=False))["items"]:
        if bound(binding):
            rules += read_json(rbac.read_cluster_role(binding["roleRef"]["name"], _preload_content=False))["rules"]
    for binding in read_json(rbac.list_role_binding_for_all_namespaces(_preload_content=False))["items"]:
        if bound(binding):
            ref, where = binding["roleRef"], binding["metadata"]["namespace"]
            role = (rbac.read_cluster_role(ref["name"], _preload_content=False) if ref["kind"] == "ClusterRole"
                    else rbac.read_namespaced_role(ref["name"], where, _preload_content=False))
            rules += read_json(role)["rules"]
    granted = set()
    for rule in rules:
        assert "*" not in rule["verbs"] + rule.get("resources", []) + rule.get("apiGroups", []), f"wildcard: {rule}"
        assert not rule.get("nonResourceURLs"), f"non-resource URLs granted: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


# ---- the whole job -------------------------------------------------------------------------------------
@contextlib.contextmanager
def installed(kube: ClusterClient, release: str, namespace: str, *values: str) -> Iterator[None]:
    helm(kube, "install", release, str(CHART), "--namespace", namespace, "--wait=false", *values)
    try:
        yield
    finally:
        helm(kube, "uninstall", release, "--namespace", namespace, check=False)


def test_chart_identities_do_the_whole_job(kube: ClusterClient, namespace: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    release, scheduler_name, pool = f"gp-{tag}", f"helm-{tag}", f"helm-{tag}"
    apps = client.AppsV1Api(kube.api_client)
    with installed(kube, release, namespace, "--set", f"schedulerName={scheduler_name}",
                   "--set", f"devicePlugin.fakeNvmlProfile={PROFILE}", "--set", "scheduler.gateTimeoutSeconds=20"):
        fullname = f"{release}-gpupool"
        deployment = kube.api_client.sanitize_for_serialization(apps.read_namespaced_deployment(
            f"{fullname}-scheduler", namespace))
        daemonset = kube.api_client.sanitize_for_serialization(apps.read_namespaced_daemon_set(
            f"{fullname}-deviceplugin", namespace))
        assert deployment["spec"]["replicas"] == 2 and "--leader-elect" in one_container(deployment)["args"]
        sched_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        plugin_account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
        users = {
            "scheduler": service_account_kubeconfig(kube, namespace, sched_account, tmp_path / "scheduler.kubeconfig"),
            "deviceplugin": service_account_kubeconfig(kube, namespace, plugin_account, tmp_path / "plugin.kubeconfig"),
        }
        node = f"{pool}-n0"
        bare_gpu_node(kube, node, pool)
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: discard(kube.core.delete_node(node, _preload_content=False)))
            short = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gph-")))  # short socket paths
            kubelet_dir = short / "device-plugins"
            kubelet_dir.mkdir()
            standin = KubeletStandin(kubelet_dir)
            standin.start()
            stack.callback(standin.stop)
            plugin = start_chart_plugin(kube, namespace, daemonset, tmp_path / "plugin.kubeconfig", node,
                                        kubelet_dir, tmp_path)
            stack.callback(plugin.stop)
            standin.wait_registered({GPU, MEM}, timeout=30)
            plugin.wait_healthz(200, timeout=30)

            # inventory and labels published by the plugin's identity
            def published() -> dict[str, Any] | None:
                obj = read_json(kube.core.read_node(node, _preload_content=False))
                meta = obj["metadata"]
                ok = INVENTORY_ANNOTATION in meta.get("annotations", {}) and "nvidia.com/gpu.product" in meta["labels"]
                return obj if ok else None
            node_obj = wait_until(published, 30, "inventory annotation and GPU labels on the node", interval=0.1)
            inventory = parse_inventory(node_obj["metadata"]["annotations"][INVENTORY_ANNOTATION])
            assert len(inventory.gpus) == 4
            assert node_obj["metadata"]["labels"]["nvidia.com/gpu.count"] == "4"

            kubelet = NodeKubelet(kube, node, standin)
            kubelet.start()
            stack.callback(kubelet.stop)
            replicas = [start_chart_scheduler(kube, namespace, deployment, tmp_path / "scheduler.kubeconfig",
                                              f"{fullname}-scheduler-{i}", tmp_path) for i in range(2)]
            for replica in replicas:
                stack.callback(replica.stop)

            # Lease held by one replica
            coordination = client.CoordinationV1Api(kube.api_client)
            lease_name = f"{scheduler_name}-scheduler"

            def holder() -> str | None:
                try:
                    return coordination.read_namespaced_lease(lease_name, namespace).spec.holder_identity or None
                except ApiException as exc:
                    if exc.status == 404:
                        return None
                    raise
            leader = wait_until(holder, 30, f"Lease {namespace}/{lease_name} held")
            assert leader in {r.name for r in replicas}

            # pods bound with assignments, acked by the plugin; Events posted; the chart's priority classes
            pods = {
                "train": pod("train", scheduler_name, pool, gpus=2, priority_class="training"),
                "serve": pod("serve", scheduler_name, pool, units=8, priority_class="inference"),
                "huge": pod("huge", scheduler_name, pool, gpus=8, priority_class="best-effort"),
            }
            for body in pods.values():
                discard(kube.core.create_namespaced_pod(namespace, body, _preload_content=False))

            def acked() -> dict[str, dict[str, Any]] | None:
                found = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
                done = all(parse_ack(found[n]["metadata"].get("annotations")) is not None for n in ("train", "serve"))
                return found if done else None
            found = wait_until(acked, 60, "train and serve bound and acked", interval=0.2)
            for name in ("train", "serve"):
                annotations = found[name]["metadata"]["annotations"]
                assignment, ack = parse_assignment(annotations), parse_ack(annotations)
                assert assignment is not None and ack is not None and ack.complete and not ack.error, name
                assert found[name]["spec"]["nodeName"] == node == assignment.node == ack.node
            assert found["train"]["spec"]["priority"] == 100000 and found["serve"]["spec"]["priority"] == 10000
            wait_until(lambda: events_for(kube, namespace, "train", "Scheduled"), 15, "a Scheduled event")

            def unschedulable() -> bool:
                huge = read_json(kube.core.read_namespaced_pod("huge", namespace, _preload_content=False))
                conditions = huge["status"].get("conditions") or ()
                return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)
            wait_until(unschedulable, 30, "huge marked Unschedulable", interval=0.2)
            wait_until(lambda: events_for(kube, namespace, "huge", "FailedScheduling"), 15, "a FailedScheduling event")
            assert not found["huge"]["spec"].get("nodeName")

            # leadership moves: the standby takes the Lease when the leader stops (and releases it)
            (leading,) = [r for r in replicas if r.name == leader]
            leading.stop()
            wait_until(lambda: holder() not in (None, leader), 30, "the standby replica holds the Lease")
            for replica in replicas:
                replica.stop()
            plugin.stop()

        # RBAC: everything granted is used, nothing used is denied
        report = []
        for part, account in (("scheduler", sched_account), ("deviceplugin", plugin_account)):
            events = audit_events(kube, {users[part]})
            assert events, f"no audit events of {users[part]}"
            granted = granted_to(kube, namespace, account)
            used = used_by(events)
            allowed = NOT_EXERCISED[part]
            assert set(allowed) <= granted, f"{part}: allow-list names grants the chart no longer makes: " \
                                            f"{sorted(set(allowed) - granted)}"
            unused = granted - used - set(allowed)
            assert not unused, f"{part}: the chart grants {sorted(unused)}, never used in this run"
            assert not denied(events), f"{part}: requests refused by RBAC: {denied(events)}"
            assert used <= granted, f"{part}: used without a grant: {sorted(used - granted)}"
            report.append(f"{part}: {len(events)} audited requests, {len(granted)} grants, all used"
                          f"{' or allow-listed' if allowed else ''}")
        print("\n".join(report))


# ---- upgrade and uninstall ----------------------------------------------------------------------------
# Every kind the chart can create (any values), by list path; {ns} is the release namespace.
NAMESPACED = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Secret": "/api/v1/namespaces/{ns}/secrets",  # helm's release records
    "DaemonSet": "/apis/apps/v1/namespaces/{ns}/daemonsets",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ServiceMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors",
    "PrometheusRule": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/prometheusrules",
}
CLUSTER = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "PriorityClass": "/apis/scheduling.k8s.io/v1/priorityclasses",
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
}
PODGROUP_CRD = "podgroups.scheduling.x-k8s.io"
GPUQUOTA_CRD = "gpuquotas.gpupool.io"
# The Prometheus Operator is not installed here: two small CRDs stand in for its ServiceMonitor and
# PrometheusRule kinds, so the API server stores the chart's objects (their schema is not checked).
MONITORING_KINDS = (("ServiceMonitor", "servicemonitors"), ("PrometheusRule", "prometheusrules"))


def list_names(kube: ClusterClient, path: str) -> set[str] | None:
    """Names of the objects at a list path; None when the kind is not served (404)."""
    method, url, headers, body, post = kube.api_client.param_serialize(
        method="GET", resource_path=path, auth_settings=["BearerToken"])
    answer = kube.api_client.call_api(method, url, header_params=headers, body=body, post_params=post)
    answer.read()
    if answer.status == 404:
        return None
    assert answer.status == 200, f"GET {path}: {answer.status}"
    return {item["metadata"]["name"] for item in json.loads(answer.data)["items"]}


def inventory(kube: ClusterClient, namespace: str) -> set[tuple[str, str]]:
    """(kind, name) of every object of the chart's kinds in the namespace and in the cluster."""
    paths = [(kind, path.format(ns=namespace)) for kind, path in NAMESPACED.items()] + list(CLUSTER.items())
    return {(kind, name) for kind, path in paths for name in list_names(kube, path) or ()}


def manifest_objects(kube: ClusterClient, release: str, namespace: str) -> set[tuple[str, str]]:
    """(kind, name) of what the release's manifest says it made, plus helm's record of each revision."""
    manifest = helm(kube, "get", "manifest", release, "--namespace", namespace).stdout
    made = {(doc["kind"], doc["metadata"]["name"]) for doc in yaml.safe_load_all(manifest) if doc}
    history = json.loads(helm(kube, "history", release, "--namespace", namespace, "-o", "json").stdout)
    return made | {("Secret", f"sh.helm.release.v1.{release}.v{h['revision']}") for h in history}


@contextlib.contextmanager
def monitoring_crds(kube: ClusterClient) -> Iterator[None]:
    api = client.ApiextensionsV1Api(kube.api_client)
    made = []
    for kind, plural in MONITORING_KINDS:
        name = f"{plural}.monitoring.coreos.com"
        body = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": name},
                "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                         "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                                   "listKind": f"{kind}List"},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                             "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
        try:
            discard(api.create_custom_resource_definition(body, _preload_content=False))
            made.append(name)
        except ApiException as exc:
            if exc.status != 409:
                raise
    for _, plural in MONITORING_KINDS:
        path = f"/apis/monitoring.coreos.com/v1/{plural}"
        wait_until(lambda path=path: list_names(kube, path) is not None, 30, f"{path} served", interval=0.2)
    try:
        yield
    finally:
        for name in made:
            discard(api.delete_custom_resource_definition(name, _preload_content=False))


# What kube-controller-manager (when a test session runs it) puts into every new namespace by itself.
NAMESPACE_DEFAULTS = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}


def test_upgrade_and_uninstall_leave_nothing_behind(kube: ClusterClient, namespace: str) -> None:
    tag = uuid.uuid4().hex[:6]
    release = f"gp-{tag}"
    fullname = f"{release}-gpupool"
    crds = {("CustomResourceDefinition", PODGROUP_CRD), ("CustomResourceDefinition", GPUQUOTA_CRD)}
    base = ["--set", f"schedulerName=helm-{tag}", "--set", "metrics.serviceMonitor.enabled=true",
            "--set", "prometheusRule.enabled=true"]
    apps = client.AppsV1Api(kube.api_client)
    crds_there = crds & inventory(kube, namespace)
    try:
        with monitoring_crds(kube):
            before = inventory(kube, namespace)
            helm(kube, "install", release, str(CHART), "--namespace", namespace, *base)
            installed = inventory(kube, namespace) - NAMESPACE_DEFAULTS
            made = manifest_objects(kube, release, namespace)
            assert installed - before - crds == made, (
                f"in the cluster, not in the manifest: {sorted(installed - before - crds - made)}; "
                f"in the manifest, not in the cluster: {sorted(made - installed)}")
            assert crds <= installed, "the chart's crds/ (PodGroup, GpuQuota) were not installed"
            assert {kind for kind, _ in made} == set(NAMESPACED) | set(CLUSTER) - {"CustomResourceDefinition"}
            assert {name for kind, name in made if kind == "PriorityClass"} == {
                "train-critical", "training", "inference", "best-effort"}
            scheduling = client.SchedulingV1Api(kube.api_client)
            assert scheduling.read_priority_class("train-critical").value == 1_000_000

            # the alert rules and the dashboard are the chart's files, unchanged
            rules = client.CustomObjectsApi(kube.api_client).get_namespaced_custom_object(
                "monitoring.coreos.com", "v1", namespace, "prometheusrules", fullname)
            assert rules["spec"]["groups"] == yaml.safe_load((CHART / "files" / "gpupool-alerts.yaml").read_text())[
                "groups"]
            dashboard = kube.core.read_namespaced_config_map(f"{fullname}-dashboard", namespace)
            assert dashboard.metadata.labels["grafana_dashboard"] == "1"
            assert json.loads(dashboard.data["gpupool-dashboard.json"]) == json.loads(
                (CHART / "files" / "gpupool-dashboard.json").read_text())
            checksum = apps.read_namespaced_deployment(f"{fullname}-scheduler", namespace) \
                .spec.template.metadata.annotations["checksum/policy"]

            # upgrade with changed values: a new policy, more replicas, one tier and the dashboard off,
            # the extender on
            helm(kube, "upgrade", release, str(CHART), "--namespace", namespace, *base,
                 "--set", "scheduler.policy=best-fit", "--set", "scheduler.replicas=3",
                 "--set", "priorityClasses.classes.best-effort.enabled=false",
                 "--set", "grafanaDashboard.enabled=false", "--set", "extender.enabled=true")
            upgraded = inventory(kube, namespace) - NAMESPACE_DEFAULTS
            made = manifest_objects(kube, release, namespace)
            assert upgraded - before - crds == made, (
                f"left over or unexpected: {sorted(upgraded - before - crds - made)}; "
                f"missing: {sorted(made - upgraded)}")
            assert ("PriorityClass", "best-effort") not in upgraded
            assert ("ConfigMap", f"{fullname}-dashboard") not in upgraded
            assert {("Deployment", f"{fullname}-extender"), ("Service", f"{fullname}-extender"),
                    ("ServiceAccount", f"{fullname}-extender"),
                    ("ClusterRoleBinding", f"{fullname}-extender")} <= upgraded
            extender = apps.read_namespaced_deployment(f"{fullname}-extender", namespace)
            assert extender.spec.replicas == 1 and extender.spec.strategy.type == "Recreate"  # one writer
            policy = kube.core.read_namespaced_config_map(f"{fullname}-scheduler-policy", namespace).data
            assert policy["policy"] == "best-fit"
            deployment = apps.read_namespaced_deployment(f"{fullname}-scheduler", namespace)
            assert deployment.spec.replicas == 3
            assert deployment.spec.template.metadata.annotations["checksum/policy"] != checksum, \
                "a policy change must roll the scheduler pods"

            helm(kube, "uninstall", release, "--namespace", namespace)
            after = inventory(kube, namespace) - NAMESPACE_DEFAULTS
            # helm keeps the CRDs of crds/ on purpose (deleting one deletes every PodGroup in the cluster)
            assert after - before <= crds, f"left behind by helm uninstall: {sorted(after - before - crds)}"
            assert before - NAMESPACE_DEFAULTS - after == set(), f"removed: {sorted(before - after)}"
    finally:
        helm(kube, "uninstall", release, "--namespace", namespace, check=False)
        for _, name in crds - crds_there:
            with contextlib.suppress(ApiException):
                client.ApiextensionsV1Api(kube.api_client).delete_custom_resource_definition(name)
