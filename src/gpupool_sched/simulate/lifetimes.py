"""How long each trace pod runs, how long it waits before giving up, and its priority: the time mode's
reading of the openb columns `qos`, `creation_time`, `scheduled_time` and `deletion_time` (seconds).

Rules (docs/simulator.md, "Time mode"):

* lifetime: `deletion_time - scheduled_time` for a pod the trace scheduled; a pod the trace never
  scheduled (no `scheduled_time`), and every pod of a file without these columns, borrows one: the
  lifetime of a scheduled pod of the same GPU shape (GPU count, milli per GPU) of the *bundled default
  trace*, drawn with the run's seed (any scheduled pod when no pod has that shape);
* patience (how long it waits in the queue before leaving): `deletion_time - creation_time` for a pod
  the trace never scheduled (it did give up then); for a scheduled pod the trace only shows it waited
  `scheduled_time - creation_time` without giving up, so its patience is that or `default_patience_s`,
  whichever is longer; a file without the columns: `default_patience_s`;
* priority: `qos` through `QOS_PRIORITY` (PriorityClasses); a file without `qos`, or an empty cell:
  the `default` class.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpupool_sched.model.request import PodRequest
from gpupool_sched.simulate.trace import BUNDLED_PODS, POD_COLUMNS, TraceError, _int, _rows, bundled_path

TIME_COLUMNS = ("creation_time", "deletion_time", "scheduled_time")
MAX_TIME_S = 10**10  # ~300 years: anything beyond is a typo
DEFAULT_PATIENCE_S = 3600.0

# the trace's qos -> (PriorityClass, value). Alibaba's LS (latency-sensitive) pods outrank BE (best-effort)
# ones; Kubernetes' Guaranteed and Burstable (a few rows) sit above and between them.
QOS_PRIORITY: dict[str, tuple[str, int]] = {
    "Guaranteed": ("sim-guaranteed", 3000),
    "LS": ("sim-latency-sensitive", 2000),
    "Burstable": ("sim-burstable", 1000),
    "BE": ("sim-best-effort", 0),
}
DEFAULT_CLASS = ("default", 0)


@dataclass(frozen=True, slots=True)
class PodTimes:
    """One trace pod's time facts: what the time mode needs besides its request."""

    lifetime_s: float | None  # None: the trace never ran it (a lifetime is borrowed)
    patience_s: float | None  # None: the default rule applies
    priority_class: str
    priority: int


def shape_key(pod: PodRequest) -> tuple[int, int]:
    return (pod.gpu_count, pod.gpu_milli)


def read_pod_times(path: Path) -> dict[str, PodTimes]:
    """The time facts of every pod of `path`, by name; empty when the file has no time columns (the
    multigpu variants). Bad cells stop with `FILE:LINE: what is wrong`."""
    out: dict[str, PodTimes] = {}
    for lineno, row in _rows(path, POD_COLUMNS):
        if not any(c in row for c in (*TIME_COLUMNS, "qos")):
            return {}
        qos = row.get("qos", "")
        if qos and qos not in QOS_PRIORITY:
            raise TraceError(f"{path}:{lineno}: qos must be one of {', '.join(QOS_PRIORITY)} or empty, got {qos!r}")
        cls, value = QOS_PRIORITY.get(qos, DEFAULT_CLASS)
        lifetime: float | None = None
        patience: float | None = None
        if all(row.get(c) for c in ("creation_time", "deletion_time")):
            created = _int(path, lineno, row, "creation_time", maximum=MAX_TIME_S)
            deleted = _int(path, lineno, row, "deletion_time", minimum=created, maximum=MAX_TIME_S)
            if row.get("scheduled_time"):
                scheduled = _int(path, lineno, row, "scheduled_time", minimum=created, maximum=deleted)
                lifetime = float(deleted - scheduled)
                patience = float(scheduled - created)
            else:
                patience = float(deleted - created)  # gave up then
        out[row["name"]] = PodTimes(lifetime, patience, cls, value)
    return out


@dataclass(frozen=True, slots=True)
class TimedPod:
    """A trace pod as the time mode runs it: its request (priority set), lifetime and patience."""

    request: PodRequest
    lifetime_s: float  # capped at the horizon
    patience_s: float
    priority_class: str


def _lifetimes_by_shape(pods: Sequence[PodRequest],
                        times: Mapping[str, PodTimes]) -> dict[tuple[int, int], list[float]]:
    by_shape: dict[tuple[int, int], list[float]] = defaultdict(list)
    for pod in pods:
        t = times.get(pod.name)
        if t is not None and t.lifetime_s is not None:
            by_shape[shape_key(pod)].append(t.lifetime_s)
    return by_shape


def default_lifetimes() -> dict[tuple[int, int], list[float]]:
    """The bundled default trace's lifetimes of scheduled pods, by GPU shape (what other files borrow)."""
    from gpupool_sched.simulate.trace import BUNDLED_NODES, read_nodes, read_pods

    path = bundled_path(BUNDLED_PODS)
    pods = read_pods(path, read_nodes(bundled_path(BUNDLED_NODES)))
    return _lifetimes_by_shape(pods, read_pod_times(path))


def timed_pods(pods: Sequence[PodRequest], times: Mapping[str, PodTimes], *, horizon_s: float,
               default_patience_s: float, seed: int,
               borrowed: Mapping[tuple[int, int], list[float]] | None = None) -> list[TimedPod]:
    """Every trace pod with its lifetime (capped at `horizon_s`), patience and priority, by the rules of
    the module docstring; `borrowed`: the lifetimes to borrow from (default: the bundled default trace's,
    read only when some pod needs one)."""
    rng = np.random.default_rng(seed)
    own = _lifetimes_by_shape(pods, times)
    pool: Mapping[tuple[int, int], list[float]] | None = borrowed
    out: list[TimedPod] = []
    for pod in pods:
        t = times.get(pod.name)
        life = t.lifetime_s if t is not None else None
        if life is None:
            if pool is None:
                pool = own if own and times else default_lifetimes()
            choices = pool.get(shape_key(pod)) or [x for xs in pool.values() for x in xs]
            if not choices:
                raise TraceError(f"pod {pod.name}: no lifetime to borrow (no scheduled pod in the reference trace)")
            life = float(choices[int(rng.integers(len(choices)))])
        if t is None or t.patience_s is None:
            patience = default_patience_s
        elif t.lifetime_s is None:
            patience = t.patience_s  # it gave up after this long in the trace
        else:
            patience = max(t.patience_s, default_patience_s)
        cls, value = (t.priority_class, t.priority) if t is not None else DEFAULT_CLASS
        request = PodRequest(name=pod.name, cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib,
                             gpu_count=pod.gpu_count, gpu_milli=pod.gpu_milli, gpu_models=pod.gpu_models,
                             priority=value)
        out.append(TimedPod(request, min(max(life, 1.0), horizon_s), patience, cls))
    return out
