"""Elastic inference (issue 20 §3, docs/idle-and-elastic.md#elastic-inference), the pure rules: what a
Deployment's annotations ask for (`parse_elastic`), how much its demand asks for (`DemandSignal`), which
of its replicas are guaranteed and which borrowed (`tiers`), which borrowed replicas go first when GPUs are
given back (`give_back_order`, Lyra's rule), never below `min`, and the no-flap window (`FlapGuard`).

A Deployment is elastic when it carries `gpupool.io/elastic-min` and `gpupool.io/elastic-max`. Its first
`min` replicas (oldest first) are guaranteed: scheduled like any pod. The others are borrowed: placed
only on free GPUs (they never preempt, move or reclaim anything) and the first to go when a guaranteed pod
or a gang needs the GPUs (the give-back action, before any preemption). The scheduler raises the count
one replica at a time while a replica fits on free GPUs and the demand asks for more
(scheduler/elastic.py), and lowers it to give GPUs back."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

PREFIX = "gpupool.io/elastic-"
MIN = "gpupool.io/elastic-min"
MAX = "gpupool.io/elastic-max"
DEMAND = "gpupool.io/elastic-demand"  # "always" (default) or "queue-length"
QUEUE_LENGTH = "gpupool.io/elastic-queue-length"  # written by the app or an adapter: requests waiting
TARGET_PER_REPLICA = "gpupool.io/elastic-target-per-replica"  # queue length one replica serves
INFLIGHT = "gpupool.io/inflight"  # on a pod: requests in flight (the app's or an adapter's); absent: 0
TEMPLATE_HASH = "pod-template-hash"  # the Deployment controller's label on its ReplicaSets' pods
DEFAULT_NO_FLAP_S = 300.0  # a replica given back is not added back within this (--elastic-no-flap)


class InvalidElastic(ValueError):
    """The annotations ask for something impossible; the message names the annotation (an Event)."""


class DemandSignal(Protocol):
    """How many replicas the Deployment's demand asks for now (clamped to [min, max] by the caller).
    `annotations`: the Deployment's; `replicas`: its count now. A metrics source is one more class."""

    def desired(self, annotations: Mapping[str, str], replicas: int) -> int: ...


@dataclass(frozen=True, slots=True)
class Always:
    """Grow whenever there is room (`gpupool.io/elastic-demand: always`, the default)."""

    def desired(self, annotations: Mapping[str, str], replicas: int) -> int:
        return 2**31 - 1


@dataclass(frozen=True, slots=True)
class QueueLength:
    """ceil(queue length / target per replica): the app (or an adapter from its metrics) writes
    `gpupool.io/elastic-queue-length` on the Deployment. Unset or unreadable: no demand beyond now."""

    target: int

    def desired(self, annotations: Mapping[str, str], replicas: int) -> int:
        raw = annotations.get(QUEUE_LENGTH)
        try:
            queued = int(raw) if raw is not None else None
        except ValueError:
            queued = None
        if queued is None or queued < 0:
            return replicas
        return math.ceil(queued / self.target)


def _queue_length(annotations: Mapping[str, str]) -> DemandSignal:
    target = _int(annotations, TARGET_PER_REPLICA, default=None)
    if target is None or target < 1:
        raise InvalidElastic(f"{DEMAND}: queue-length needs {TARGET_PER_REPLICA}, a whole number >= 1")
    return QueueLength(target)


# demand kinds by name: a new signal (Prometheus, a custom metric) is one entry
SIGNALS: dict[str, Callable[[Mapping[str, str]], DemandSignal]] = {
    "always": lambda _annotations: Always(),
    "queue-length": _queue_length,
}


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    minimum: int
    maximum: int
    demand: DemandSignal = field(default_factory=Always)

    def wants(self, annotations: Mapping[str, str], replicas: int) -> int:
        """The count the demand asks for, within [min, max]."""
        return max(self.minimum, min(self.maximum, self.demand.desired(annotations, replicas)))


