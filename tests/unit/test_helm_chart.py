"""The chart renders, lints and refuses bad values with a message naming the value (pinned helm, no
cluster: `helm lint` / `helm template`). The installed chart is tested in tests/e2e/test_helm_chart.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool_devcluster.binaries import helm_binary, repo_root
from gpupool_devcluster.errors import DevClusterError
from gpupool_deviceplugin.config import PluginConfig
from gpupool_sched.cli import build_parser
from tests.support.chart import CHART


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        binary = helm_binary()
    except DevClusterError as exc:  # `make test` builds it first (make cluster-bins): missing is a failure
        pytest.fail(str(exc), pytrace=False)
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


def render(*values: str) -> list[dict[str, Any]]:
    done = helm("template", "rel", str(CHART), "--namespace", "gp", *values)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_helm_lint_strict_is_clean() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


def test_defaults_render_the_scheduler_and_the_device_plugin() -> None:
    docs = render()
    deployment = by_kind(docs, "Deployment")["rel-gpupool-scheduler"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpupool", "scheduler"]
    assert "--leader-elect" in container["args"] and "--policy=$(GPUPOOL_POLICY)" in container["args"]
    assert "--lease-namespace=$(POD_NAMESPACE)" in container["args"]
    daemonset = by_kind(docs, "DaemonSet")["rel-gpupool-deviceplugin"]
    pod = daemonset["spec"]["template"]["spec"]
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert paths == {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert not any(a.startswith("--fake-nvml") for a in pod["containers"][0]["args"])
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-gpupool-deviceplugin"]["data"]["config.yaml"])
    assert config["gpuMemory"]["unitMiB"] == 1024 and config["kubernetes"]["mode"] == "required"
    classes = {name: d["value"] for name, d in by_kind(docs, "PriorityClass").items()}
    assert classes == {"train-critical": 1_000_000, "training": 100_000, "inference": 10_000, "best-effort": 0}
    dashboard = by_kind(docs, "ConfigMap")["rel-gpupool-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert not by_kind(docs, "PrometheusRule") and not by_kind(docs, "ServiceMonitor")


def test_mps_values_reach_the_plugin_config() -> None:
    docs = render("--set", "devicePlugin.mps=true", "--set", "devicePlugin.mpsShmDirectory=/run/mps-shm")
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-gpupool-deviceplugin"]["data"]["config.yaml"])
    assert config["gpuMemory"] == {"unitMiB": 1024, "mps": True, "mpsPipeDirectory": "/run/nvidia/mps",
                                   "mpsShmDirectory": "/run/mps-shm"}
    # the plugin accepts what the chart renders
    assert PluginConfig.model_validate(config).gpu_memory.mps_shm_directory == "/run/mps-shm"


def test_idle_values_reach_the_plugin_config_and_host_pid_is_opt_in() -> None:
    docs = render()
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-gpupool-deviceplugin"]["data"]["config.yaml"])
    assert PluginConfig.model_validate(config).idle == PluginConfig().idle  # the chart's defaults are the plugin's
    assert "hostPID" not in by_kind(docs, "DaemonSet")["rel-gpupool-deviceplugin"]["spec"]["template"]["spec"]
    docs = render("--set", "devicePlugin.idle.windowSeconds=3600", "--set", "devicePlugin.idle.hostPID=true",
                  "--set", "devicePlugin.idle.sampleIntervalSeconds=0")
    idle = PluginConfig.model_validate(yaml.safe_load(
        by_kind(docs, "ConfigMap")["rel-gpupool-deviceplugin"]["data"]["config.yaml"])).idle
    assert (idle.window_s, idle.sample_interval_s) == (3600, 0)
    assert by_kind(docs, "DaemonSet")["rel-gpupool-deviceplugin"]["spec"]["template"]["spec"]["hostPID"] is True


def test_values_switch_parts_on_and_off() -> None:
    docs = render("--set", "devicePlugin.fakeNvmlProfile=dgx-h100", "--set", "extender.enabled=true",
                  "--set", "priorityClasses.classes.best-effort.enabled=false", "--set", "gpuMemoryUnitMiB=512",
                  "--set", "devicePlugin.kubeletRoot=/data/kubelet/")
    pod = by_kind(docs, "DaemonSet")["rel-gpupool-deviceplugin"]["spec"]["template"]["spec"]
    assert "--fake-nvml=dgx-h100" in pod["containers"][0]["args"]
    assert {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v} == {
        "/data/kubelet/device-plugins", "/data/kubelet/pod-resources"}
    assert "best-effort" not in by_kind(docs, "PriorityClass")
    assert by_kind(docs, "ConfigMap")["rel-gpupool-scheduler-policy"]["data"]["memory-unit-mib"] == "512"
    extender = by_kind(docs, "Deployment")["rel-gpupool-extender"]
    assert extender["spec"]["template"]["spec"]["containers"][0]["command"] == ["gpupool", "extender"]
    assert "rel-gpupool-extender" in by_kind(docs, "Service")
    off = render("--set", "devicePlugin.enabled=false", "--set", "priorityClasses.enabled=false")
    assert not by_kind(off, "DaemonSet") and not by_kind(off, "PriorityClass")
    assert "rel-gpupool-deviceplugin" not in by_kind(off, "ClusterRole")


def test_the_extender_is_a_single_writer_by_construction() -> None:
    """One extender ledger (issue 16 A10): the extender has no leader election, so two replicas, or an
    old and a new pod side by side during a RollingUpdate, would both answer `bind` from ledgers that
    do not see each other's assumptions. One replica, replaced with Recreate (the old pod is gone
    before the new one starts)."""
    extender = by_kind(render("--set", "extender.enabled=true"), "Deployment")["rel-gpupool-extender"]
    assert extender["spec"]["replicas"] == 1
    assert extender["spec"]["strategy"] == {"type": "Recreate"}


def _expanded_command(docs: list[dict[str, Any]], deployment: str) -> list[str]:
    """The container's command + args as the kubelet runs them: $(VAR) expanded from its env (ConfigMap
    keys and the downward API get stand-in values)."""
    container = by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"][0]
    config = {name: cm.get("data") or {} for name, cm in by_kind(docs, "ConfigMap").items()}
    env: dict[str, str] = {}
    for var in container.get("env") or ():
        ref = (var.get("valueFrom") or {}).get("configMapKeyRef")
        env[var["name"]] = config[ref["name"]][ref["key"]] if ref else str(var.get("value", "stand-in"))
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container.get("args") or ()]
    return [*container["command"], *args]


@pytest.mark.parametrize("deployment", ["rel-gpupool-scheduler", "rel-gpupool-extender"])
def test_every_flag_the_chart_passes_is_accepted_by_the_cli(deployment: str) -> None:
    """The chart's args go through the real `gpupool` parser: a flag one subcommand lacks (the extender
    was once given the scheduler's --bind-workers) would make the container exit 2 at every start."""
    docs = render("--set", "extender.enabled=true", "--set", "scheduler.eventWorkers=6")
    command = _expanded_command(docs, deployment)
    assert command[0] == "gpupool"
    args = build_parser().parse_args(command[1:])
    assert args.command == deployment.rsplit("-", 1)[-1]
    assert args.policy == "gpupool" and args.memory_unit_mib == 1024
    if args.command == "scheduler":
        assert (args.bind_workers, args.event_workers) == (64, 6)
    # the command line listens on 127.0.0.1 by default; a pod must be reached (probes, Prometheus, its
    # Service): the chart sets 0.0.0.0 (issue 22, item 4; the extender's pods listened on loopback only)
    assert (args.metrics_address if args.command == "scheduler" else args.address) == "0.0.0.0"
    assert build_parser().parse_args([args.command, "--port", "1"] if args.command == "extender"
                                     else [args.command]).__dict__.get(
        "metrics_address" if args.command == "scheduler" else "address") == "127.0.0.1"


