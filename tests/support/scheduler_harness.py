"""Running `gpupool scheduler` against the test control plane, and reading back what it did.

The scheduler runs as a real process (`python -m gpupool_sched`) with the admin kubeconfig; its
metrics port is on 127.0.0.1. Every test gives its scheduler its own name and its nodes their own
label, so tests sharing the session's cluster never place pods on each other's nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from gpupool_common.handshake import parse_assignment
from gpupool_common.inventory import parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import discard, read_json
from tests.support.ports import free_port
from tests.support.waiting import eventually

POOL_LABEL = "gpupool.io/test-pool"


@dataclass
class SchedulerProcess:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as answer:
                return int(answer.status), answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> str:
        return self.get("/metrics")[1]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, rest = head.partition("{")
            if metric != name:
                continue
            have = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
            if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        return total

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"scheduler exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if self.get("/readyz", timeout=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"scheduler not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_scheduler(
    kube: ClusterClient, name: str, log_dir: Path, *extra: str, ready: bool = True, port: int | None = None
) -> SchedulerProcess:
    port = port or free_port()
    log = log_dir / f"scheduler-{name}-{port}.log"
    args = [
        sys.executable, "-m", "gpupool_sched", "--kubeconfig", str(kube.kubeconfig), "--scheduler-name", name,
        "--metrics-port", str(port), "--metrics-address", "127.0.0.1", *extra,
    ]
    handle = open(log, "wb")  # noqa: SIM115 - the process owns it
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env)
    handle.close()
    proc = SchedulerProcess(name, port, process, log, args)
    if ready:
        proc.wait_ready()
    return proc


def stop_scheduler(proc: SchedulerProcess) -> None:
    """SIGTERM, and the scheduler must exit 0."""
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@contextmanager
def priority_classes(kube: ClusterClient, *values: int, prefix: str = "pc") -> Iterator[tuple[str, ...]]:
    """PriorityClasses of `values` under unique names (in that order), deleted afterwards."""
    api = client.SchedulingV1Api(kube.api_client)
    names = tuple(unique(f"{prefix}-{value}") for value in values)
    for name, value in zip(names, values, strict=True):
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": name}, "value": value})
    try:
        yield names
    finally:
        for name in names:
            api.delete_priority_class(name)


def add_pool_nodes(kube: ClusterClient, pool: str, profile: str, count: int) -> list[str]:
    """Fake nodes of `profile`, labelled with the test's pool."""
    names = kube.add_nodes(profile, count, prefix=f"{pool}-{profile}-")
    patch = {"metadata": {"labels": {POOL_LABEL: pool}}}
    for name in names:
        discard(kube.core.patch_node(name, patch, _preload_content=False))
    return names


