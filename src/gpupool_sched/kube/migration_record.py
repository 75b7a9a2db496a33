"""The `gpupool.io/migration` annotation: a migration's holds, written on the pod it makes room for before
any mover is evicted, so that they survive a failover as a nomination does through
`status.nominatedNodeName`.

A standby reads it as the leader writes it and holds the same destinations (cache/reservations.py
`adopt_reservation`); a new leader that starts from a LIST does the same. Without it, a replacement
created while no leader runs would go wherever the next leader's policy puts it, and the room the
migration freed could go to another pod (docs/defragmentation.md, "Failover").

    {"node": "gpu-3", "at": 1764669450.0, "until": 1764669600.0,
     "moves": [{"uid": "...", "pod": "ns/tenants-7d9-abc", "owner": "ReplicaSet/tenants-7d9",
                "request": {"shapes": [[1, 0, 10240, null, 0]], "cpu": 100, "memory": 128,
                            "models": [], "priority": 0},
                "to": {"node": "gpu-5", "gpus": [2], "milli": 0, "memoryMiB": 10240, "mig": []}}]}

`at` and `until` are wall-clock seconds (when the holds were taken, when they end); every process reads
them against its own clock. A pod of the mover's controller and shape that started on the destination
since `at` is its replacement (its siblings started before).

The `gpupool.io/moved` annotation: what a replacement placed on its held destination carries, in the
Binding that places it (the API server copies a Binding's annotations onto the pod in the same write), so
that the cooldown and the hourly budget survive a restart and a failover (framework/plugins/movers.py
reads it back from the pod watch):

    {"at": 1764669450.0, "mover": "6c1e...", "lineage": "51aa...", "pod": "ns/tenants-7d9-abc",
     "owner": "ReplicaSet/ns/tenants-7d9"}

`at`: wall-clock seconds, when the mover's destination was held (the move); `mover`: the UID of the pod it
replaces (a move counts once on the budget, whether read here or from the blocked pod's record);
`lineage`: the first UID of the pods it replaces (the cooldown follows a pod from node to node); `pod`
and `owner`: the mover's namespace/name and controller (a StatefulSet's pod keeps its name: its cooldown
follows the name too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import GpuShape, InvalidRequest, PodRequest

MIGRATION_ANNOTATION = "gpupool.io/migration"
MOVED_ANNOTATION = "gpupool.io/moved"


@dataclass(frozen=True, slots=True)
class RecordedMove:
    mover: str  # UID of the pod that moves
    mover_key: str  # namespace/name
    owner: str  # its controller ("ReplicaSet/name"): the replacement has the same
    request: PodRequest  # what it asks (GPU shapes, CPU, memory, models, priority)
    destination: Placement  # where its replacement's room is held


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    node: str  # the node the movers leave (the blocked pod is nominated there)
    at: float  # wall-clock seconds: the holds were taken then
    until: float  # wall-clock seconds: the holds end then
    moves: tuple[RecordedMove, ...]


def encode(record: MigrationRecord) -> str:
    return json.dumps({"node": record.node, "at": round(record.at, 3), "until": round(record.until, 3),
                       "moves": [_move(m) for m in record.moves]}, separators=(",", ":"))


def decode(raw: str) -> MigrationRecord:
    """Raises ValueError (with what is wrong) for anything but a record `encode` could have written."""
    try:
        data = json.loads(raw)
        moves = tuple(_read_move(m) for m in data["moves"])
        node, at, until = data["node"], float(data["at"]), float(data["until"])
    except (TypeError, KeyError, IndexError, ValueError, InvalidRequest) as exc:
        raise ValueError(f"{MIGRATION_ANNOTATION} unreadable: {exc}") from None
    if not isinstance(node, str) or not node:
        raise ValueError(f"{MIGRATION_ANNOTATION} unreadable: no node")
    return MigrationRecord(node, at, until, moves)


def record_of(obj: Mapping[str, Any]) -> MigrationRecord | None:
    """The record on a pod object, None when it has none; raises ValueError when it is unreadable."""
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(MIGRATION_ANNOTATION)
    return decode(raw) if isinstance(raw, str) and raw else None


@dataclass(frozen=True, slots=True)
class MovedMark:
    at: float  # wall-clock seconds: the move (its destination held)
    mover: str  # UID of the pod moved
    lineage: str  # UID of the first pod of the line (the mover's own lineage)
    pod: str  # the mover's namespace/name
    owner: str  # the mover's controller ("Kind/namespace/name")


def encode_moved(mark: MovedMark) -> str:
    return json.dumps({"at": round(mark.at, 3), "mover": mark.mover, "lineage": mark.lineage, "pod": mark.pod,
                       "owner": mark.owner}, separators=(",", ":"))


def decode_moved(raw: str) -> MovedMark:
    """Raises ValueError for anything `encode_moved` could not have written."""
    try:
        data = json.loads(raw)
        mark = MovedMark(float(data["at"]), str(data["mover"]), str(data["lineage"]), str(data.get("pod", "")),
                         str(data.get("owner", "")))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise ValueError(f"{MOVED_ANNOTATION} unreadable: {exc}") from None
    if not mark.mover or not mark.lineage:
        raise ValueError(f"{MOVED_ANNOTATION} unreadable: no mover")
    return mark


def _move(move: RecordedMove) -> dict[str, Any]:
    r = move.request
    return {"uid": move.mover, "pod": move.mover_key, "owner": move.owner,
            "request": {"shapes": [[s.gpu_count, s.gpu_milli, s.gpu_memory_mib, s.mig_profile, s.mig_count]
                                   for s in r.gpu_shapes()],
                        "cpu": r.cpu_milli, "memory": r.memory_mib, "models": sorted(r.gpu_models),
                        "priority": r.priority},
            "to": _placement(move.destination)}


def _placement(p: Placement, extras: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"node": p.node, "gpus": list(p.gpu_indices), "milli": p.gpu_milli,
                           "memoryMiB": p.gpu_memory_mib, "mig": list(p.mig_devices)}
    if extras and p.extras:
        out["extras"] = [_placement(e, extras=False) for e in p.extras]
    return out


def _read_move(m: Mapping[str, Any]) -> RecordedMove:
    r = m["request"]
    namespace = str(m["pod"]).partition("/")[0]
    shapes = [GpuShape(int(c), int(milli), int(mem), str(mig) if mig else None, int(n))
              for c, milli, mem, mig, n in r["shapes"]]
    request = PodRequest.of_shapes(str(m["pod"]), shapes, cpu_milli=int(r["cpu"]), memory_mib=int(r["memory"]),
                                   gpu_models=frozenset(str(x) for x in r["models"]),
                                   priority=int(r["priority"]), namespace=namespace)
    return RecordedMove(str(m["uid"]), str(m["pod"]), str(m["owner"]), request, _read_placement(m["to"]))


def _read_placement(p: Mapping[str, Any]) -> Placement:
    return Placement(node=str(p["node"]), gpu_indices=tuple(int(i) for i in p["gpus"]), gpu_milli=int(p["milli"]),
                     gpu_memory_mib=int(p["memoryMiB"]), mig_devices=tuple(str(u) for u in p["mig"]),
                     extras=tuple(_read_placement(e) for e in p.get("extras", ())))