def test_the_preemption_search_values_reach_the_schedulers_flags() -> None:
    """scheduler.preemption: kube-scheduler's minCandidateNodes (docs/preemption.md#candidate-sampling);
    searchBudgetMs 0 passes no flag (no time limit)."""
    default = build_parser().parse_args(_expanded_command(render(), "rel-gpupool-scheduler")[1:])
    assert (default.preemption_min_candidate_nodes_percentage, default.preemption_min_candidate_nodes_absolute,
            default.preemption_search_budget_ms) == (10, 100, None)
    docs = render("--set", "scheduler.preemption.minCandidateNodesPercentage=25",
                  "--set", "scheduler.preemption.minCandidateNodesAbsolute=40",
                  "--set", "scheduler.preemption.searchBudgetMs=250")
    args = build_parser().parse_args(_expanded_command(docs, "rel-gpupool-scheduler")[1:])
    assert (args.preemption_min_candidate_nodes_percentage, args.preemption_min_candidate_nodes_absolute,
            args.preemption_search_budget_ms) == (25, 40, 250.0)


def test_the_defrag_values_reach_the_schedulers_flags() -> None:
    """scheduler.defrag (docs/defragmentation.md); budgetPerHour null passes no flag (1 % of GPU pods)."""
    default = build_parser().parse_args(_expanded_command(render(), "rel-gpupool-scheduler")[1:])
    assert (default.defrag, default.defrag_after, default.defrag_min_runtime, default.defrag_max_movers,
            default.defrag_budget, default.defrag_cooldown, default.defrag_surge_timeout) == (
        "on", 60.0, 600.0, 16, None, 3600.0, 300.0)
    docs = render("--set", "scheduler.defrag.enabled=false", "--set", "scheduler.defrag.afterSeconds=5",
                  "--set", "scheduler.defrag.minRuntimeSeconds=0", "--set", "scheduler.defrag.maxMovers=3",
                  "--set", "scheduler.defrag.budgetPerHour=2", "--set", "scheduler.defrag.cooldownSeconds=60",
                  "--set", "scheduler.defrag.surgeTimeoutSeconds=90")
    args = build_parser().parse_args(_expanded_command(docs, "rel-gpupool-scheduler")[1:])
    assert (args.defrag, args.defrag_after, args.defrag_min_runtime, args.defrag_max_movers, args.defrag_budget,
            args.defrag_cooldown, args.defrag_surge_timeout) == ("off", 5.0, 0.0, 3, 2, 60.0, 90.0)


