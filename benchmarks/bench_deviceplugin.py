"""Device plugin latency and memory (a benchmark, not a test).

    make bench-deviceplugin        # = python -m benchmarks.bench_deviceplugin --out out/bench

The plugin runs as its own process on the dgx-h100 fake profile with 80 memory units per GPU
(unitMiB 1019: floor(81559 / 1019) = 80, so 640 nvidia.com/gpu-memory devices), against the kubelet
stand-in of the tests over real gRPC on unix sockets. With a dev cluster (a running `default` one, or
a private one started here when the binaries are built: `make cluster-bins`) the pods carry real
assignments through a real kube-apiserver; without one only the API-free rows are measured.

Measured: the raw gRPC round trip of GetDevicePluginOptions (baseline), ListAndWatch first list,
ListAndWatch after a health change (Xid injected; pod bound / deleted), GetPreferredAllocation and
Allocate for whole GPUs and memory shares, and the plugin's resident memory. Writes
<out>/deviceplugin.json and prints a table. Every loop and wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_deviceplugin.api.v1beta1 import api_pb2
from gpupool_deviceplugin.publication import node_publication_for_profile
from tests.support.kubelet_standin import DeviceList, KubeletStandin  # run from the repo root: -m benchmarks...
from tests.support.objects import assignment
from tests.support.plugin_process import PluginProcess

PROFILE = "dgx-h100"
UNIT_MIB = 1019
UNITS_PER_GPU = 80
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
RSS_TARGET_MIB = 100.0


@dataclass
class Stat:
    name: str
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    vs_baseline: float | None = None  # p50 / baseline p50
    note: str = ""


@dataclass
class Report:
    profile: str
    unit_mib: int
    devices: dict[str, int]
    api_server: bool
    stats: list[Stat] = field(default_factory=list)
    rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    rss_target_mib: float = RSS_TARGET_MIB
    skipped: list[str] = field(default_factory=list)
    host: dict[str, str] = field(default_factory=dict)


def stat(name: str, samples: list[float], note: str = "") -> Stat:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return Stat(
        name, len(ms), round(statistics.median(ms), 3), round(p99, 3), round(statistics.fmean(ms), 3), note=note
    )


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark wait timed out")
        time.sleep(0.001)


def gpu_unhealthy(gpu: str, unhealthy: bool = True) -> Callable[[DeviceList], bool]:
    """ListAndWatch predicate: device `gpu` is (with unhealthy=False: is not) listed Unhealthy."""
    return lambda lst: (gpu in lst.unhealthy()) == unhealthy


def some_unhealthy(prefix: str) -> Callable[[DeviceList], bool]:
    """ListAndWatch predicate: a device whose ID starts with `prefix` (a GPU UUID: the GPU, its units) is Unhealthy."""
    return lambda lst: any(x.startswith(prefix) for x in lst.unhealthy())


def published_unit_mib(core: Any, node: str) -> int | None:
    """The gpu-memory unit size in the inventory the plugin published on `node`."""
    sharing = parse_inventory(core.read_node(node).metadata.annotations[INVENTORY_ANNOTATION]).sharing
    assert sharing is not None, "published inventory offers no gpu-memory sharing"
    return sharing.memory_unit_mib


def connect_cluster(allow_start: bool):
    """(ClusterClient, private DevCluster or None), or (None, None) with the reason printed."""
    try:
        from gpupool_devcluster.client import ClusterClient
        from gpupool_devcluster.cluster import DevCluster
        from gpupool_devcluster.layout import DEFAULT_CLUSTER
    except ImportError as exc:
        print(f"no dev cluster support ({exc}); measuring without an API server")
        return None, None
    try:
        default = DevCluster(DEFAULT_CLUSTER)
        if default.running_state() is not None:
            return ClusterClient.connect(default), None
        if not allow_start:
            print("no running dev cluster and --no-cluster-start: measuring without an API server")
            return None, None
        private = DevCluster(f"bench-dp-{__import__('os').getpid()}")
        print("starting a private dev cluster for the handshake rows ...")
        private.up()
        return ClusterClient.connect(private), private
    except Exception as exc:
        print(f"dev cluster unavailable ({exc}); measuring without an API server")
        return None, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--samples", type=int, default=300, help="samples for the cheap RPC rows")
    parser.add_argument("--cycles", type=int, default=80, help="bind/allocate/delete cycles per handshake row")
    parser.add_argument("--no-cluster-start", action="store_true", help="use a running dev cluster or none")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    kube, private = connect_cluster(not args.no_cluster_start)
    try:
        report = run(args, kube)
    finally:
        if kube is not None:
            kube.delete_nodes(list(kube.created_nodes))
            kube.close()
        if private is not None:
            private.down()
    path = args.out / "deviceplugin.json"
    path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {path}")
    return 0


def run(args, kube) -> Report:
    config = {"gpuMemory": {"unitMiB": UNIT_MIB}, "health": {"recoveryQuietPeriodSeconds": 0.2, "eventWaitMs": 50}}
    with tempfile.TemporaryDirectory(prefix="gpb-") as tmp:
        tmp_path = Path(tmp)
        kdir = tmp_path / "k"
        kdir.mkdir()
        kubelet = KubeletStandin(kdir)
        kubelet.start()
        node, core, ns = "bench-node", None, ""
        if kube is not None:
            from kubernetes import client

            (node,) = kube.add_nodes(PROFILE, 1, prefix="bench-dp-")
            core = kube.core
            ns = f"bench-dp-{int(time.time())}"
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
        plugin = PluginProcess(
            tmp_path, kdir, PROFILE, node=node, config=config, kubeconfig=kube.kubeconfig if kube else None
        ).start()
        try:
            resources = {GPU, MEM} if kube else {GPU}
            kubelet.wait_registered(resources, timeout=60)
            plugin.wait_healthz(200, timeout=30)
            if kube is not None:
                # the plugin has published its inventory (unit size differs from the kwok default)
                wait(lambda: published_unit_mib(kube.core, node) == UNIT_MIB, timeout=30)
            inv = node_publication_for_profile(PROFILE, node_name=node).inventory
            assert inv is not None
            uuids = [g.uuid for g in inv.gpus]
            report = Report(
                PROFILE,
                UNIT_MIB,
                {GPU: 8, MEM: 8 * UNITS_PER_GPU} if kube else {GPU: 8},
                kube is not None,
                host={
                    "python": platform.python_version(),
                    "machine": platform.machine(),
                    "cpus": str(__import__("os").cpu_count()),
                },
            )
            measure_rpc(report, kubelet, args.samples, kube is not None)
            measure_xid(report, kubelet, plugin, uuids, min(args.cycles, 40), kube is not None)
            if kube is not None:
                measure_handshake(report, kubelet, core, ns, node, uuids, args.cycles)
            else:
                report.skipped.append(
                    "memory-unit and handshake rows: no API server (nvidia.com/gpu-memory needs the pod watch)"
                )
            report.rss_mib, report.peak_rss_mib = rss(plugin)
            base = next(s for s in report.stats if s.name.startswith("baseline"))
            for s in report.stats:
                s.vs_baseline = round(s.p50_ms / base.p50_ms, 1) if base.p50_ms else None
            return report
        finally:
            plugin.stop()
            kubelet.stop()
            if core is not None:
                core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
                core.delete_namespace(ns)


def measure_rpc(report: Report, kubelet: KubeletStandin, n: int, with_memory: bool) -> None:
    gpu = kubelet.plugin(GPU)
    gpu.options()  # connect
    report.stats.append(stat("baseline: GetDevicePluginOptions round trip", [timed(gpu.options) for _ in range(n)]))
    for resource in [GPU, MEM] if with_memory else [GPU]:
        client = kubelet.plugin(resource)
        samples = []
        for _ in range(min(n, 60)):
            t0 = time.perf_counter()
            call = client.stub.ListAndWatch(api_pb2.Empty())
            first = next(call)
            samples.append(time.perf_counter() - t0)
            call.cancel()
            assert len(first.devices) == report.devices[resource]
        report.stats.append(stat(f"ListAndWatch first list, {resource} ({report.devices[resource]} devices)", samples))
    available = sorted(report_devices_ids(kubelet, GPU))
    note = "no assignment: pod re-list, then topology" if with_memory else "topology only (no API server)"
    report.stats.append(
        stat(
            "GetPreferredAllocation 4 of 8 GPUs (70 sets)",
            [timed(lambda: gpu.preferred(available, 4)) for _ in range(n)],
            note,
        )
    )
    if not with_memory:
        report.stats.append(
            stat(
                "Allocate 1 whole GPU (no API server)",
                [timed(partial(gpu.allocate, [available[i % 8]])) for i in range(n)],
            )
        )


def report_devices_ids(kubelet: KubeletStandin, resource: str) -> set[str]:
    w = kubelet.plugin(resource).watch()
    ids = set(w.latest().devices)
    w.close()
    return ids


def measure_xid(
    report: Report, kubelet: KubeletStandin, plugin: PluginProcess, uuids: list[str], cycles: int, with_memory: bool
) -> None:
    resource = MEM if with_memory else GPU
    watch = kubelet.plugin(resource).watch()
    watch.wait(lambda lst: not lst.unhealthy())
    marks = []
    for i in range(cycles):
        g = uuids[i % len(uuids)]
        t0 = time.monotonic()
        plugin.inject(uuid=g, xid=79)
        got = watch.wait(some_unhealthy(g), timeout=10)
        marks.append(got.at - t0)
        watch.wait(lambda lst: not lst.unhealthy(), timeout=10)
    watch.close()
    report.stats.append(
        stat(
            f"Xid injected -> ListAndWatch {resource} list received",
            marks,
            "includes the fake NVML's 5 ms event-file poll",
        )
    )


def measure_handshake(
    report: Report, kubelet: KubeletStandin, core, ns: str, node: str, uuids: list[str], cycles: int
) -> None:
    from kubernetes import client

    gpu, mem = kubelet.plugin(GPU), kubelet.plugin(MEM)
    gpu_watch, mem_watch = gpu.watch(), mem.watch()
    all_units = sorted(mem_watch.latest().devices)

    def pod(name: str, resource: str, count: int) -> str:
        body = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(
                scheduler_name="nobody",
                containers=[
                    client.V1Container(
                        name="m", image="x", resources=client.V1ResourceRequirements(limits={resource: str(count)})
                    )
                ],
            ),
        )
        return core.create_namespaced_pod(ns, body).metadata.uid

    def bind(name: str, uid: str, plan: dict) -> None:
        core.create_namespaced_binding(
            ns,
            client.V1Binding(
                metadata=client.V1ObjectMeta(name=name, annotations=assignment(node, uid, {"m": plan})),
                target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
            ),
            _preload_content=False,
        )

    flips_bind, flips_free, prefs_mem, allocs_mem, allocs_gpu = [], [], [], [], []
    for i in range(cycles):
        g = uuids[i % 8]
        # a 10-unit share of GPU g
        name = f"share-{i}"
        uid = pod(name, MEM, 10)
        t0 = time.monotonic()
        bind(name, uid, {"memory": (g, 10, UNIT_MIB)})
        flipped = gpu_watch.wait(gpu_unhealthy(g), timeout=10)
        flips_bind.append(flipped.at - t0)
        free = [u for u in all_units if u.startswith(g)]
        t1 = time.perf_counter()
        ids = mem.preferred(all_units, 10)
        prefs_mem.append(time.perf_counter() - t1)
        assert ids == free[:10] or set(ids) <= set(free), "preferred allocation left GPU g"
        allocs_mem.append(timed(partial(mem.allocate, ids)))
        t2 = time.monotonic()
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        freed = gpu_watch.wait(gpu_unhealthy(g, False), timeout=10)
        flips_free.append(freed.at - t2)
        # the same GPU whole
        name = f"whole-{i}"
        uid = pod(name, GPU, 1)
        bind(name, uid, {"devices": {GPU: [g]}})
        mem_watch.wait(some_unhealthy(g), timeout=10)
        allocs_gpu.append(timed(partial(gpu.allocate, [g])))
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        mem_watch.wait(lambda lst: not lst.unhealthy(), timeout=10)
    gpu_watch.close()
    mem_watch.close()
    report.stats += [
        stat("pod bound -> whole GPU Unhealthy on ListAndWatch", flips_bind, "API watch + plugin + stream"),
        stat("pod deleted -> whole GPU Healthy on ListAndWatch", flips_free, "API watch + plugin + stream"),
        stat("GetPreferredAllocation 10 units, assignment", prefs_mem, "640 available IDs in the request"),
        stat("Allocate 10 memory units (assignment)", allocs_mem),
        stat("Allocate 1 whole GPU (assignment)", allocs_gpu),
    ]


def rss(plugin: PluginProcess) -> tuple[float, float]:
    assert plugin.proc is not None
    fields = {}
    for line in Path(f"/proc/{plugin.proc.pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)


def print_table(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"gpupool device plugin on {report.profile} "
        f"({', '.join(f'{k}={v}' for k, v in report.devices.items())}; "
        f"API server: {'yes' if report.api_server else 'no'})"
    )
    for col in ("measurement", "n", "p50 ms", "p99 ms", "p50 / baseline", "note"):
        table.add_column(col, justify="right" if col in ("n", "p50 ms", "p99 ms", "p50 / baseline") else "left")
    for s in report.stats:
        table.add_row(
            s.name,
            str(s.n),
            f"{s.p50_ms:.2f}",
            f"{s.p99_ms:.2f}",
            "1.0" if s.name.startswith("baseline") else f"{s.vs_baseline}",
            s.note,
        )
    console = Console(width=160)
    console.print(table)
    verdict = "under" if report.peak_rss_mib < report.rss_target_mib else "OVER"
    console.print(
        f"plugin RSS {report.rss_mib} MiB (peak {report.peak_rss_mib} MiB): {verdict} the "
        f"{report.rss_target_mib:.0f} MiB target"
    )
    for why in report.skipped:
        console.print(f"skipped: {why}")


if __name__ == "__main__":
    sys.exit(main())
