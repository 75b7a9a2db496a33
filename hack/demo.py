"""`make demo` / `make demo-down`: gpupool at work on the local control plane.

`up` starts the dev cluster if it is not running, installs the Helm chart (deploy/helm/gpupool) with the
pinned helm into the namespace `gpupool-demo`, and gives the chart somewhere to run:
  * on a machine that can (root, containerd, runc, the CNI plugins: `--node auto`, the default), a real
    node (`dev-cluster up --with kubelet`): the chart's scheduler and device plugin (fake NVML) run as
    pods from the image `make image` builds (built first if missing), and the demo's pods that land on
    that node run there;
  * elsewhere (or `--node standin`), nodes whose device plugin and scheduler run as local processes
    through the node agent (below);
plus kwok nodes for the rest; then it prints `gpupool status`,
submits a mixed training/inference workload with the chart's PriorityClasses, waits until every pod runs
or is marked unschedulable, and prints `gpupool status` again with the figures of the scheduler's
/metrics (GPUs by state, allocated and fragmented capacity, pending pods by priority).

`agent` (started by `up` without a real node, detached): with no container runtime, the chart's Deployment
and DaemonSet cannot run; this process runs their programs instead, as tests/e2e/test_helm_chart.py does: the
chart's command lines with tokens of the chart's ServiceAccounts (never admin), the device plugin behind
the kubelet stand-in and the pod admission loop of tests/e2e/test_scheduler_fullpath.py (all three reused
from the test support package tests.support, not copied). It runs until `down`.

`down` stops the agent and every process it started (by pid), uninstalls the chart, deletes the namespace
and the demo's nodes, and stops the dev cluster if `up` started it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from gpupool_devcluster import realnode
from gpupool_devcluster.binaries import cache_root
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.layout import DEFAULT_CLUSTER
from gpupool_devcluster.raw import discard, read_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the stand-ins the chart test uses (see above) are in tests.support

NAMESPACE = "gpupool-demo"
RELEASE = "demo"
SCHEDULER_NAME = "gpupool-demo"
POOL = "gpupool-demo"  # value of the pool label on the demo's nodes; its pods select it
PLUGIN_PROFILE = "l40s-pcie"  # nodes with the real device plugin: 4 GPUs x 44 units
KWOK_PROFILE = "dgx-h100"  # kwok nodes: 8 GPUs x 80 units
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
_START = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {text}", flush=True)


def state_dir(cluster: str) -> Path:
    return cache_root() / "demo" / cluster


def read_state(cluster: str) -> dict[str, Any]:
    path = state_dir(cluster) / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(cluster: str, state: dict[str, Any]) -> None:
    folder = state_dir(cluster)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.json.tmp").write_text(json.dumps(state, indent=1))
    (folder / "state.json.tmp").replace(folder / "state.json")


# ---- up --------------------------------------------------------------------------------------------
def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The mixed workload: (name, priority class, whole GPUs, memory units)."""
    from tests.support.scheduler_harness import POOL_LABEL, pod

    shapes: list[tuple[str, str, int, int]] = [("train-critical-0", "train-critical", 4, 0)]
    shapes += [(f"train-{i}", "training", 2, 0) for i in range(args.training)]
    shapes += [(f"serve-{i}", "inference", 0, (8, 16, 20)[i % 3]) for i in range(args.inference)]
    shapes += [(f"batch-{i}", "best-effort", 2, 0) for i in range(args.best_effort)]
    pods = []
    for name, tier, gpus, units in shapes:
        body = pod(name, SCHEDULER_NAME, POOL, gpus=gpus, units=units, priority_class=tier,
                   labels={"app.kubernetes.io/part-of": "gpupool-demo", "tier": tier})
        assert body["spec"]["nodeSelector"] == {POOL_LABEL: POOL}
        pods.append(body)
    return pods