def pod(
    name: str,
    scheduler: str,
    pool: str,
    *,
    gpus: int = 0,
    units: int = 0,
    mig: Mapping[str, int] | None = None,
    cpu: str = "100m",
    memory: str = "64Mi",
    priority_class: str | None = None,
    annotations: Mapping[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod for the test's scheduler, kept to the test's node pool by a nodeSelector."""
    limits: dict[str, str] = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if units:
        limits["nvidia.com/gpu-memory"] = str(units)
    for profile, count in (mig or {}).items():
        limits[f"nvidia.com/mig-{profile}"] = str(count)
    main = {
        "name": "main",
        "image": "registry.k8s.io/pause:3.10",
        "resources": {"requests": {"cpu": cpu, "memory": memory, **limits}, **({"limits": limits} if limits else {})},
    }
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "containers": containers or [main],
        "nodeSelector": {POOL_LABEL: pool},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    if priority_class:
        spec["priorityClassName"] = priority_class
    meta: dict[str, Any] = {"name": name, "labels": dict(labels or {})}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def list_pods(kube: ClusterClient, namespace: str) -> list[dict[str, Any]]:
    return list(read_json(kube.core.list_namespaced_pod(namespace, _preload_content=False))["items"])


def wait_until(predicate: Any, timeout_s: float, what: str, interval: float = 0.5) -> Any:
    return eventually(predicate, timeout_s, what, interval)


def wait_bound(kube: ClusterClient, namespace: str, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    def bound() -> list[dict[str, Any]] | None:
        pods = list_pods(kube, namespace)
        return pods if sum(1 for p in pods if p["spec"].get("nodeName")) >= count else None

    try:
        return wait_until(bound, timeout_s, f"{count} pods bound in {namespace}")
    except AssertionError:
        pods = list_pods(kube, namespace)
        n = sum(1 for p in pods if p["spec"].get("nodeName"))
        raise AssertionError(f"only {n} of {count} pods bound in {namespace} after {timeout_s:.0f}s") from None


def events_for(kube: ClusterClient, namespace: str, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    items = read_json(kube.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}", _preload_content=False))["items"]
    return [e for e in items if reason is None or e.get("reason") == reason]


def pod_condition(obj: Mapping[str, Any], kind: str = "PodScheduled") -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c.get("type") == kind), None)


@dataclass
class GpuUse:
    whole: list[str] = field(default_factory=list)  # pods holding the GPU whole
    units: dict[str, int] = field(default_factory=dict)  # pod -> memory units on it


def device_use(kube: ClusterClient, pods: Iterable[Mapping[str, Any]]) -> tuple[dict[tuple[str, str], GpuUse],
                                                                                  dict[tuple[str, str], list[str]]]:
    """From the assignment annotations: per (node, GPU UUID) who holds it, and per (node, MIG UUID) the
    pods holding it."""
    gpus: dict[tuple[str, str], GpuUse] = defaultdict(GpuUse)
    migs: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in pods:
        node = p["spec"].get("nodeName")
        if not node:
            continue
        assignment = parse_assignment(p["metadata"].get("annotations"))
        if assignment is None:
            continue
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        assert assignment.node == node, f"{key}: assignment for {assignment.node}, bound to {node}"
        assert assignment.pod_uid == p["metadata"]["uid"], f"{key}: assignment carries another UID"
        init = {c["name"] for c in p["spec"].get("initContainers") or () if c.get("restartPolicy") != "Always"}
        whole: set[str] = set()
        units: dict[str, int] = defaultdict(int)
        for c in assignment.containers:
            if c.name in init:
                continue  # init containers reuse devices of the containers after them
            whole.update(c.devices.get("nvidia.com/gpu", ()))
            if c.memory is not None:
                units[c.memory.gpu] += c.memory.units
            for resource, ids in c.devices.items():
                if resource.startswith("nvidia.com/mig-"):
                    for d in ids:
                        migs[(node, d)].append(key)
        for g in whole:
            gpus[(node, g)].whole.append(key)
        for g, n in units.items():
            gpus[(node, g)].units[key] = n
    return gpus, migs


def assert_no_oversubscription(kube: ClusterClient, pods: list[dict[str, Any]]) -> None:
    gpus, migs = device_use(kube, pods)
    nodes = {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")}
    capacity: dict[tuple[str, str], int] = {}
    for name in nodes:
        node = read_json(kube.core.read_node(name, _preload_content=False))
        inventory = parse_inventory(node["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
        unit = inventory.sharing.memory_unit_mib if inventory.sharing else None
        for g in inventory.gpus:
            capacity[(name, g.uuid)] = g.memory_mib // unit if unit else 0
    for key, use in gpus.items():
        assert key in capacity, f"{key}: GPU not on the node"
        assert len(use.whole) <= 1, f"{key} held whole by {use.whole}"
        assert not (use.whole and use.units), f"{key} held whole by {use.whole} and shared by {use.units}"
        assert sum(use.units.values()) <= capacity[key], f"{key}: {use.units} exceed {capacity[key]} units"
    for key, holders in migs.items():
        assert len(holders) == 1, f"MIG device {key} held by {holders}"


def json_dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
