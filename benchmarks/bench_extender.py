"""The latency the gpupool extender adds to each pod kube-scheduler places: its filter, prioritize and
bind handlers, timed by the client over real HTTP on 127.0.0.1, as kube-scheduler calls them
(nodeCacheCapable: node names only).

    make bench-extender        # = python -m benchmarks.bench_extender --out out/bench

The extender runs in-process on its own event loop with a synthetic state (fake dgx-h100 nodes, the
Node JSON the device plugin publishes). The Binding POST is the one thing not measured: kube-scheduler's
default binder makes the same API call, so it is not added latency; the bind verb's own work (decide
on the node, assume, build the assignment annotations) is. Writes <out>/extender.json and
<out>/extender.md and prints the table."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kubernetes import client

from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_sched.extender.core import Extender, ExtenderConfig
from gpupool_sched.extender.server import bound_port, build_app, serve
from gpupool_sched.kube.kubeapi import KubeApi

PROFILE = "dgx-h100"


class NoPostApi(KubeApi):
    """Takes the Binding without sending it (see the module docstring): the annotations are kept."""

    def __init__(self) -> None:
        super().__init__(client.ApiClient(client.Configuration()), workers=1)
        self.bound: list[tuple[str, Mapping[str, str]]] = []

    async def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None:
        self.bound.append((node, dict(annotations)))


@dataclass
class VerbStats:
    p50_ms: float
    p99_ms: float
    mean_ms: float


@dataclass
class SizeResult:
    nodes: int
    pods: int
    bound: int
    filter: VerbStats
    prioritize: VerbStats
    bind: VerbStats
    per_pod: VerbStats  # filter + prioritize + bind


def _stats(samples: list[float]) -> VerbStats:
    a = np.array(samples) * 1000.0
    return VerbStats(round(float(np.percentile(a, 50)), 3), round(float(np.percentile(a, 99)), 3),
                     round(float(a.mean()), 3))


def _pod(i: int) -> dict[str, Any]:
    kind = i % 4
    limits = ({"nvidia.com/gpu": str([1, 2, 4, 8][i % 3 if kind == 0 else 1])} if kind in (0, 1)
              else {"nvidia.com/gpu-memory": str([4, 8, 16][i % 3])})
    return {"metadata": {"name": f"p{i}", "namespace": "bench", "uid": f"uid-{i}", "resourceVersion": "1",
                         "creationTimestamp": "2026-11-30T10:00:00Z"},
            "spec": {"schedulerName": "default-scheduler", "containers": [
                {"name": "main", "resources": {"limits": limits, "requests": {"cpu": "1", "memory": "1Gi",
                                                                               **limits}}}]},
            "status": {"phase": "Pending"}}


def measure(nodes: int, pods: int) -> SizeResult:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def setup() -> None:
        api = NoPostApi()
        extender = Extender(ExtenderConfig(), api)
        for i in range(nodes):
            name = f"n{i:05d}"
            obj = fake_node_manifest(name, PROFILE, publication_for_profile(PROFILE, name))
            obj["metadata"]["resourceVersion"] = "1"
            extender.on_node("ADDED", obj)
        extender.synced.set()
        runner = await serve(build_app(extender), "127.0.0.1", 0)
        box.update(api=api, runner=runner, port=bound_port(runner))

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(setup())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(120):
        raise TimeoutError("extender did not start")
    conn = http.client.HTTPConnection("127.0.0.1", box["port"], timeout=30)  # keep-alive, as kube-scheduler

    def post(verb: str, payload: Any) -> tuple[Any, float]:
        body = json.dumps(payload).encode()
        began = time.perf_counter()
        conn.request("POST", f"/{verb}", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        data = answer.read()
        took = time.perf_counter() - began
        if answer.status != 200:
            raise RuntimeError(f"{verb}: HTTP {answer.status}: {data[:300]!r}")
        return json.loads(data), took

    names = [f"n{i:05d}" for i in range(nodes)]
    times: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": [], "per_pod": []}
    bound = 0
    try:
        for i in range(pods):
            p = _pod(i)
            filtered, t_filter = post("filter", {"Pod": p, "NodeNames": names})
            feasible = filtered["NodeNames"]
            if not feasible:
                continue
            scores, t_prio = post("prioritize", {"Pod": p, "NodeNames": feasible})
            best = max(scores, key=lambda e: e["Score"])["Host"]
            answer, t_bind = post("bind", {"PodName": p["metadata"]["name"], "PodNamespace": "bench",
                                           "PodUID": p["metadata"]["uid"], "Node": best})
            if answer["Error"]:
                raise RuntimeError(f"bind: {answer['Error']}")
            bound += 1
            for key, value in (("filter", t_filter), ("prioritize", t_prio), ("bind", t_bind),
                               ("per_pod", t_filter + t_prio + t_bind)):
                times[key].append(value)
    finally:
        conn.close()
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert len(box["api"].bound) == bound and all(a for _, a in box["api"].bound)
    return SizeResult(nodes, pods, bound, _stats(times["filter"]), _stats(times["prioritize"]),
                      _stats(times["bind"]), _stats(times["per_pod"]))


def table(results: list[SizeResult]) -> str:
    lines = ["| nodes | pods bound | filter p50 / p99 (ms) | prioritize p50 / p99 (ms) | bind p50 / p99 (ms) "
             "| added per pod p50 / p99 (ms) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = [f"{s.p50_ms:.2f} / {s.p99_ms:.2f}" for s in (r.filter, r.prioritize, r.bind, r.per_pod)]
        lines.append(f"| {r.nodes} | {r.bound} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--pods", type=int, default=400, help="pods per cluster size")
    args = parser.parse_args(argv)
    if args.pods <= 0 or min(args.nodes) <= 0:
        parser.error("--nodes and --pods must be positive")
    results = [measure(n, args.pods) for n in args.nodes]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "extender.json").write_text(json.dumps(
        {"profile": PROFILE, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    text = table(results)
    (args.out / "extender.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