def helm(kube: ClusterClient, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    from gpupool_devcluster.binaries import helm_binary

    done = subprocess.run([str(helm_binary()), "--kubeconfig", str(kube.kubeconfig), *args],
                          capture_output=True, text=True, timeout=180)
    if check and done.returncode != 0:
        raise SystemExit(f"helm {' '.join(args[:2])} failed ({done.returncode}):\n{done.stderr}")
    return done


def foreign_priority_classes(kube: ClusterClient) -> list[str]:
    """The chart's PriorityClass names that exist already and are not this release's (helm refuses to
    adopt them; the demo then installs with priorityClasses.enabled=false and uses the existing ones)."""
    api = client.SchedulingV1Api(kube.api_client)
    found = []
    for name in ("train-critical", "training", "inference", "best-effort"):
        try:
            obj = read_json(api.read_priority_class(name, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                continue
            raise
        owner = (obj["metadata"].get("annotations") or {}).get("meta.helm.sh/release-name")
        if owner != RELEASE:
            found.append(name)
    return found


def gpupool_command() -> str:
    """The `gpupool` of this environment as a user can type it: `.venv/bin/gpupool` from the repository
    (what `make venv` makes), else its full path; plain `gpupool` only works in an activated venv."""
    exe = Path(sys.executable).parent / "gpupool"
    with contextlib.suppress(ValueError):
        return str(exe.relative_to(Path.cwd()))
    return str(exe)


def status(kube: ClusterClient, title: str) -> None:
    from tests.support.scheduler_harness import POOL_LABEL

    say(f"gpupool status ({title})")
    exe = Path(sys.executable).parent / "gpupool"
    done = subprocess.run([str(exe), "status", "--kubeconfig", str(kube.kubeconfig), "-l", f"{POOL_LABEL}={POOL}",
                           "--scheduler-name", SCHEDULER_NAME], capture_output=True, text=True, timeout=60)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"gpupool status failed ({done.returncode}):\n{done.stderr}")


def scrape(base: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return samples


def print_figures(samples: dict[str, list[tuple[dict[str, str], float]]], plugin_urls: list[str]) -> None:
    """The figures of the dashboard's GPU and queue rows, from one scrape of the scheduler."""
    say("scheduler /metrics (the dashboard's figures; GPU figures cover every node the scheduler sees)")
    missing = "not in this scrape (the cluster gauges are computed every 5 s)"  # never shown as 0
    states = {labels["state"]: value for labels, value in samples["gpupool_scheduler_cluster_gpus"]}
    order = ("whole", "shared", "mig", "free", "unhealthy")
    print("  GPUs by state:          " + ("  ".join(f"{s} {int(states[s])}" for s in order if s in states)
                                         if states else missing))
    allocated = [value for _, value in samples["gpupool_scheduler_cluster_gpu_allocated_percent"]]
    fragmented = [value for _, value in samples["gpupool_scheduler_cluster_fragmentation_percent"]]
    print("  GPU capacity allocated: " + (f"{allocated[0]:.1f}%" if allocated else missing))
    print("  fragmentation (FGD):    " + (f"{fragmented[0]:.1f}% of all GPU capacity" if fragmented else missing))
    pending: dict[int, float] = defaultdict(float)
    for labels, value in samples["gpupool_scheduler_pending_pods"]:
        pending[int(float(labels["priority"]))] += value
    shown = {p: int(n) for p, n in sorted(pending.items(), reverse=True) if n}
    print("  pending pods by priority: " + ("  ".join(f"{p}: {n}" for p, n in shown.items()) or "none"))
    attempts = {labels["result"]: int(value) for labels, value in samples["gpupool_scheduler_schedule_attempts_total"]}
    print("  scheduling attempts:    " + "  ".join(f"{r} {n}" for r, n in sorted(attempts.items())))
    for url in plugin_urls:
        plugin = scrape(url)
        node = next((labels["node"] for labels, _ in plugin["gpupool_deviceplugin_node_info"]), "?")
        registered = sorted(labels["resource"] for labels, value in plugin["gpupool_deviceplugin_registered"] if value)
        print(f"  device plugin {node}: registered {', '.join(registered) or 'nothing'}")


def settled(kube: ClusterClient) -> tuple[dict[str, int], bool]:
    """Counts of the demo's pods by what happened to them; True when each runs or was found unschedulable."""
    pods = read_json(kube.core.list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/part-of=gpupool-demo", _preload_content=False))["items"]
    counts = {"running": 0, "bound": 0, "unschedulable": 0, "waiting": 0}
    for obj in pods:
        conditions = obj["status"].get("conditions") or ()
        if obj["status"].get("phase") == "Running":
            counts["running"] += 1
        elif obj["spec"].get("nodeName"):
            counts["bound"] += 1
        elif any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions):
            counts["unschedulable"] += 1
        else:
            counts["waiting"] += 1
    return counts, counts["bound"] == counts["waiting"] == 0


def unschedulable_by_tier(kube: ClusterClient) -> dict[str, int]:
    """The demo's pods marked unschedulable, by priority class."""
    pods = read_json(kube.core.list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/part-of=gpupool-demo", _preload_content=False))["items"]
    tiers: dict[str, int] = defaultdict(int)
    for obj in pods:
        if not obj["spec"].get("nodeName") and any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in obj["status"].get("conditions") or ()):
            tiers[obj["spec"].get("priorityClassName") or "(none)"] += 1
    return dict(tiers)


def up(args: argparse.Namespace) -> int:
    from tests.support.chart import CHART, bare_gpu_node
    from tests.support.scheduler_harness import POOL_LABEL

    if read_state(args.cluster):
        raise SystemExit(f"a demo is already up on cluster {args.cluster!r}: `make demo-down` first")
    cluster = DevCluster(args.cluster)
    mode, why = choose_mode(args.node)
    started_cluster = cluster.running_state() is None
    if mode == "real":
        say("a real node runs the chart's pods: kubelet + containerd + kube-proxy (dev-cluster up --with kubelet)")
        cluster.up(real_nodes=1, log=lambda line: say(f"  {line}"))
    else:
        say(f"no real node ({why}): the chart's programs run as local processes behind a kubelet stand-in")
        if started_cluster:
            say(f"starting the local control plane {args.cluster!r} (etcd, kube-apiserver, kwok)")
            cluster.up(log=lambda line: say(f"  {line}"))
    kube = ClusterClient.connect(cluster)
    state: dict[str, Any] = {"cluster": args.cluster, "started_cluster": started_cluster, "pids": [], "mode": mode}
    write_state(args.cluster, state)
    say(f"logs: {state_dir(args.cluster)} (agent.log: the node agent; the scheduler's and each device "
        "plugin's log beside it)")

    say(f"namespace {NAMESPACE}; helm install {RELEASE} {CHART.relative_to(ROOT)} (pinned helm)")
    with contextlib.suppress(ApiException):  # 409: it exists already
        discard(kube.core.create_namespace({"metadata": {"name": NAMESPACE}}, _preload_content=False))
    values = ["--set", f"schedulerName={SCHEDULER_NAME}", "--set", f"devicePlugin.fakeNvmlProfile={PLUGIN_PROFILE}",
              "--set", "scheduler.gateTimeoutSeconds=20"]
    existing = foreign_priority_classes(kube)
    if existing:
        say(f"  PriorityClasses {', '.join(existing)} exist already (not this release's): using them as they are")
        values += ["--set", "priorityClasses.enabled=false"]
    if mode == "real":
        node = realnode.node_name(args.cluster, 0)
        pin = json.dumps({"kubernetes.io/hostname": node})
        values += ["--set", "image.repository=gpupool", "--set-json", f"scheduler.nodeSelector={pin}",
                   "--set-json", f"devicePlugin.nodeSelector={pin}"]
    helm(kube, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--wait=false", *values)
    state["release"] = RELEASE
    write_state(args.cluster, state)
    if mode == "real":
        return up_on_real_node(args, kube, state, node)

    plugin_nodes = [f"{POOL}-{PLUGIN_PROFILE}-{i}" for i in range(args.plugin_nodes)]
    say(f"{len(plugin_nodes)} node(s) for the device plugin ({PLUGIN_PROFILE}), {args.kwok_nodes} kwok node(s) "
        f"({KWOK_PROFILE})")
    for name in plugin_nodes:
        bare_gpu_node(kube, name, POOL)
    if args.kwok_nodes:
        for name in kube.add_nodes(KWOK_PROFILE, args.kwok_nodes, prefix=f"{POOL}-{KWOK_PROFILE}-"):
            discard(kube.core.patch_node(name, {"metadata": {"labels": {POOL_LABEL: POOL}}}, _preload_content=False))

    say("starting the node agent: the chart's scheduler and device plugins as local processes with the "
        "chart's ServiceAccount tokens")
    folder = state_dir(args.cluster)
    ready = folder / "agent.json"
    ready.unlink(missing_ok=True)
    with (folder / "agent.log").open("wb") as log:
        agent = subprocess.Popen([sys.executable, __file__, "--cluster", args.cluster, "agent", *plugin_nodes],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    state["pids"].append(agent.pid)
    write_state(args.cluster, state)
    deadline = time.monotonic() + 120
    while not ready.is_file():
        if agent.poll() is not None or time.monotonic() > deadline:
            tail = (folder / "agent.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"the node agent did not come up (see {folder / 'agent.log'}):\n{tail}")
        time.sleep(0.2)
    agent_info = json.loads(ready.read_text())
    state["pids"] += agent_info["pids"]
    write_state(args.cluster, state)
    say(f"  scheduler metrics on 127.0.0.1:{agent_info['scheduler_port']}; device plugins registered on "
        f"{', '.join(plugin_nodes) or 'no node'}")

    submit_and_report(args, kube, f"http://127.0.0.1:{agent_info['scheduler_port']}",
                      [f"http://127.0.0.1:{port}" for port in agent_info["plugin_ports"]])
    say(f"the demo keeps running (scheduler, device plugins, kubelet stand-ins): "
        f"KUBECONFIG={kube.kubeconfig} {gpupool_command()} status -l {POOL_LABEL}={POOL} "
        f"--scheduler-name {SCHEDULER_NAME}; metrics: curl 127.0.0.1:{agent_info['scheduler_port']}/metrics; "
        f"logs in {folder}; `make demo-down` removes everything")
    return 0


def choose_mode(asked: str) -> tuple[str, str]:
    """("real" | "standin", why not real). `auto` takes a real node where this machine can run one, building
    the image first when only it is missing."""
    if asked == "standin":
        return "standin", "--node standin"
    reason = realnode.can_run_real_nodes()
    if reason is None:
        try:
            realnode.default_images()
        except DevClusterError:
            if shutil.which("mmdebstrap") is None:
                reason = "no image in out/image/ and no mmdebstrap to build one (`make image`)"
            else:
                say("building the image first: make image (about 75 s the first time)")
                done = subprocess.run(["make", "-C", str(ROOT), "image"], check=False)
                if done.returncode != 0:
                    reason = "`make image` failed"
    if reason is not None and asked == "real":
        raise SystemExit(f"--node real: this machine cannot run a real node: {reason}")
    return ("standin", reason) if reason else ("real", "")


def up_on_real_node(args: argparse.Namespace, kube: ClusterClient, state: dict[str, Any], node: str) -> int:
    """The chart's pods run on the real node; kwok nodes beside it take the rest of the workload."""
    from tests.support.scheduler_harness import POOL_LABEL

    say(f"the real node {node} and {args.kwok_nodes} kwok node(s) ({KWOK_PROFILE}) in pool {POOL}")
    discard(kube.core.patch_node(node, {"metadata": {"labels": {POOL_LABEL: POOL}}}, _preload_content=False))
    state["real_node"] = node
    write_state(args.cluster, state)
    if args.kwok_nodes:
        for name in kube.add_nodes(KWOK_PROFILE, args.kwok_nodes, prefix=f"{POOL}-{KWOK_PROFILE}-"):
            discard(kube.core.patch_node(name, {"metadata": {"labels": {POOL_LABEL: POOL}}}, _preload_content=False))
    say("waiting for the chart's pods: the scheduler replicas and the device plugin (registering with the kubelet)")
    deadline = time.monotonic() + 180
    while True:
        pods = read_json(kube.core.list_namespaced_pod(NAMESPACE, _preload_content=False))["items"]
        ready = {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods
                 if p["status"].get("phase") == "Running"
                 and all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])}
        capacity = read_json(kube.core.read_node(node, _preload_content=False))["status"].get("allocatable") or {}
        if {"scheduler", "deviceplugin"} <= ready and int(capacity.get(GPU, "0")) > 0:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the chart's pods are not ready after 180 s: {sorted(x or '?' for x in ready)} "
                             f"ready; `kubectl -n {NAMESPACE} describe pods` says why")
        time.sleep(1)
    for obj in pods:
        say(f"  pod {obj['metadata']['name']} on {obj['spec'].get('nodeName')}: {obj['status'].get('phase')}")
    say(f"  {node}: kubelet reports {capacity.get(GPU)} {GPU}, {capacity.get(MEM)} {MEM} allocatable")
    fullname = f"{RELEASE}-gpupool"
    spec = read_json(kube.core.read_namespaced_service(f"{fullname}-scheduler-metrics", NAMESPACE,
                                                        _preload_content=False))["spec"]
    urls = [f"http://{spec['clusterIP']}:{spec['ports'][0]['port']}"]  # through kube-proxy
    urls += [f"http://{p['status']['podIP']}:{p['spec']['containers'][0]['ports'][0]['containerPort']}"
             for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "deviceplugin"]
    submit_and_report(args, kube, urls[0], urls[1:])
    say(f"the demo keeps running on {node}: KUBECONFIG={kube.kubeconfig} {gpupool_command()} status "
        f"-l {POOL_LABEL}={POOL} --scheduler-name {SCHEDULER_NAME}; metrics: curl {urls[0]}/metrics (its "
        f"Service); `make demo-down` removes everything")
    return 0


def submit_and_report(args: argparse.Namespace, kube: ClusterClient, scheduler_url: str,
                      plugin_urls: list[str]) -> None:
    """Status before, the workload submitted and settled, status after, the scheduler's figures."""
    folder = state_dir(args.cluster)
    status(kube, "before")
    pods = workload(args)
    tiers: dict[str, int] = defaultdict(int)
    for body in pods:
        tiers[body["spec"]["priorityClassName"]] += 1
    say(f"submitting {len(pods)} pods: " + ", ".join(f"{n} {t}" for t, n in tiers.items()))
    for body in pods:
        discard(kube.core.create_namespaced_pod(NAMESPACE, body, _preload_content=False))

    shown = None
    deadline = time.monotonic() + args.timeout
    while True:
        counts, done = settled(kube)
        if counts != shown:
            say("  " + ", ".join(f"{k} {v}" for k, v in counts.items()))
            shown = counts
        if done:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"pods not settled after {args.timeout:.0f}s: {counts} "
                             f"(agent log: {folder / 'agent.log'})")
        time.sleep(0.5)

    status(kube, "after")
    waiting = unschedulable_by_tier(kube)
    if waiting:
        say("  " + ", ".join(f"{n} {tier}" for tier, n in waiting.items()) + " pod(s) stay Pending, as expected: "
            "the workload asks for more GPUs than the demo's nodes have, so the lowest-priority pods wait "
            "(listed above by priority) until GPUs free up")
    # the cluster gauges are refreshed every 5 s: wait for a scrape that counts the placed GPUs
    samples = scrape(scheduler_url)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = {labels["state"]: value for labels, value in samples["gpupool_scheduler_cluster_gpus"]}
        if states.get("whole", 0) + states.get("shared", 0) > 0:
            break
        time.sleep(1)
        samples = scrape(scheduler_url)
    print_figures(samples, plugin_urls)


# ---- agent -----------------------------------------------------------------------------------------
def agent(args: argparse.Namespace) -> int:
    from tests.support.chart import service_account_kubeconfig, start_chart_plugin, start_chart_scheduler
    from tests.support.kubelet_standin import KubeletStandin
    from tests.support.node_kubelet import NodeKubelet

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    kube = ClusterClient.connect(DevCluster(args.cluster))
    apps = client.AppsV1Api(kube.api_client)
    fullname = f"{RELEASE}-gpupool"
    deployment = kube.api_client.sanitize_for_serialization(
        apps.read_namespaced_deployment(f"{fullname}-scheduler", NAMESPACE))
    daemonset = kube.api_client.sanitize_for_serialization(
        apps.read_namespaced_daemon_set(f"{fullname}-deviceplugin", NAMESPACE))
    folder = state_dir(args.cluster)
    sched_config = folder / "scheduler.kubeconfig"
    plugin_config = folder / "deviceplugin.kubeconfig"
    service_account_kubeconfig(kube, NAMESPACE, deployment["spec"]["template"]["spec"]["serviceAccountName"],
                               sched_config)
    service_account_kubeconfig(kube, NAMESPACE, daemonset["spec"]["template"]["spec"]["serviceAccountName"],
                               plugin_config)
    with contextlib.ExitStack() as stack:
        pids: list[int] = []
        ports: list[int] = []
        for node in args.nodes:
            short = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpd-")))  # short socket paths
            kubelet_dir = short / "device-plugins"
            kubelet_dir.mkdir()
            standin = KubeletStandin(kubelet_dir)
            standin.start()
            stack.callback(standin.stop)
            plugin = start_chart_plugin(kube, NAMESPACE, daemonset, plugin_config, node, kubelet_dir, folder)
            stack.callback(plugin.stop)
            assert plugin.proc is not None
            pids.append(plugin.proc.pid)
            standin.wait_registered({GPU, MEM}, timeout=30)
            plugin.wait_healthz(200, timeout=30)
            ports.append(plugin.metrics_port())
            kubelet = NodeKubelet(kube, node, standin)
            kubelet.start()
            stack.callback(kubelet.stop)
        scheduler = start_chart_scheduler(kube, NAMESPACE, deployment, sched_config, f"{fullname}-scheduler-0",
                                          folder)
        stack.callback(scheduler.stop)
        pids.append(scheduler.process.pid)
        (folder / "agent.json").write_text(json.dumps(
            {"scheduler_port": scheduler.port, "plugin_ports": ports, "pids": pids}))
        print(f"agent ready: scheduler on {scheduler.port}, plugins on {ports}", flush=True)
        while not stop.wait(1.0):
            if scheduler.process.poll() is not None:
                print(f"scheduler exited {scheduler.process.returncode}:\n{scheduler.tail()}", flush=True)
                return 1
    print("agent stopped", flush=True)
    return 0


# ---- down ------------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def stop_pids(pids: list[int]) -> None:
    """SIGTERM the agent first (it stops its children in order), then anything left; SIGKILL after 20 s."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def empty_namespace(kube: ClusterClient) -> None:
    """Delete the namespace with what the demo left in it (pods, events, the Lease). The dev cluster runs no
    namespace controller, so this does its job: empty the namespace, then release its finalizer."""
    coordination = client.CoordinationV1Api(kube.api_client)
    events = client.EventsV1Api(kube.api_client)
    try:
        kube.core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)
        kube.core.delete_collection_namespaced_event(NAMESPACE)
        events.delete_collection_namespaced_event(NAMESPACE)
        coordination.delete_collection_namespaced_lease(NAMESPACE)
        kube.core.delete_collection_namespaced_config_map(NAMESPACE)
        kube.core.delete_collection_namespaced_service_account(NAMESPACE)
        discard(kube.core.delete_namespace(NAMESPACE, _preload_content=False))
        kube.core.replace_namespace_finalize(NAMESPACE, client.V1Namespace(
            metadata=client.V1ObjectMeta(name=NAMESPACE), spec=client.V1NamespaceSpec(finalizers=[])))
    except ApiException as exc:
        if exc.status != 404:  # gone already (or a namespace controller was quicker)
            raise


def down(args: argparse.Namespace) -> int:
    from tests.support.scheduler_harness import POOL_LABEL

    state = read_state(args.cluster)
    pids = [p for p in state.get("pids", []) if alive(p)]
    say(f"stopping {len(pids)} demo process(es)")
    stop_pids(state.get("pids", []))
    cluster = DevCluster(args.cluster)
    if cluster.running_state() is not None:
        kube = ClusterClient.connect(cluster)
        if RELEASE in helm(kube, "list", "--namespace", NAMESPACE, "--short").stdout.split():
            say(f"helm uninstall {RELEASE}")
            helm(kube, "uninstall", RELEASE, "--namespace", NAMESPACE)
        nodes = [n["metadata"]["name"] for n in read_json(kube.core.list_node(
            label_selector=f"{POOL_LABEL}={POOL}", _preload_content=False))["items"]]
        real = state.get("real_node")
        if real in nodes:  # the cluster's own node: it only leaves the demo's pool
            nodes.remove(real)
            discard(kube.core.patch_node(real, {"metadata": {"labels": {POOL_LABEL: None}}}, _preload_content=False))
        say(f"deleting {len(nodes)} demo node(s) and namespace {NAMESPACE}")
        kube.delete_nodes(nodes)
        empty_namespace(kube)
        deadline = time.monotonic() + 60
        while NAMESPACE in {n["metadata"]["name"] for n in read_json(
                kube.core.list_namespace(_preload_content=False))["items"]}:
            if time.monotonic() > deadline:
                raise SystemExit(f"namespace {NAMESPACE} still there after 60 s")
            time.sleep(0.5)
        kube.close()
        if state.get("started_cluster"):
            say(f"stopping the local control plane {args.cluster!r} (the demo started it)")
            cluster.down()
    folder = state_dir(args.cluster)
    for name in ("state.json", "agent.json", "scheduler.kubeconfig", "deviceplugin.kubeconfig"):
        (folder / name).unlink(missing_ok=True)
    say(f"demo removed (logs stay in {folder})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"dev cluster name (default {DEFAULT_CLUSTER})")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="install the chart, run the scheduler and plugins, submit the workload")
    start.add_argument("--node", choices=("auto", "real", "standin"), default="auto",
                       help="where the chart's pods run: a real node (kubelet + containerd; needs root), local "
                       "processes behind a kubelet stand-in, or auto: real where this machine can (default)")
    start.add_argument("--plugin-nodes", type=int, default=2,
                       help=f"without a real node: nodes with the device plugin ({PLUGIN_PROFILE})")
    start.add_argument("--kwok-nodes", type=int, default=4, help=f"kwok nodes ({KWOK_PROFILE})")
    start.add_argument("--training", type=int, default=6, help="2-GPU pods of priority class training")
    start.add_argument("--inference", type=int, default=12, help="pods of 8/16/20 memory units, class inference")
    start.add_argument("--best-effort", type=int, default=12, help="2-GPU pods of priority class best-effort")
    start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the pods to settle")
    start.set_defaults(func=up)
    node_agent = commands.add_parser("agent", help="(started by up) run the scheduler and device plugins")
    node_agent.add_argument("nodes", nargs="*", help="nodes that get a device plugin")
    node_agent.set_defaults(func=agent)
    commands.add_parser("down", help="remove everything the demo made").set_defaults(func=down)
    args = parser.parse_args(argv)
    for flag in ("plugin_nodes", "kwok_nodes", "training", "inference", "best_effort"):
        if getattr(args, flag, 0) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be 0 or more")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