def test_the_background_consolidation_values_reach_the_schedulers_flags() -> None:
    """scheduler.defrag.background: off by default, no window flag; a window and a quiet time pass through."""
    default = build_parser().parse_args(_expanded_command(render(), "rel-gpupool-scheduler")[1:])
    assert (default.defrag_background, default.defrag_background_window, default.defrag_background_quiet) == (
        "off", None, 600.0)
    docs = render("--set", "scheduler.defrag.background.mode=window",
                  "--set", "scheduler.defrag.background.window=22:30-05:00",
                  "--set", "scheduler.defrag.background.quietSeconds=30")
    args = build_parser().parse_args(_expanded_command(docs, "rel-gpupool-scheduler")[1:])
    assert (args.defrag_background, args.defrag_background_window, args.defrag_background_quiet) == (
        "window", (22 * 60 + 30, 5 * 60), 30.0)


def test_jobs_are_read_only_while_the_scheduler_defragments() -> None:
    """The scheduler lists and watches batch Jobs only with --defrag on (a Job's podFailurePolicy says
    whether its pods may move); the chart grants them only then, and never for the extender alone."""
    def grants_jobs(docs: list[dict[str, Any]]) -> bool:
        role = by_kind(docs, "ClusterRole")["rel-gpupool-scheduler"]
        return any("batch" in r["apiGroups"] and "jobs" in r["resources"] and r["verbs"] == ["list", "watch"]
                   for r in role["rules"])

    assert grants_jobs(render())
    assert not grants_jobs(render("--set", "scheduler.defrag.enabled=false"))
    assert not grants_jobs(render("--set", "scheduler.enabled=false", "--set", "extender.enabled=true"))


