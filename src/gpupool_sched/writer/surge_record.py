"""What a make-before-break migration (writer/surge.py) reads and writes: the annotations and labels it uses,
the record a surge leaves on the mover's ReplicaSet for the next leader (`SurgeRecord`), the Deployment it
scales and how a surge ended (`Outcome`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

MIGRATE = "gpupool.io/migrate"  # on a Deployment: "surge" moves its pods make-before-break
SURGE = "surge"
REVISION = "deployment.kubernetes.io/revision"  # the Deployment controller's, on a Deployment and its ReplicaSets
LOWEST_COST = -2147483648  # int32's least: removed first among pods equally placed, running and ready
DEFAULT_SURGE_TIMEOUT_S = 300.0
CONFLICT_RETRIES = 5  # reads and writes of the count when others write the Deployment too
SCALE_DOWN_WINDOW_S = 120.0  # after Ready: the scale-down and the ReplicaSet's deletion of the mover
SURGE_RECORD = "gpupool.io/surge"  # on the mover's ReplicaSet mid-surge: what the next leader finishes or undoes
SURGING = "gpupool.io/surging"  # its label, so that a new leader finds them with one LIST
REPLICA_SETS = "/apis/apps/v1/replicasets"


@dataclass(frozen=True, slots=True)
class SurgeRecord:
    """A surge under way, as the Deployment carries it (`gpupool.io/surge`)."""

    replicas: int  # spec.replicas before the surge: the surge made it replicas + 1
    mover: str  # UID of the pod that moves
    pod: str  # its namespace/name
    owner: str  # its controller ("ReplicaSet/namespace/name"): the new replica has the same
    blocked: str  # UID of the pod the migration makes room for
    at: float  # wall-clock seconds: the surge began
    until: float  # wall-clock seconds: the new replica must be Ready by then, else the surge is rolled back

    def encode(self) -> str:
        return json.dumps({"replicas": self.replicas, "mover": self.mover, "pod": self.pod, "owner": self.owner,
                           "blocked": self.blocked, "at": round(self.at, 3), "until": round(self.until, 3)},
                          separators=(",", ":"))

    @staticmethod
    def decode(raw: str) -> SurgeRecord:
        try:
            d = json.loads(raw)
            return SurgeRecord(int(d["replicas"]), str(d["mover"]), str(d["pod"]), str(d["owner"]),
                               str(d["blocked"]), float(d["at"]), float(d["until"]))
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"{SURGE_RECORD} unreadable: {exc}") from None


@dataclass(frozen=True, slots=True)
class Deployment:
    """The Deployment a mover's ReplicaSet belongs to (as read just now)."""

    namespace: str
    name: str
    uid: str
    replica_set: str
    key: str  # namespace/name, for messages


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a surge ended. `result`: the migrations metric's (surged, rolled_back, refused, failed,
    abandoned), or "gone": the mover was deleted by someone else meanwhile (its room is free; the count
    went back, the ReplicaSet removing its least ready pod); `why`: for the Events (None when it worked);
    `new`: the new replica's namespace/name."""

    result: str
    why: str | None = None
    new: str | None = None
    node: str | None = None  # where the new replica runs
    replicas: int = 0  # the count before the surge


@dataclass(frozen=True, slots=True)
class Mover:
    """A pod as the ledger had it when the surge began (its entry changes when it goes)."""

    uid: str
    key: str
    owner: str
    lineage: str  # the first UID of the pods it replaces (ClusterState.replaced)
    grace_s: int | None
    node: str = ""


class Refused(Exception):
    """The scheduler does not scale this Deployment now (an HPA, a rollout): the mover is not moved."""
