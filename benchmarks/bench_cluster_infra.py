"""Scale check of the dev cluster itself (a benchmark, not a test): how fast 1000 fake GPU nodes become
Ready, and how much memory kube-apiserver, etcd and kwok hold with 1000 nodes and with 10k pods on them.

    make bench-cluster-infra        # = python -m benchmarks.bench_cluster_infra --out out/bench

It starts a private dev cluster (own ports and files), so a developer's `default` cluster is untouched,
and stops it at the end. Every wait is bounded. Writes <out>/cluster_infra.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kubernetes import client
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.fake_nodes import wait_nodes_ready
from gpupool_devcluster.fake_pods import create_pods, pod_manifest, wait_pods_phase
from gpupool_devcluster.process import TrackedProcess

PROFILES = ("dgx-h100", "l40s-pcie", "nvlink-pairs", "a100-mig")
MEASURED = ("kube-apiserver", "etcd", "kwok")
SETTLE_S = 5.0  # let the Go runtimes finish the burst before reading RSS


@dataclass
class MemorySample:
    """Resident memory of each measured process now (VmRSS) and at its peak so far (VmHWM), MiB."""

    rss_mib: dict[str, float]
    peak_rss_mib: dict[str, float]
    etcd_db_mib: float


@dataclass
class ClusterInfraReport:
    nodes: int
    pods: int
    cluster_up_s: float
    nodes_created_s: float
    nodes_ready_s: float
    nodes_per_s: float
    pods_created_s: float
    pods_running_s: float
    pods_per_s: float
    at_nodes: MemorySample
    at_nodes_and_pods: MemorySample
    kubernetes_version: str
    kwok_version: str
    machine: dict[str, str] = field(default_factory=dict)


def _status_mib(process: TrackedProcess, key: str) -> float:
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _etcd_db_mib(etcd_url: str) -> float:
    with urllib.request.urlopen(f"{etcd_url}/metrics", timeout=5) as answer:  # loopback, plain http
        text = answer.read().decode()
    match = re.search(r"^etcd_mvcc_db_total_size_in_bytes (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) / 2**20 if match else 0.0


def _sample(cluster: DevCluster, etcd_url: str) -> MemorySample:
    time.sleep(SETTLE_S)
    processes = cluster.processes()
    return MemorySample(
        rss_mib={name: round(_status_mib(processes[name], "VmRSS"), 1) for name in MEASURED},
        peak_rss_mib={name: round(_status_mib(processes[name], "VmHWM"), 1) for name in MEASURED},
        etcd_db_mib=round(_etcd_db_mib(etcd_url), 1),
    )


def run(nodes: int, pods: int, concurrency: int, console: Console) -> ClusterInfraReport:
    cluster = DevCluster(f"bench-infra-{os.getpid()}")
    progress = Progress(
        TextColumn("{task.description:>14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    try:
        began = time.monotonic()
        up = cluster.up(log=lambda line: console.print(f"  {line}"))
        cluster_up_s = time.monotonic() - began
        console.print(f"cluster up in {cluster_up_s:.1f}s; adding {nodes} nodes ({', '.join(PROFILES)})")
        kube = ClusterClient.connect(cluster, pool_size=concurrency)
        per_profile = [nodes // len(PROFILES) + (1 if i < nodes % len(PROFILES) else 0) for i in range(len(PROFILES))]
        with progress:
            created_bar = progress.add_task("nodes created", total=nodes)
            ready_bar = progress.add_task("nodes Ready", total=nodes)
            began = time.monotonic()
            names: list[str] = []
            for profile, count in zip(PROFILES, per_profile, strict=True):
                offset = len(names)

                def created(done: int, _total: int, o: int = offset) -> None:
                    progress.update(created_bar, completed=o + done)

                names += kube.add_nodes(
                    profile, count, prefix=f"bench-{profile}-", wait=False, concurrency=concurrency, created=created
                )
            nodes_created_s = time.monotonic() - began
            wait_nodes_ready(
                kube.core, names, timeout_s=600, progress=lambda done, _t: progress.update(ready_bar, completed=done)
            )
            nodes_ready_s = time.monotonic() - began
        console.print(
            f"{nodes} nodes Ready in {nodes_ready_s:.1f}s ({nodes / nodes_ready_s:.0f} nodes/s); measuring memory"
        )
        at_nodes = _sample(cluster, up.state.etcd_url)

        namespace = "bench"
        kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        manifests = [pod_manifest(f"bench-{i:05d}", node_name=names[i % len(names)]) for i in range(pods)]
        with progress:
            created_bar = progress.add_task("pods created", total=pods)
            running_bar = progress.add_task("pods Running", total=pods)
            began = time.monotonic()
            create_pods(
                kube.core,
                namespace,
                manifests,
                concurrency=concurrency,
                progress=lambda done, _t: progress.update(created_bar, completed=done),
            )
            pods_created_s = time.monotonic() - began
            wait_pods_phase(
                kube.core,
                namespace,
                "Running",
                pods,
                timeout_s=900,
                progress=lambda done, _t: progress.update(running_bar, completed=done),
            )
            pods_running_s = time.monotonic() - began
        console.print(
            f"{pods} pods Running in {pods_running_s:.1f}s ({pods / pods_running_s:.0f} pods/s); measuring memory"
        )
        at_nodes_and_pods = _sample(cluster, up.state.etcd_url)
        kube.close()
        return ClusterInfraReport(
            nodes=nodes,
            pods=pods,
            cluster_up_s=round(cluster_up_s, 2),
            nodes_created_s=round(nodes_created_s, 2),
            nodes_ready_s=round(nodes_ready_s, 2),
            nodes_per_s=round(nodes / nodes_ready_s, 1),
            pods_created_s=round(pods_created_s, 2),
            pods_running_s=round(pods_running_s, 2),
            pods_per_s=round(pods / pods_running_s, 1),
            at_nodes=at_nodes,
            at_nodes_and_pods=at_nodes_and_pods,
            kubernetes_version=up.state.kubernetes_version,
            kwok_version=up.state.kwok_version,
            machine={"cpus": str(os.cpu_count()), "python": platform.python_version(), "kernel": platform.release()},
        )
    finally:
        cluster.down(purge=True)


def render(report: ClusterInfraReport) -> Table:
    table = Table(
        title=f"dev cluster scale: {report.nodes} fake GPU nodes, {report.pods} pods "
        f"(Kubernetes {report.kubernetes_version}, kwok {report.kwok_version}, "
        f"{report.machine.get('cpus')} CPUs)"
    )
    table.add_column("measure")
    table.add_column(f"{report.nodes} nodes", justify="right")
    table.add_column(f"+ {report.pods} pods", justify="right")
    table.add_row("time to Ready / Running (s)", f"{report.nodes_ready_s:.1f}", f"{report.pods_running_s:.1f}")
    table.add_row("rate (per s)", f"{report.nodes_per_s:.0f} nodes", f"{report.pods_per_s:.0f} pods")
    for name in MEASURED:
        table.add_row(
            f"{name} RSS MiB (peak)",
            f"{report.at_nodes.rss_mib[name]:.0f} ({report.at_nodes.peak_rss_mib[name]:.0f})",
            f"{report.at_nodes_and_pods.rss_mib[name]:.0f} ({report.at_nodes_and_pods.peak_rss_mib[name]:.0f})",
        )
    table.add_row("etcd db MiB", f"{report.at_nodes.etcd_db_mib:.0f}", f"{report.at_nodes_and_pods.etcd_db_mib:.0f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="folder for cluster_infra.json")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32, help="parallel create requests")
    args = parser.parse_args(argv)
    if min(args.nodes, args.pods, args.concurrency) <= 0:
        parser.error("--nodes, --pods and --concurrency must be at least 1")
    console = Console(stderr=True, soft_wrap=True)
    report = run(args.nodes, args.pods, args.concurrency, console)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cluster_infra.json"
    path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    Console(soft_wrap=True).print(render(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
