"""The Helm chart (deploy/helm/gpupool) run without containers, as the chart e2e test and the demo's node
agent run it: the pinned helm against the dev cluster, kubeconfigs holding a token of one of the chart's
ServiceAccounts (never admin), and the chart's own scheduler Deployment and device plugin DaemonSet started
as local processes with the command lines the chart gives them (read back from the API server, `$(VAR)`
expanded as the kubelet would, from the chart's ConfigMaps); only the kubelet-side paths, the metrics ports
and the kubeconfig are local. Plus the bare Node a kubelet registers before the plugin has run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from gpupool_common.inventory import INVENTORY_ANNOTATION
from gpupool_devcluster.binaries import helm_binary, repo_root
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_devcluster.kubeconfig import write_kubeconfig
from gpupool_devcluster.raw import discard
from gpupool_deviceplugin.publication import OWNED_LABELS
from tests.support.plugin_process import PluginProcess, plugin_command
from tests.support.ports import free_port
from tests.support.scheduler_harness import POOL_LABEL, SchedulerProcess

CHART = repo_root() / "deploy" / "helm" / "gpupool"
PROFILE = "l40s-pcie"  # the nodes of bare_gpu_node: 4 GPUs of 44 GiB, no MIG
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def helm(kube: ClusterClient, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(helm_binary()), "--kubeconfig", str(kube.kubeconfig), *args],
                          capture_output=True, text=True, timeout=180)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


def service_account_kubeconfig(kube: ClusterClient, namespace: str, account: str, path: Path) -> str:
    """A kubeconfig with a fresh token of `account` (TokenRequest); returns the audit user name."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = kube.core.create_namespaced_service_account_token(account, namespace, request).status.token
    user = f"system:serviceaccount:{namespace}:{account}"
    write_kubeconfig(path, server=kube.server, ca_cert=kube.cluster.layout.pki.ca_cert, user=user, token=token,
                     cluster_name=kube.cluster.name)
    return user


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of container args (unknown names stay as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(kube: ClusterClient, namespace: str, container: dict[str, Any], field_values: dict[str, str]) -> \
        dict[str, str]:
    """A container's environment as the kubelet would build it: literal values, ConfigMap keys, and the
    downward API fields given in `field_values`."""
    env: dict[str, str] = {}
    for var in container.get("env") or ():
        source = var.get("valueFrom") or {}
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = kube.core.read_namespaced_config_map(ref["name"], namespace).data[ref["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = field_values[source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"env {var['name']}: source {source} not handled here")
    return env


def one_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


# ---- the chart's programs, run locally -------------------------------------------------------------
def start_chart_scheduler(kube: ClusterClient, namespace: str, deployment: dict[str, Any], kubeconfig: Path,
                          pod_name: str, log_dir: Path) -> SchedulerProcess:
    container = one_container(deployment)
    assert container["command"] == ["gpupool", "scheduler"], container["command"]
    env = container_env(kube, namespace, container, {"metadata.name": pod_name, "metadata.namespace": namespace})
    port = free_port()
    args = [expand(a, env) for a in container["args"]]
    assert not any(_VAR.search(a) for a in args), f"unexpanded variables in {args}"
    argv = [str(Path(sys.executable).parent / "gpupool"), "scheduler", *args,
            "--metrics-port", str(port), "--metrics-address", "127.0.0.1", "--kubeconfig", str(kubeconfig)]
    log = log_dir / f"{pod_name}.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                   env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"})
    proc = SchedulerProcess(pod_name, port, process, log, argv)
    proc.wait_ready()
    return proc


def start_chart_plugin(kube: ClusterClient, namespace: str, daemonset: dict[str, Any], kubeconfig: Path,
                       node: str, kubelet_dir: Path, workdir: Path) -> PluginProcess:
    container = one_container(daemonset)
    assert container["command"] == ["gpupool-deviceplugin"], container["command"]
    (config_volume,) = [v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    config_map = kube.core.read_namespaced_config_map(config_volume["configMap"]["name"], namespace)
    config = yaml.safe_load(config_map.data["config.yaml"])
    config["metrics"] = {"port": free_port(), "bindAddress": "127.0.0.1"}  # local: a free port on loopback
    config_file = workdir / f"{node}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    local = {"--config": str(config_file), "--kubelet-dir": str(kubelet_dir)}
    args = []
    for arg in container["args"]:
        flag, _, _ = arg.partition("=")
        args.append(f"{flag}={local[flag]}" if flag in local else arg)
    assert all(f"{flag}=" in " ".join(args) for flag in local), f"the chart passes no {list(local)}: {args}"
    plugin = PluginProcess(workdir, kubelet_dir, None, node=node, kubeconfig=kubeconfig)
    plugin.args = [*plugin_command(), *args, "--node-name", node, "--kubeconfig", str(kubeconfig)]
    return plugin.start()


def bare_gpu_node(kube: ClusterClient, name: str, pool: str) -> None:
    """The Node a kubelet registers on an l40s-pcie machine (capacity from the device plugin's
    registration) before our plugin ran: no inventory annotation, no GPU labels, no kwok annotation."""
    body = fake_node_manifest(name, PROFILE, publication_for_profile(PROFILE, node_name=name))
    meta = body["metadata"]
    meta["annotations"] = {k: v for k, v in meta["annotations"].items()
                           if k not in (INVENTORY_ANNOTATION, "kwok.x-k8s.io/node")}
    meta["labels"] = {k: v for k, v in meta["labels"].items() if k not in OWNED_LABELS}
    meta["labels"][POOL_LABEL] = pool
    discard(kube.core.create_node(body=body, _preload_content=False))