def test_the_plugin_config_listens_on_all_addresses_and_its_default_on_loopback() -> None:
    from gpupool_deviceplugin.config import parse_config

    config = yaml.safe_load(by_kind(render(), "ConfigMap")["rel-gpupool-deviceplugin"]["data"]["config.yaml"])
    assert parse_config(config).metrics.bind_address == "0.0.0.0" and config["metrics"]["port"] == 9402
    assert parse_config({}).metrics.bind_address == "127.0.0.1"


def test_monitoring_objects_carry_the_chart_files() -> None:
    docs = render("--set", "prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                  "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    rule = by_kind(docs, "PrometheusRule")["rel-gpupool"]
    assert rule["spec"]["groups"] == yaml.safe_load((CHART / "files" / "gpupool-alerts.yaml").read_text())["groups"]
    monitor = by_kind(docs, "ServiceMonitor")["rel-gpupool"]
    selected = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind(docs, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v for k, v in selected.items())]
    assert {s["metadata"]["name"] for s in services} == {"rel-gpupool-scheduler-metrics",
                                                         "rel-gpupool-deviceplugin-metrics"}


@pytest.mark.parametrize(("values", "message"), [
    (["--set", "scheduler.replicas=two"], "at '/scheduler/replicas': got string, want integer"),
    (["--set", "scheduler.policy=fastest"], "at '/scheduler/policy': value must be one of"),
    (["--set", "devicePlugin.fakeNvmlProfile=h200"], "at '/devicePlugin/fakeNvmlProfile': value must be one of"),
    (["--set", "schedulr.replicas=1"], "additional properties 'schedulr' not allowed"),
    (["--set", "extender.enabled=true", "--set", "extender.replicas=2"],
     "at '/extender/replicas': maximum: got 2, want 1"),
    (["--set", "gpuMemoryUnitMiB=3"], "at '/gpuMemoryUnitMiB': minimum: got 3, want 64"),
    (["--set", "devicePlugin.mpsPipeDirectory=mps"], "at '/devicePlugin/mpsPipeDirectory'"),
    (["--set", "priorityClasses.classes.tier.value=2000000000"], "at '/priorityClasses/classes/tier/value'"),
    (["--set", "scheduler.preemption.minCandidateNodesPercentage=101"],
     "at '/scheduler/preemption/minCandidateNodesPercentage': maximum: got 101, want 100"),
    (["--set", "scheduler.leaderElection.renewDeadlineSeconds=20"],
     "need retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds"),
    (["--set", "prometheusRule.enabled=true"], "this cluster has no monitoring.coreos.com/v1 PrometheusRule"),
    (["--set", "metrics.serviceMonitor.enabled=true"], "this cluster has no monitoring.coreos.com/v1 ServiceMonitor"),
])
def test_bad_values_fail_with_a_message_naming_the_value(values: list[str], message: str) -> None:
    done = helm("template", "rel", str(CHART), *values)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_the_chart_ships_every_crd_of_deploy_crds_unchanged() -> None:
    ours = {p.name: p.read_bytes() for p in (repo_root() / "deploy" / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert shipped == ours


def test_the_podgroup_crd_is_the_same_in_the_chart_and_in_deploy_crds() -> None:
    name = "scheduling.x-k8s.io_podgroups.yaml"
    chart_copy = CHART / "crds" / name
    assert chart_copy.read_bytes() == (repo_root() / "deploy" / "crds" / name).read_bytes()
    crd = yaml.safe_load(chart_copy.read_text())
    (version,) = crd["spec"]["versions"]
    assert (crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"]) == (
        "scheduling.x-k8s.io", "v1alpha1", "PodGroup")
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"minMember", "scheduleTimeoutSeconds"} <= set(spec)
    assert {"phase", "scheduled", "running"} <= set(status)


def test_no_template_refers_to_a_missing_file() -> None:
    for template in (CHART / "templates").glob("*.yaml"):
        for line in template.read_text().splitlines():
            if ".Files.Get" in line:
                name = line.split('.Files.Get "', 1)[1].split('"', 1)[0]
                assert (CHART / name).is_file(), f"{template.name}: {name}"
    assert Path(CHART / "values.schema.json").is_file()
