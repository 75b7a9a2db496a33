"""The what-if's synthetic continuation: pods that might arrive next, drawn from the cluster's recent mix.

The mix is the most recent pods of the scheduler (by creation time, running or pending, not ended):
each drawn pod is a copy of one of them, picked uniformly with a seeded random stream, so a shape
that makes up 30 % of the recent pods makes up about 30 % of the continuation. A copy keeps what
decides where a pod may go and what it takes (containers and their resources, priority, node
selector, affinity, tolerations, namespace, labels, request annotations) and drops what belongs to
the original (its node, status, owner, gang label, assignment and ack). Same listing, same seed:
same continuation.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Mapping
from typing import Any

from gpupool_sched.cache.entries import TERMINAL_PHASES

DEFAULT_WINDOW = 200  # the recent mix: this many of the newest pods
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # a copy of a gang member would wait for a group of its own
OWN_ANNOTATIONS = ("gpupool.io/assignment", "gpupool.io/allocated", "gpupool.io/migration", "gpupool.io/moved")
NAME_PREFIX = "whatif-"


def recent_mix(pods: Iterable[Mapping[str, Any]], scheduler_name: str,
               window: int = DEFAULT_WINDOW) -> list[Mapping[str, Any]]:
    """The newest `window` pods of `scheduler_name` that have not ended, oldest first (ties by name)."""
    mine = []
    for obj in pods:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        phase = (obj.get("status") or {}).get("phase") or "Pending"
        if spec.get("schedulerName") != scheduler_name or phase in TERMINAL_PHASES or meta.get("deletionTimestamp"):
            continue
        if str(meta.get("name", "")).startswith(NAME_PREFIX):
            continue
        mine.append(obj)
    mine.sort(key=lambda o: (str((o.get("metadata") or {}).get("creationTimestamp") or ""), _key(o)))
    return mine[-window:] if window > 0 else []


def draw(mix: list[Mapping[str, Any]], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` new pending pods, each a copy of a pod of `mix` picked by a stream seeded with `seed`."""
    if count <= 0 or not mix:
        return []
    rng = random.Random(seed)
    return [synthetic_pod(rng.choice(mix), i) for i in range(count)]


def synthetic_pod(template: Mapping[str, Any], index: int) -> dict[str, Any]:
    meta = template.get("metadata") or {}
    spec = copy.deepcopy(dict(template.get("spec") or {}))
    spec.pop("nodeName", None)
    name = f"{NAME_PREFIX}{index}-{meta.get('name', 'pod')}"[:63].rstrip("-.")
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != POD_GROUP_LABEL}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in OWN_ANNOTATIONS}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": meta.get("namespace", "default"), "uid": f"whatif-uid-{index}",
                     "resourceVersion": "0", "creationTimestamp": "9999-12-31T23:59:59Z",
                     "labels": labels, "annotations": annotations},
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
