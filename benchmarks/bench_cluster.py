"""The scheduler on a cluster (a benchmark, not a test): gpupool against the pinned kube-scheduler on the same
local control plane in the same run, 1,000 kwok dgx-h100 nodes (8 GPUs each) and pods asking `nvidia.com/gpu: 1`.

    make bench-cluster              # = python -m benchmarks.bench_cluster --out out/bench
    python -m benchmarks.bench_cluster --nodes 100 --pods 1000 --paced-pods 300    # quick run

Modes, each run once per scheduler on a fresh scheduler process and a fresh namespace:

* ``stream``: the scheduler is up, then every pod is created as fast as the client can;
* ``backlog``: every pod is created first, then the scheduler is started (start-up included);
* ``paced``: pods arrive at ``--paced-rate`` per second (target: p99 creation->bound under 1 s at 100/s).

Only min(pods, GPUs) pods can bind: 10,000 one-GPU pods on 8,000 GPUs leave 2,000 unschedulable, which both
schedulers must also report (FailedScheduling); a run ends at the last bind.

Bind times come from a client-side watch, in a process of its own so that the create threads do not delay
it, that records the local time at which each pod is first seen with ``spec.nodeName``; creation times are the
local times at which each create call returned (the watch's own delay, create returned -> pod first seen, is
reported as ``watch_lag_ms``). Neither the PodScheduled condition nor the Scheduled event would do: the API
server writes both with 1-second resolution. pods/s = bound pods / (last bind - first create, or - scheduler
start for backlog). Memory: VmHWM of the scheduler process (its peak RSS; one process per run). CPU: utime +
stime of each process during the run. Between runs the pods are deleted (grace period 0), the run waits until
they are gone and until the control plane is idle again.

The decision cost of the placement core at 100 / 1,000 / 5,000 such nodes, 60% full, is measured by calling
``decide()`` directly: bench_placement's ``decision_cost`` (a snapshot that never changes) and a stream of
decisions each assumed before the next, as the scheduler's cycle does; each with every feasible node scored
and with the scheduler's default sampling (percentage 0: adaptive). Writes <out>/cluster.json, cluster.md and
cluster.png; ``--cprofile DIR`` runs gpupool under cProfile (its event-loop thread only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.bench_cluster_infra import _status_mib
from benchmarks.bench_placement import decision_cost, fill_randomly
from gpupool_devcluster import components
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_devcluster.fake_pods import pod_manifest
from gpupool_devcluster.kubeconfig import api_client
from gpupool_devcluster.process import TrackedProcess, start
from gpupool_devcluster.raw import discard, read_json
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.sampling import NodeSampler, nodes_to_score
from gpupool_sched.placement.workload import RollingProfile

GPUPOOL, KUBE = "gpupool", "kube-scheduler"
SCHEDULERS = (GPUPOOL, KUBE)
MODES = ("stream", "backlog", "paced")
SCHEDULER_NAMES = {GPUPOOL: "gpupool-bench", KUBE: "kube-bench"}  # the pods' spec.schedulerName
CLUSTER_PROCESSES = ("kube-apiserver", "etcd", "kwok")
TIMELINE_POINTS = 400  # bound-pods curve kept per run (for the plot)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- measuring a run


class BindWatch:
    """When each pod of `namespace` is first seen with spec.nodeName (local monotonic time), from a watch
    read on a thread; also when each pod is first seen at all (`added`: the watch's own delay, measured
    against the create call's return). A watch that breaks is resumed after a LIST; pods first seen bound
    on such a LIST are counted in `relisted` (their time is the LIST's, later than the bind)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, on_bound: Callable[[int], None] | None = None) -> None:
        self.core = core
        self.namespace = namespace
        self.on_bound = on_bound
        self.bound: dict[str, float] = {}
        self.added: dict[str, float] = {}
        self.relisted = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._version: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{namespace}", daemon=True)

    def start(self) -> None:
        self._version = self._list(first=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                with contextlib.suppress(Exception):
                    self._stream.close()  # unblocks the reader
        self._thread.join(timeout=15)

    def _seen(self, name: str, at: float) -> None:
        if name not in self.bound:
            self.bound[name] = at
            if self.on_bound:
                self.on_bound(len(self.bound))

    def _list(self, *, first: bool = False) -> str:
        listing = read_json(self.core.list_namespaced_pod(self.namespace, _preload_content=False))
        now = time.monotonic()
        for item in listing["items"]:
            name = item["metadata"]["name"]
            self.added.setdefault(name, now)
            if (item.get("spec") or {}).get("nodeName") and name not in self.bound:
                self.relisted += 0 if first else 1
                self._seen(name, now)
        return str(listing["metadata"]["resourceVersion"])

    def _run(self) -> None:
        version = self._version
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._follow(version)
            except Exception as exc:  # a broken watch: list again and resume
                if self._stop.is_set():
                    return
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                version = None
                time.sleep(0.5)

    def _follow(self, version: str) -> str | None:
        stream = self.core.list_namespaced_pod(
            self.namespace,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=120,
            _preload_content=False,
        )
        with self._lock:
            self._stream = stream
        try:
            for line in stream:
                seen = time.monotonic()
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":  # 410 Gone: too old a version; list again
                    return None
                version = obj["metadata"]["resourceVersion"]
                if event["type"] in ("ADDED", "MODIFIED"):
                    name = obj["metadata"]["name"]
                    self.added.setdefault(name, seen)
                    if (obj.get("spec") or {}).get("nodeName"):
                        self._seen(name, seen)
            return version
        finally:
            with self._lock:
                self._stream = None
            with contextlib.suppress(Exception):
                stream.close()
                stream.release_conn()


@dataclass(frozen=True)
class Binds:
    bound: dict[str, float]
    added: dict[str, float]
    relisted: int
    errors: list[str]


def _watch_process(kubeconfig: str, namespace: str, count: Any, ready: Any, stop: Any, results: Any) -> None:
    watch = BindWatch(client.CoreV1Api(api_client(Path(kubeconfig), pool_size=2)), namespace,
                      on_bound=lambda n: setattr(count, "value", n))
    watch.start()
    ready.set()
    stop.wait()
    watch.stop()
    results.send(Binds(watch.bound, watch.added, watch.relisted, watch.errors))


class WatchProcess:
    """A BindWatch in a process of its own, so that the benchmark's create threads do not delay its
    timestamps by holding the GIL (CLOCK_MONOTONIC is the same in every process)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and open connections
        self._count = ctx.RawValue("i", 0)
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._receive, send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_watch_process, args=(str(kubeconfig), namespace, self._count, self._ready, self._stop, send),
            name=f"watch-{namespace}", daemon=True,
        )

    @property
    def count(self) -> int:
        return int(self._count.value)

    def start(self, timeout_s: float = 60.0) -> None:
        self._process.start()
        if not self._ready.wait(timeout_s):
            self._process.kill()
            raise DevClusterError(f"the bind watch did not start within {timeout_s:.0f}s")

    def stop(self, timeout_s: float = 60.0) -> Binds:
        self._stop.set()
        try:
            if not self._receive.poll(timeout_s):
                raise DevClusterError("the bind watch did not report back")
            return self._receive.recv()
        finally:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()


class ProcessSampler:
    """Resident memory (VmRSS) of one process every `interval_s`, on a thread: the curve's maximum, next to
    the kernel's own peak (VmHWM) read at the end."""

    def __init__(self, process: TrackedProcess, interval_s: float = 0.5) -> None:
        self.process = process
        self.interval_s = interval_s
        self.max_rss_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{process.pid}", daemon=True)

    def __enter__(self) -> ProcessSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                self.max_rss_mib = max(self.max_rss_mib, _status_mib(self.process, "VmRSS"))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process so far, all its threads (0 when it is gone)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def main_thread_cpu(pid: int) -> float:
    """utime + stime of the process's first thread: for gpupool, its event loop (kopf, state, queue, cycle);
    the rest is the API thread pool (binds, events) and the libraries' threads."""
    return _stat_cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


def _stat_cpu(path: Path) -> float:
    try:
        stat = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def create_timed(
    core: client.CoreV1Api,
    namespace: str,
    manifests: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    rate: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Create the pods concurrently and return when each create call returned (local monotonic time).
    With `rate`, pod i is not sent before start + i / rate (paced arrivals); else as fast as possible."""
    lock = threading.Lock()
    created: dict[str, float] = {}
    began = time.monotonic()

    def create(index: int, body: dict[str, Any]) -> None:
        if rate:
            delay = began + index / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        try:
            discard(core.create_namespaced_pod(namespace, body=body, _preload_content=False))
        except ApiException as exc:
            raise DevClusterError(
                f"create pod {namespace}/{body['metadata']['name']}: HTTP {exc.status} {exc.reason}"
            ) from None
        done = time.monotonic()
        with lock:
            created[body["metadata"]["name"]] = done
            if progress:
                progress(len(created))

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(manifests) or 1))) as pool:
        for future in [pool.submit(create, i, body) for i, body in enumerate(manifests)]:
            future.result()
    return created


def drain_events(core: client.CoreV1Api, namespace: str, reason: str, expected: int, *, quiet_s: float = 5.0,
                 timeout_s: float = 120.0) -> tuple[int, float]:
    """Events of `reason` once the count reaches `expected` or stops growing for `quiet_s` (at most
    `timeout_s`), and how long that took."""
    began = time.monotonic()
    count, last_change = count_events(core, namespace, reason), began
    while count < expected and time.monotonic() - last_change < quiet_s and time.monotonic() - began < timeout_s:
        time.sleep(1.0)
        now = count_events(core, namespace, reason)
        if now != count:
            count, last_change = now, time.monotonic()
    return count, round(time.monotonic() - began, 1)


def count_events(core: client.CoreV1Api, namespace: str, reason: str) -> int:
    """Events of `reason` in the namespace (core/v1 also lists kube-scheduler's events.k8s.io/v1 ones)."""
    count, cont = 0, None
    while True:
        resp = core.list_namespaced_event(namespace, field_selector=f"reason={reason}", limit=2000,
                                          _continue=cont, _preload_content=False)
        body = json.loads(resp.data)
        count += len(body.get("items") or ())
        cont = (body.get("metadata") or {}).get("continue")
        if not cont:
            return count


def delete_all_pods(core: client.CoreV1Api, namespace: str, timeout_s: float) -> float:
    """Delete every pod of the namespace at once (grace period 0: kwok has nothing to stop) and wait until
    the API server has none left; returns the seconds it took."""
    began = time.monotonic()
    deadline = began + timeout_s
    while True:
        with contextlib.suppress(ApiException):  # a slow collection delete times out; ask again
            discard(
                core.delete_collection_namespaced_pod(
                    namespace, grace_period_seconds=0, _preload_content=False, _request_timeout=120
                )
            )
        listing = read_json(core.list_namespaced_pod(namespace, limit=1, _preload_content=False))
        if not listing["items"]:
            return time.monotonic() - began
        if time.monotonic() > deadline:
            left = len(listing["items"]) + int(listing["metadata"].get("remainingItemCount") or 0)
            raise DevClusterError(f"{left} pods still in {namespace} after {timeout_s:.0f}s")
        time.sleep(1.0)


def settle(cluster: DevCluster, *, idle_cores: float = 0.15, window_s: float = 2.0, timeout_s: float = 60.0) -> float:
    """Wait until kube-apiserver, etcd and kwok together use less than `idle_cores` over `window_s`: kwok keeps
    retrying its pod-delete stage for pods that a grace-0 delete already removed, which the next run must
    not pay for. Returns the seconds waited (at most `timeout_s`)."""
    began = time.monotonic()
    pids = [p.pid for n, p in cluster.processes().items() if n in CLUSTER_PROCESSES]
    while time.monotonic() - began < timeout_s:
        before = sum(cpu_seconds(pid) for pid in pids)
        time.sleep(window_s)
        if sum(cpu_seconds(pid) for pid in pids) - before < idle_cores * window_s:
            break
    return time.monotonic() - began


def scrape_gpupool(port: int) -> dict[str, float]:
    """The gpupool_scheduler_* counters and histogram sums/counts worth keeping, flattened to one dict."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:  # loopback
        text = answer.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("gpupool_scheduler_") or family.name.endswith("_node_gpus_bound"):
            continue
        if family.name.endswith("_node_gpu_memory_units_bound"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


WRITE_KINDS = {  # (verb, resource, subresource) of apiserver_request_total -> what the run reports
    ("POST", "pods", "binding"): "bindings", ("POST", "bindings", ""): "bindings",
    ("POST", "events", ""): "events", ("PATCH", "events", ""): "events",
    ("PATCH", "pods", "status"): "pod_status_patches", ("POST", "pods", "eviction"): "evictions",
}


def apiserver_writes(kube: ClusterClient) -> dict[str, float]:
    """The API server's own count of the writes a scheduler makes (apiserver_request_total by verb, resource
    and subresource), summed per kind of WRITE_KINDS. kwok also patches pod status (its fake kubelets), so
    `pod_status_patches` is everybody's; Bindings and Events are the scheduler's."""
    from prometheus_client.parser import text_string_to_metric_families

    api = kube.api_client
    method, url, headers, body, post = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    answer = api.call_api(method, url, headers, body, post)
    answer.read()
    text = answer.data.decode()
    out = dict.fromkeys(set(WRITE_KINDS.values()), 0.0)
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":  # the parser drops the _total suffix of counters
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            kind = WRITE_KINDS.get((labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", "")))
            if kind is not None:
                out[kind] += sample.value
    return out


# ---------------------------------------------------------------- the schedulers under test


@dataclass
class Launched:
    scheduler: str
    process: TrackedProcess
    metrics_port: int | None  # gpupool's /metrics (kube-scheduler's needs authentication: not read)
    started: float  # monotonic, before the process was spawned
    ready_s: float  # spawn -> healthy


def launch(kube: ClusterClient, scheduler: str, tag: str, opts: RunOptions) -> Launched:
    started = time.monotonic()
    if scheduler == KUBE:
        process = kube.start_kube_scheduler(SCHEDULER_NAMES[KUBE], tag=tag)  # waits for its /healthz
        return Launched(scheduler, process, None, started, time.monotonic() - started)
    port = components.free_port()
    layout = kube.cluster.layout
    python = [sys.executable]
    if opts.cprofile_dir is not None:  # the event loop's thread only: cProfile sees no other thread
        opts.cprofile_dir.mkdir(parents=True, exist_ok=True)
        python += ["-m", "cProfile", "-o", str(opts.cprofile_dir.resolve() / f"{tag}.prof")]
    argv = [
        *python, "-m", "gpupool_sched", "--kubeconfig", str(kube.kubeconfig),
        "--scheduler-name", SCHEDULER_NAMES[GPUPOOL], "--metrics-port", str(port),
        "--metrics-address", components.LOOPBACK, *opts.gpupool_args,
    ]
    # the pid file sits in the cluster's run/ folder: `down` stops it too if the benchmark dies
    env = dict(os.environ)
    if opts.gpupool_src is not None:  # another tree's scheduler (an A/B against a baseline commit)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(opts.gpupool_src), env.get("PYTHONPATH")) if p)
    process = start(tag, argv, layout.pid_file(tag), layout.log_file(tag), env=env)
    try:
        components.wait_ready(process, f"http://{components.LOOPBACK}:{port}/readyz", timeout_s=300)
    except BaseException:
        process.stop()
        raise
    return Launched(scheduler, process, port, started, time.monotonic() - started)


# ---------------------------------------------------------------- one run


@dataclass
class RunResult:
    mode: str
    scheduler: str
    pods: int
    expected: int  # pods that fit: min(pods, GPUs in the cluster)
    bound: int
    seconds: float  # first create (backlog: scheduler start) -> last bind
    pods_per_s: float
    latency_ms: dict[str, float]  # creation -> bound: p50, p90, p99, max
    watch_lag_ms: dict[str, float]  # create call returned -> pod first seen on the watch: p50, p99
    create_s: float  # first create sent -> last create returned
    create_per_s: float
    ready_s: float  # scheduler spawn -> healthy
    rss_peak_mib: float  # VmHWM at the end of the run
    rss_sampled_max_mib: float
    cpu_s: dict[str, float]  # CPU seconds during the run, per process (scheduler, apiserver, ..., bench)
    delete_s: float  # pods deleted and the cluster quiet again (before the next run)
    relisted: int  # binds seen on a LIST after a broken watch (late timestamps)
    watch_errors: list[str]
    timeline_s: list[float]  # seconds from the start at which the k-th pod was bound (sampled)
    timeline_n: list[int]
    created_s: list[float]  # the same for the creates (negative for a backlog: before the start)
    created_n: list[int]
    metrics: dict[str, float] = field(default_factory=dict)  # gpupool's own /metrics at the end
    load_before: float = 0.0  # 1-minute load average before the run (other work on the machine)
    scheduled_events: int = 0  # `Scheduled` Events in the run's namespace when its last pod was bound
    scheduled_events_final: int = 0  # ... once the scheduler's queued Events went out (drain_events)
    events_drain_s: float = 0.0  # how long after the last bind that took
    writes_per_s: dict[str, float] = field(default_factory=dict)  # API writes per kind per run second (apiserver)
    timed_out: bool = False


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class RunOptions:
    concurrency: int  # parallel create requests
    timeout_s: float  # one run at most
    stall_s: float  # give up when nothing was bound for this long after the last create
    gpupool_args: tuple[str, ...] = ()
    cprofile_dir: Path | None = None  # run gpupool under cProfile, one .prof per run
    gpupool_src: Path | None = None  # the scheduler's code from this src/ folder (PYTHONPATH first)


@dataclass(frozen=True)
class RunSpec:
    mode: str
    scheduler: str
    pods: int
    expected: int
    rate: float | None
    namespace: str


def one_run(kube: ClusterClient, spec: RunSpec, opts: RunOptions, console: Console) -> RunResult:
    core = kube.core
    discard(core.create_namespace({"metadata": {"name": spec.namespace}}, _preload_content=False))
    manifests = [pod_manifest(f"p-{i:05d}", scheduler_name=SCHEDULER_NAMES[spec.scheduler], gpus=1)
                 for i in range(spec.pods)]
    load_before = os.getloadavg()[0]
    watch = WatchProcess(kube.kubeconfig, spec.namespace)
    watch.start()
    progress = Progress(
        TextColumn("{task.description:>26}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not console.is_terminal,
    )
    others = kube.cluster.processes()
    cpu_before = {n: cpu_seconds(others[n].pid) for n in CLUSTER_PROCESSES if n in others}
    bench_cpu_before = time.process_time()
    writes_before = apiserver_writes(kube)
    created: dict[str, float] = {}
    create_error: list[BaseException] = []
    launched: Launched | None = None
    tag = f"bench-{spec.scheduler}-{spec.mode}"

    def submit(done: Callable[[int], None]) -> None:
        try:
            created.update(create_timed(core, spec.namespace, manifests, concurrency=opts.concurrency,
                                        rate=spec.rate, progress=done))
        except BaseException as exc:
            create_error.append(exc)

    with progress:
        created_bar = progress.add_task(f"{spec.mode} {spec.scheduler}: created", total=spec.pods)
        bound_bar = progress.add_task(f"{spec.mode} {spec.scheduler}: bound", total=spec.expected)

        def done(n: int) -> None:
            progress.update(created_bar, completed=n)

        try:
            creator = threading.Thread(target=submit, args=(done,), name="create", daemon=True)
            if spec.mode == "backlog":
                create_began = time.monotonic()
                submit(done)
                if create_error:
                    raise create_error[0]
                launched = launch(kube, spec.scheduler, tag, opts)
                began = launched.started
                scheduler_cpu_before = (0.0, 0.0)  # the start-up is part of a backlog run
            else:
                launched = launch(kube, spec.scheduler, tag, opts)
                scheduler_cpu_before = (cpu_seconds(launched.process.pid), main_thread_cpu(launched.process.pid))
                began = create_began = time.monotonic()
                creator.start()
            with ProcessSampler(launched.process) as sampler:
                timed_out = _wait_bound(watch, spec, began, opts, created, launched,
                                        lambda n: progress.update(bound_bar, completed=min(n, spec.expected)))
                if creator.ident is not None:
                    creator.join()
                if create_error:
                    raise create_error[0]
            pid = launched.process.pid
            rss_peak = _status_mib(launched.process, "VmHWM")
            cpu = {"scheduler": cpu_seconds(pid) - scheduler_cpu_before[0]}
            if spec.scheduler == GPUPOOL:
                cpu["scheduler_main_thread"] = main_thread_cpu(pid) - scheduler_cpu_before[1]
            cpu.update({n: cpu_seconds(others[n].pid) - before for n, before in cpu_before.items()})
            cpu["bench"] = time.process_time() - bench_cpu_before
            metrics = scrape_gpupool(launched.metrics_port) if launched.metrics_port else {}
            scheduled_events = count_events(core, spec.namespace, "Scheduled")  # posted by the last bind
            writes_after = apiserver_writes(kube)
            # then, not measured: every Scheduled Event the scheduler still has queued (none dropped with
            # --scheduled-events all) goes out before it is stopped
            events_final, events_drain_s = drain_events(core, spec.namespace, "Scheduled", spec.expected)
        finally:
            if launched is not None:
                launched.process.stop()
            binds = watch.stop()
    create_ended = max(created.values(), default=create_began)
    delete_s = delete_all_pods(core, spec.namespace, timeout_s=600)
    delete_s += settle(kube.cluster)
    result = _result(spec, binds, created, began, create_began, create_ended, launched, rss_peak,
                     sampler.max_rss_mib, cpu, delete_s, metrics, load_before, timed_out, scheduled_events)
    result.scheduled_events_final, result.events_drain_s = events_final, events_drain_s
    if result.seconds and result.seconds == result.seconds:  # not NaN: something was bound
        result.writes_per_s = {k: round((writes_after[k] - writes_before.get(k, 0.0)) / result.seconds, 1)
                               for k in sorted(writes_after)}
    return result


def _wait_bound(
    watch: WatchProcess,
    spec: RunSpec,
    began: float,
    opts: RunOptions,
    created: dict[str, float],
    launched: Launched,
    progress: Callable[[int], None],
) -> bool:
    """Until `expected` pods are bound; True when it gave up (timeout, or no bind for `stall_s` after the
    last create, or the scheduler died)."""
    last_count, last_change = 0, time.monotonic()
    while True:
        count = watch.count
        now = time.monotonic()
        progress(count)
        if count >= spec.expected:
            return False
        if count != last_count:
            last_count, last_change = count, now
        all_created = len(created) >= spec.pods
        if now - began > opts.timeout_s or (all_created and now - last_change > opts.stall_s):
            return True
        if not launched.process.alive():
            raise DevClusterError(
                f"{launched.scheduler} exited during the run; log tail:\n{launched.process.log_tail(20)}"
            )
        time.sleep(0.1)


def _result(
    spec: RunSpec,
    binds: Binds,
    created: dict[str, float],
    began: float,
    create_began: float,
    create_ended: float,
    launched: Launched,
    rss_peak: float,
    rss_sampled: float,
    cpu: dict[str, float],
    delete_s: float,
    metrics: dict[str, float],
    load_before: float,
    timed_out: bool,
    scheduled_events: int,
) -> RunResult:
    bound = binds.bound
    times = sorted(t - began for t in bound.values())
    latencies = sorted(max(0.0, t - created[n]) for n, t in bound.items() if n in created)
    lags = sorted(t - created[n] for n, t in binds.added.items() if n in created)
    seconds = times[-1] if times else float("nan")
    picks = _sample_indices(len(times))
    creates = sorted(t - began for t in created.values())
    create_picks = _sample_indices(len(creates))
    create_s = create_ended - create_began
    return RunResult(
        mode=spec.mode,
        scheduler=spec.scheduler,
        pods=spec.pods,
        expected=spec.expected,
        bound=len(bound),
        seconds=round(seconds, 3),
        pods_per_s=round(len(bound) / seconds, 1) if times and seconds > 0 else 0.0,
        latency_ms={q: round(1000 * percentile(latencies, v), 1)
                    for q, v in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        watch_lag_ms={q: round(1000 * percentile(lags, v), 1) for q, v in (("p50", 50), ("p99", 99))},
        create_s=round(create_s, 2),
        create_per_s=round(spec.pods / create_s, 1) if create_s > 0 else 0.0,
        ready_s=round(launched.ready_s, 2),
        rss_peak_mib=round(rss_peak, 1),
        rss_sampled_max_mib=round(rss_sampled, 1),
        cpu_s={k: round(v, 2) for k, v in cpu.items()},
        delete_s=round(delete_s, 1),
        relisted=binds.relisted,
        watch_errors=binds.errors[:5],
        timeline_s=[round(times[i], 3) for i in picks],
        timeline_n=[i + 1 for i in picks],
        created_s=[round(creates[i], 3) for i in create_picks],
        created_n=[i + 1 for i in create_picks],
        metrics=metrics,
        load_before=round(load_before, 2),
        scheduled_events=scheduled_events,
        timed_out=timed_out,
    )


def _sample_indices(n: int) -> list[int]:
    """About TIMELINE_POINTS evenly spread indices of n sorted values, the last one included."""
    step = max(1, n // TIMELINE_POINTS)
    picks = [*range(step - 1, n, step)]
    if n and picks[-1] != n - 1:
        picks.append(n - 1)
    return picks


# ---------------------------------------------------------------- decision cost of the core


@dataclass(frozen=True)
class DecisionCost:
    """ms per decision (p50) of the placement core for this benchmark's pod, at `nodes` nodes 60% full.
    `static_*`: bench_placement's decision_cost (one snapshot, never changed, memo defeated by varying
    the pod's CPU). `stream_*`: the same pod decided again and again and each placement assumed, as the
    scheduler's cycle does (every decision sees the node the previous one changed)."""

    nodes: int
    static_all_ms: float  # every feasible node scored
    static_sampled_ms: float  # adaptive sample (percentage 0, the scheduler's default)
    stream_all_ms: float
    stream_sampled_ms: float
    sampled_nodes: int  # nodes a sample scores (nodes_to_score(nodes, 0))


def dgx_nodes_and_request(profile: str, count: int) -> tuple[list[NodeSpec], PodRequest]:
    """`count` nodes as the scheduler's state sees a fake `profile` node, and the PodRequest it plans for a
    1-GPU pod of this benchmark (built by the scheduler's own code, from the same manifests)."""
    state = ClusterState(SCHEDULER_NAMES[GPUPOOL])
    state.apply_node(fake_node_manifest("bench-0", profile, publication_for_profile(profile, node_name="bench-0")))
    spec = state.nodes["bench-0"].spec
    pod = pod_manifest("p-0", scheduler_name=SCHEDULER_NAMES[GPUPOOL], gpus=1)
    pod["metadata"].update(uid="00000000-0000-0000-0000-000000000000", namespace="bench")
    request = state.plan(pod).request
    return [replace(spec, name=f"node-{i:05d}") for i in range(count)], request


def stream_decision_cost(
    nodes: list[NodeSpec], request: PodRequest, profile: WorkloadProfile, fill: float, decisions: int, seed: int,
    sample_percentage: int | None = None,
) -> list[float]:
    """Seconds per decision when each placement is assumed before the next decision (the cycle's path)."""
    rng = np.random.default_rng(seed)
    snap = ClusterSnapshot(nodes)
    policy = build_policy(GPUPOOL, profile)
    fill_randomly(snap, [request], fill, rng)
    sampler = NodeSampler.for_snapshot(snap, sample_percentage) if sample_percentage is not None else None
    times = []
    for _ in range(decisions):
        start = time.perf_counter()
        decision = decide(snap, request, policy, rng, sample=sampler.follow(snap) if sampler else None)
        times.append(time.perf_counter() - start)
        if isinstance(decision, Placement):
            snap.assume(request, decision)
    return times


def decision_costs(profile: str, sizes: Sequence[int], decisions: int) -> list[DecisionCost]:
    """The core's cost per decision for this benchmark's pods, with the workload profile the scheduler
    learns from them (RollingProfile after a full window of 1-GPU pods)."""
    out = []
    for size in sizes:
        nodes, request = dgx_nodes_and_request(profile, size)
        rolling = RollingProfile()
        for _ in range(rolling.window):
            rolling.observe(request)
        learnt = rolling.profile()
        ms = {}
        for label, pct in (("all", None), ("sampled", 0)):
            static = decision_cost(nodes, [request], GPUPOOL, learnt, 0.6, decisions, seed=size, sample_percentage=pct)
            stream = stream_decision_cost(nodes, request, learnt, 0.6, decisions, seed=size, sample_percentage=pct)
            ms[f"static_{label}"] = round(1000 * statistics.median(static), 3)
            ms[f"stream_{label}"] = round(1000 * statistics.median(stream), 3)
        out.append(DecisionCost(size, ms["static_all"], ms["static_sampled"], ms["stream_all"], ms["stream_sampled"],
                                nodes_to_score(size, 0)))
    return out


# ---------------------------------------------------------------- the whole benchmark


@dataclass
class ClusterReport:
    nodes: int
    profile: str
    gpus: int
    pods: int
    paced_pods: int
    paced_rate: float
    runs: list[RunResult]
    ratios: dict[str, dict[str, float]]  # mode -> measure -> gpupool / kube-scheduler
    decisions: list[DecisionCost]
    nodes_ready_s: float
    gpupool_args: list[str]
    kubernetes_version: str
    kwok_version: str
    machine: dict[str, str] = field(default_factory=dict)
    gpupool_src: str = ""  # --gpupool-src: the scheduler's code came from there ("": the installed one)


def gpus_per_node(profile: str) -> int:
    return int(publication_for_profile(profile).capacity.get("nvidia.com/gpu", 0))


def run_cluster(args: argparse.Namespace, console: Console) -> tuple[list[RunResult], float, str, str]:
    cluster = DevCluster(f"bench-cluster-{os.getpid()}")
    runs: list[RunResult] = []
    schedulers = [s for s in SCHEDULERS if not (s == KUBE and args.skip_kube_scheduler)]
    if args.skip_gpupool:
        schedulers.remove(GPUPOOL)
    capacity = args.nodes * gpus_per_node(args.profile)
    opts = RunOptions(args.concurrency, args.run_timeout, args.stall_timeout, tuple(args.gpupool_arg), args.cprofile,
                      args.gpupool_src)
    try:
        up = cluster.up(log=lambda line: console.print(f"  {line}"))
        kube = ClusterClient.connect(cluster, pool_size=args.concurrency + 4)
        progress = Progress(
            TextColumn("{task.description:>26}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, disable=not console.is_terminal,
        )
        with progress:
            bar = progress.add_task("nodes Ready", total=args.nodes)
            began = time.monotonic()
            kube.add_nodes(
                args.profile, args.nodes, prefix="bench-", concurrency=args.concurrency, timeout_s=600,
                ready=lambda done, _t: progress.update(bar, completed=done),
            )
            nodes_ready_s = time.monotonic() - began
        console.print(f"{args.nodes} {args.profile} nodes ({capacity} GPUs) Ready in {nodes_ready_s:.1f}s")
        # the first run must not pay for kwok and the API server still busy with the new nodes
        console.print(f"control plane quiet after {settle(cluster):.1f}s more")
        if args.warmup_pods and schedulers:
            # the first run on a new cluster paid for something cold in kwok (its CPU for the same
            # 10,000 pods: 13-25 s in a first run, 7-9 s in later ones): a run that is not reported
            # goes first, with kube-scheduler when it runs, so that the first measured run pays nothing
            first = KUBE if KUBE in schedulers else schedulers[0]
            n = min(args.warmup_pods, capacity)
            warm = one_run(kube, RunSpec("stream", first, n, n, None, "warmup"), opts, console)
            console.print(f"warm-up  {first:15s} {warm.bound}/{n} bound in {warm.seconds:.1f}s (not reported); "
                          f"CPU {warm.cpu_s}")
        for m, mode in enumerate(args.modes):
            pods = args.paced_pods if mode == "paced" else args.pods
            rate = args.paced_rate if mode == "paced" else None
            # alternate which scheduler goes first, so that neither always meets the older etcd
            for scheduler in schedulers if m % 2 == 0 else schedulers[::-1]:
                spec = RunSpec(mode, scheduler, pods, min(pods, capacity), rate,
                               f"{mode}-{'gpupool' if scheduler == GPUPOOL else 'kube'}")
                result = one_run(kube, spec, opts, console)
                runs.append(result)
                console.print(
                    f"{mode:8s} {scheduler:15s} {result.bound}/{result.expected} bound in {result.seconds:.1f}s "
                    f"= {result.pods_per_s:.0f} pods/s; p50 {result.latency_ms['p50']:.0f} ms, "
                    f"p99 {result.latency_ms['p99']:.0f} ms; peak RSS {result.rss_peak_mib:.0f} MiB; "
                    f"CPU {result.cpu_s}{' [TIMED OUT]' if result.timed_out else ''}"
                )
        kube.close()
        return runs, nodes_ready_s, up.state.kubernetes_version, up.state.kwok_version
    finally:
        cluster.down(purge=not args.keep_logs)
        if args.keep_logs:
            console.print(f"logs kept in {cluster.layout.root / 'logs'}")


def ratios(runs: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """gpupool / kube-scheduler per mode, for the measures where both ran."""
    out: dict[str, dict[str, float]] = {}
    by = {(r.mode, r.scheduler): r for r in runs}
    for mode in MODES:
        ours, theirs = by.get((mode, GPUPOOL)), by.get((mode, KUBE))
        if ours is None or theirs is None:
            continue
        pairs = {
            "pods_per_s": (ours.pods_per_s, theirs.pods_per_s),
            "p50_ms": (ours.latency_ms["p50"], theirs.latency_ms["p50"]),
            "p99_ms": (ours.latency_ms["p99"], theirs.latency_ms["p99"]),
            "rss_peak_mib": (ours.rss_peak_mib, theirs.rss_peak_mib),
            "cpu_s": (ours.cpu_s["scheduler"], theirs.cpu_s["scheduler"]),
        }
        out[mode] = {k: round(a / b, 2) for k, (a, b) in pairs.items() if b}
    return out


# ---------------------------------------------------------------- output


def _row(r: RunResult, ratio: dict[str, float] | None) -> list[str]:
    def rel(key: str) -> str:
        return f" (x{ratio[key]:.2f})" if ratio and key in ratio else ""

    return [
        r.mode,
        r.scheduler,
        f"{r.bound}/{r.expected}" + (" timed out" if r.timed_out else ""),
        f"{r.seconds:.1f}",
        f"{r.pods_per_s:.0f}{rel('pods_per_s')}",
        f"{r.latency_ms['p50']:.0f}{rel('p50_ms')}",
        f"{r.latency_ms['p99']:.0f}{rel('p99_ms')}",
        f"{r.rss_peak_mib:.0f}{rel('rss_peak_mib')}",
        f"{r.cpu_s['scheduler']:.1f}{rel('cpu_s')}",
        f"{r.cpu_s.get('kube-apiserver', 0.0):.1f}",
        f"{r.create_per_s:.0f}",
        f"{r.scheduled_events} / {r.scheduled_events_final}",
        " / ".join(f"{r.writes_per_s.get(k, 0.0):.0f}" for k in ("bindings", "events", "pod_status_patches"))
        if r.writes_per_s else "-",
    ]


HEADERS = (
    "mode", "scheduler", "bound", "s", "pods/s", "p50 ms", "p99 ms", "peak RSS MiB", "CPU s", "apiserver CPU s",
    "created/s", "Scheduled Events: at last bind / after drain", "writes/s: Binding / Event / pod status",
)


DECISION_HEADERS = ("nodes", "static, all scored", "static, sampled", "stream, all scored", "stream, sampled",
                    "nodes sampled")


def _decision_row(d: DecisionCost) -> list[str]:
    return [str(d.nodes), f"{d.static_all_ms:.2f}", f"{d.static_sampled_ms:.2f}", f"{d.stream_all_ms:.2f}",
            f"{d.stream_sampled_ms:.2f}", str(d.sampled_nodes)]


def targets(report: ClusterReport) -> list[tuple[str, str, str]]:
    """(target, measured, met) rows; reported, never asserted."""
    by = {(r.mode, r.scheduler): r for r in report.runs}
    rows = []
    for mode in ("stream", "backlog"):
        ours, theirs = by.get((mode, GPUPOOL)), by.get((mode, KUBE))
        if ours and theirs:
            rows.append((f"{mode}: pods/s >= kube-scheduler's", f"{ours.pods_per_s:.0f} vs {theirs.pods_per_s:.0f}",
                         "yes" if ours.pods_per_s >= theirs.pods_per_s else "no"))
    paced = by.get(("paced", GPUPOOL))
    if paced:
        rows.append((f"p99 creation->bound < 1 s at {report.paced_rate:g} pods/s", f"{paced.latency_ms['p99']:.0f} ms",
                     "yes" if paced.latency_ms["p99"] < 1000 else "no"))
    peaks = [r.rss_peak_mib for r in report.runs if r.scheduler == GPUPOOL]
    if peaks:
        rows.append(("gpupool RSS < 500 MiB", f"{max(peaks):.0f} MiB peak", "yes" if max(peaks) < 500 else "no"))
    return rows


def render(report: ClusterReport) -> list[Table]:
    tables = []
    if report.runs:
        table = Table(
            title=f"schedulers on {report.nodes} x {report.profile} ({report.gpus} GPUs), {report.pods} pods "
            f"(paced: {report.paced_pods} at {report.paced_rate:g}/s); ratios gpupool / kube-scheduler "
            f"(Kubernetes {report.kubernetes_version}, {report.machine.get('cpus')} CPUs)"
        )
        for h in HEADERS:
            table.add_column(h, justify="left" if h in ("mode", "scheduler") else "right")
        for r in report.runs:
            table.add_row(*_row(r, report.ratios.get(r.mode) if r.scheduler == GPUPOOL else None))
        tables.append(table)
        goals = Table(title="targets (reported, not asserted)")
        for h in ("target", "measured", "met"):
            goals.add_column(h)
        for row in targets(report):
            goals.add_row(*row)
        tables.append(goals)
    if report.decisions:
        table = Table(title="placement core, gpupool policy, 1-GPU pod, dgx-h100 nodes 60% full: ms per decision "
                      "(static: bench_placement's; stream: each placement assumed, as the cycle does)")
        for h in DECISION_HEADERS:
            table.add_column(h, justify="right")
        for d in report.decisions:
            table.add_row(*_decision_row(d))
        tables.append(table)
    return tables


def markdown(report: ClusterReport) -> str:
    lines = []
    if report.runs:
        lines += [
            f"{report.nodes} kwok `{report.profile}` nodes ({report.gpus} GPUs), {report.pods} pods asking "
            f"`nvidia.com/gpu: 1` (paced: {report.paced_pods} at {report.paced_rate:g}/s); Kubernetes "
            f"{report.kubernetes_version}, {report.machine.get('cpus')} CPUs. Ratios gpupool / kube-scheduler "
            "in brackets.",
            "",
            "| " + " | ".join(HEADERS) + " |",
            "|" + "---|" * len(HEADERS),
        ]
        for r in report.runs:
            lines.append("| " + " | ".join(_row(r, report.ratios.get(r.mode) if r.scheduler == GPUPOOL else None))
                         + " |")
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(report)]
    if report.decisions:
        lines += ["", "| " + " | ".join(DECISION_HEADERS) + " |", "|" + "---|" * len(DECISION_HEADERS)]
        lines += ["| " + " | ".join(_decision_row(d)) + " |" for d in report.decisions]
    return "\n".join(lines) + "\n"


def plot(report: ClusterReport, out: Path) -> Path | None:
    modes = [m for m in MODES if any(r.mode == m for r in report.runs)]
    if not modes:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 3.8), squeeze=False)
    colours = {GPUPOOL: "tab:blue", KUBE: "tab:orange"}
    for ax, mode in zip(axes[0], modes, strict=True):
        for r in (r for r in report.runs if r.mode == mode):
            ax.plot([0.0, *r.timeline_s], [0, *r.timeline_n], color=colours[r.scheduler],
                    label=f"{r.scheduler}: {r.pods_per_s:.0f} pods/s, p99 {r.latency_ms['p99'] / 1000:.1f} s")
            if mode != "backlog":
                ax.plot(r.created_s, r.created_n, color=colours[r.scheduler], linestyle=":", linewidth=1,
                        label=f"created for {r.scheduler}")
        start = "scheduler start" if mode == "backlog" else "first create"
        ax.set_title(f"{mode} ({report.paced_rate:g} pods/s arriving)" if mode == "paced" else mode)
        ax.set_xlabel(f"seconds since {start}")
        ax.set_ylabel("pods bound")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    fig.suptitle(f"{report.nodes} x {report.profile} kwok nodes, pods asking nvidia.com/gpu: 1", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be positive: {text}")
    return values


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="folder for cluster.{json,md,png}")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--profile", default="dgx-h100", help="fake node profile")
    parser.add_argument("--pods", type=int, default=10_000, help="pods of the stream and backlog runs")
    parser.add_argument("--paced-pods", type=int, default=3000)
    parser.add_argument("--paced-rate", type=float, default=100.0, help="pods/s arriving in the paced runs")
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="comma list; empty: no cluster runs")
    parser.add_argument("--warmup-pods", type=int, default=2000,
                        help="pods of an unreported stream run before the measured ones (0: none)")
    parser.add_argument("--skip-kube-scheduler", action="store_true")
    parser.add_argument("--skip-gpupool", action="store_true")
    parser.add_argument("--gpupool-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `python -m gpupool_sched` (repeat), e.g. "
                        "--gpupool-arg=--percentage-of-nodes-to-score=100")
    parser.add_argument("--gpupool-src", type=Path, default=None, metavar="DIR",
                        help="run the gpupool scheduler from this source tree (its src/ folder) instead of the "
                             "installed one: benchmarks/bench_ab.py compares commits with it")
    parser.add_argument("--concurrency", type=int, default=32, help="parallel create requests")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="give a run up when nothing was bound for this long after the last create")
    parser.add_argument("--decision-sizes", type=_positive_ints, default=[100, 1000, 5000],
                        help="node counts for the decision cost; empty: skip")
    parser.add_argument("--decisions", type=int, default=200, help="decisions timed per size and setting")
    parser.add_argument("--keep-logs", action="store_true", help="keep the cluster's and schedulers' logs")
    parser.add_argument("--cprofile", type=Path, default=None, metavar="DIR",
                        help="run gpupool under cProfile (slower!): DIR/bench-gpupool-<mode>.prof")
    args = parser.parse_args(argv)
    if min(args.nodes, args.pods, args.paced_pods, args.concurrency, args.decisions) <= 0 or args.paced_rate <= 0:
        parser.error("--nodes, --pods, --paced-pods, --paced-rate, --concurrency and --decisions must be positive")
    if args.skip_gpupool and args.skip_kube_scheduler:
        args.modes = []
    console = Console(stderr=True, soft_wrap=True)
    decisions = []
    if args.decision_sizes:
        console.print(f"decision cost at {args.decision_sizes} {args.profile} nodes ...")
        decisions = decision_costs(args.profile, args.decision_sizes, args.decisions)
    runs: list[RunResult] = []
    nodes_ready_s, k8s, kwok = 0.0, "", ""
    if args.modes:
        runs, nodes_ready_s, k8s, kwok = run_cluster(args, console)
    report = ClusterReport(
        nodes=args.nodes,
        profile=args.profile,
        gpus=args.nodes * gpus_per_node(args.profile),
        pods=args.pods,
        paced_pods=args.paced_pods,
        paced_rate=args.paced_rate,
        runs=runs,
        ratios=ratios(runs),
        decisions=decisions,
        nodes_ready_s=round(nodes_ready_s, 2),
        gpupool_args=list(args.gpupool_arg),
        kubernetes_version=k8s,
        kwok_version=kwok,
        machine={"cpus": str(os.cpu_count()), "python": platform.python_version(), "kernel": platform.release()},
        gpupool_src=str(args.gpupool_src or ""),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (args.out / "cluster.md").write_text(markdown(report))
    png = plot(report, args.out / "cluster.png")
    out = Console(width=None if sys.stdout.isatty() else 160)
    for table in render(report):
        out.print(table)
    print(f"wrote {args.out}/cluster.json, cluster.md" + (", cluster.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
