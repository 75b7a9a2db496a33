"""The order in which a trace's pods arrive, following the FGD paper's evaluation method.

The pods (sorted by name) are shuffled with the seed; then randomly sampled copies are appended
until the total GPU request reaches ``ratio`` times the cluster's GPU capacity (or random pods are
dropped while it exceeds it). Copies are named ``<pod>-tuned-<n>``. Pods never leave and a pod that
fits nowhere fails for good, so the replay is online bin packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gpupool_sched.model.request import PodRequest
from gpupool_sched.simulate.trace import TUNED, TraceError, read_text

# More arrivals than this is a mistake (tiny GPU shares on a huge cluster, a huge --ratio), not a study:
# the openb traces need 10-25 thousand; the limit is checked before the list is built.
MAX_ARRIVALS = 2_000_000
DEFAULT_RATIO = 1.3  # arrivals up to this multiple of GPU capacity (the FGD paper's replays)


def seeded_arrivals(pods: Sequence[PodRequest], capacity_milli: int, seed: int,
                    ratio: float = DEFAULT_RATIO) -> list[PodRequest]:
    """Shuffled pods, tuned to ``ratio`` x ``capacity_milli`` of total GPU request.

    Raises TraceError, before any sampling, when no pod asks for a GPU (the copies would never reach the
    target) or when the target would take more than :data:`MAX_ARRIVALS` arrivals."""
    rng = np.random.default_rng(seed)
    base = sorted(pods, key=lambda p: p.name)
    target = ratio * capacity_milli
    total = sum(p.gpu_milli_total for p in base)
    if total < target:
        if total == 0:
            raise TraceError("no pod asks for a GPU: copies of them can never reach the GPU capacity target")
        expected = len(base) * target / total  # copies are drawn uniformly: each adds total/len(base) on average
        if expected > MAX_ARRIVALS:
            raise TraceError(
                f"reaching {ratio:g} x the capacity of {capacity_milli // 1000} GPUs would take about "
                f"{expected:,.0f} arrivals (at most {MAX_ARRIVALS:,}); use a smaller ratio or larger pods"
            )
    order = [base[i] for i in rng.permutation(len(base))]
    if total > target:
        while total > target and order:
            dropped = order.pop(int(rng.integers(len(order))))
            total -= dropped.gpu_milli_total
        return order
    n = 0
    while True:
        copy = base[int(rng.integers(len(base)))]
        if total + copy.gpu_milli_total > target:
            return order
        order.append(replace(copy, name=f"{copy.name}{TUNED}{n}"))
        total += copy.gpu_milli_total
        n += 1


@dataclass(frozen=True, slots=True)
class EventOrder:
    """One published run's inputs: pod arrival order and the node tie-break names."""

    seed: int
    pod_names: tuple[str, ...]
    node_names: dict[str, str]  # node -> prefixed name; equal scores go to the smallest

    def arrivals(self, pods: Sequence[PodRequest], source: str) -> list[PodRequest]:
        by_name = {p.name: p for p in pods}
        out: list[PodRequest] = []
        for name in self.pod_names:
            base_name = name.split(TUNED, 1)[0]
            pod = by_name.get(base_name)
            if pod is None:
                raise TraceError(f"{source}: seed {self.seed} names pod {base_name}, which the pod list lacks")
            out.append(pod if base_name == name else replace(pod, name=name))
        return out

    def tie_order(self, node_names: Sequence[str], source: str) -> list[str]:
        missing = [n for n in node_names if n not in self.node_names]
        if missing:
            raise TraceError(f"{source}: seed {self.seed} has no tie-break name for node(s) {', '.join(missing[:3])}")
        return [self.node_names[n] for n in node_names]


def read_event_order(path: Path | str, seed: int) -> EventOrder:
    """Rows ``kind,seed,key,value``: ``pod,SEED,INDEX,POD`` and ``node,SEED,NODE,PREFIXED_NAME``."""
    path = Path(path)
    text = read_text(path, " event order")
    pods: dict[int, str] = {}
    nodes: dict[str, str] = {}
    seeds: set[int] = set()
    lines = text.splitlines()
    if not lines or lines[0].strip() != "kind,seed,key,value":
        raise TraceError(f"{path}:1: expected header 'kind,seed,key,value'")
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = line.split(",")
        if len(parts) != 4:
            raise TraceError(f"{path}:{lineno}: expected 4 fields, got {len(parts)}")
        kind, s, key, value = parts
        try:
            row_seed = int(s)
        except ValueError:
            raise TraceError(f"{path}:{lineno}: seed must be an integer, got {s!r}") from None
        seeds.add(row_seed)
        if row_seed != seed:
            continue
        if kind == "pod":
            try:
                pods[int(key)] = value
            except ValueError:
                raise TraceError(f"{path}:{lineno}: pod index must be an integer, got {key!r}") from None
        elif kind == "node":
            nodes[key] = value
        else:
            raise TraceError(f"{path}:{lineno}: unknown row kind {kind!r} (pod or node)")
    if seed not in seeds:
        raise TraceError(f"{path}: no rows for seed {seed} (seeds present: {', '.join(map(str, sorted(seeds)))})")
    if sorted(pods) != list(range(len(pods))):
        raise TraceError(f"{path}: seed {seed}: pod indices are not 0..{len(pods) - 1}")
    return EventOrder(seed=seed, pod_names=tuple(pods[i] for i in range(len(pods))), node_names=nodes)