def _int(annotations: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = annotations.get(key)
    if raw is None:
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise InvalidElastic(f"{key}: {raw!r} is not a whole number") from None


def parse_elastic(annotations: Mapping[str, str] | None) -> ElasticSpec | None:
    """The Deployment's elastic spec; None when it is not elastic (no `gpupool.io/elastic-*` annotation).
    InvalidElastic when the annotations are there but wrong (the Deployment is then left alone)."""
    annotations = annotations or {}
    if not any(k.startswith(PREFIX) for k in annotations):
        return None
    minimum = _int(annotations, MIN, default=None)
    maximum = _int(annotations, MAX, default=None)
    if minimum is None or maximum is None:
        raise InvalidElastic(f"{MIN} and {MAX} are both needed")
    if minimum < 0:
        raise InvalidElastic(f"{MIN}: {minimum} is below 0")
    if maximum < minimum:
        raise InvalidElastic(f"{MAX}: {maximum} is below {MIN} ({minimum})")
    kind = str(annotations.get(DEMAND, "always")).strip()
    make = SIGNALS.get(kind)
    if make is None:
        raise InvalidElastic(f"{DEMAND}: {kind!r} is none of {', '.join(sorted(SIGNALS))}")
    return ElasticSpec(minimum, maximum, make(annotations))


def deployment_of(owner: str, labels: Mapping[str, str]) -> str | None:
    """"namespace/name" of the Deployment a pod's ReplicaSet belongs to, from its controller
    ("ReplicaSet/namespace/name-<hash>") and its `pod-template-hash` label, as the Deployment controller
    names them; None for any other pod."""
    kind, _, rest = owner.partition("/")
    namespace, _, rs_name = rest.partition("/")
    suffix = "-" + labels.get(TEMPLATE_HASH, "")
    if kind != "ReplicaSet" or suffix == "-" or not rs_name.endswith(suffix) or len(rs_name) == len(suffix):
        return None
    return f"{namespace}/{rs_name[:-len(suffix)]}"


@dataclass(frozen=True, slots=True)
class Replica:
    """One running replica of an elastic Deployment, as the rules see it."""

    uid: str
    started: float  # seconds since the epoch: later = younger
    inflight: int = 0  # requests in flight (gpupool.io/inflight)


def tiers(replicas: Iterable[Replica], minimum: int) -> tuple[list[Replica], list[Replica]]:
    """(guaranteed, borrowed): the `minimum` oldest running replicas are guaranteed, the rest borrowed."""
    ordered = sorted(replicas, key=lambda r: (r.started, r.uid))
    return ordered[:minimum], ordered[minimum:]


def give_back_order(borrowed: Iterable[Replica]) -> list[Replica]:
    """Borrowed replicas, the cheapest to give back first (Lyra's rule): the fewest requests in flight,
    then the youngest."""
    return sorted(borrowed, key=lambda r: (r.inflight, -r.started, r.uid))


def inflight(annotations: Mapping[str, str] | None) -> int:
    """A pod's `gpupool.io/inflight`; 0 when absent or unreadable."""
    raw = (annotations or {}).get(INFLIGHT)
    try:
        return max(0, int(str(raw))) if raw is not None else 0
    except ValueError:
        return 0


@dataclass
class FlapGuard:
    """No flapping: a Deployment that gave replicas back is not grown again within `window_s`."""

    window_s: float = DEFAULT_NO_FLAP_S
    taken: dict[str, float] = field(default_factory=dict)  # Deployment key -> clock of its last give-back

    def gave_back(self, key: str, now: float) -> None:
        self.taken[key] = now

    def may_grow(self, key: str, now: float) -> bool:
        at = self.taken.get(key)
        return at is None or now - at >= self.window_s

    def until(self, key: str) -> float | None:
        at = self.taken.get(key)
        return None if at is None else at + self.window_s
