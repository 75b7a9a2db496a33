"""One pod event read once: `PodInfo` (kube-scheduler's PodInfo), the record the cache, the queue, the
framework and the writer carry instead of the API server's JSON.

The cheap parts (identity, node, phase, resourceVersion) are read when the event arrives. The plan
(`plan_pod`: containers, requests, constraints, priority) depends on the cluster too (GPU models, MIG
profiles, PriorityClasses), so it is made on first use and kept for as long as those facts stay the
same; a later event of the pod with the same spec and metadata (`revision`, e.g. the scheduler's own
Unschedulable condition or a status change) takes the plans over instead of parsing again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sched.kube.podspec import ClusterFacts, InvalidPod, PodPlan, plan_pod, pod_revision

_UNSET: Any = object()


@dataclass(slots=True, eq=False)
class PodInfo:
    obj: Mapping[str, Any]  # the event's object, as the API server sent it
    uid: str
    namespace: str
    name: str
    resource_version: int
    node: str | None  # spec.nodeName
    phase: str  # status.phase ("Pending" when absent)
    scheduler_name: str | None
    _revision: Any = _UNSET
    # strict -> (facts, PriorityClass generation, the plan or why there is none); made on first use (most
    # events are of bound pods and are never planned)
    _plans: dict[bool, tuple[ClusterFacts, int, PodPlan | InvalidPod]] | None = None

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> PodInfo:
        """Never raises: a malformed object gets empty fields (the plan then says what is wrong)."""
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        meta = meta if isinstance(meta, Mapping) else {}
        spec = obj.get("spec") if isinstance(obj, Mapping) else None
        spec = spec if isinstance(spec, Mapping) else {}
        status = obj.get("status") if isinstance(obj, Mapping) else None
        status = status if isinstance(status, Mapping) else {}
        try:
            rv = int(meta.get("resourceVersion") or 0)
        except (TypeError, ValueError):
            rv = 0
        node = spec.get("nodeName")
        scheduler = spec.get("schedulerName")
        return cls(obj, str(meta.get("uid") or ""), str(meta.get("namespace") or "default"),
                   str(meta.get("name") or ""), rv, str(node) if node else None,
                   str(status.get("phase") or "Pending"), scheduler if isinstance(scheduler, str) else None)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def revision(self) -> Any:
        """What decides the pod's schedulability (`pod_revision`: spec and metadata, not status)."""
        if self._revision is _UNSET:
            self._revision = pod_revision(self.obj)
        return self._revision

    def follows(self, earlier: PodInfo | None) -> PodInfo:
        """Take over `earlier`'s plans when this event changed neither spec nor metadata."""
        if (earlier is not None and earlier is not self and earlier.uid == self.uid and earlier._plans
                and self.revision is not None and earlier.revision == self.revision):
            self._plans = dict(earlier._plans)
        return self

    def plan(self, facts: ClusterFacts, classes: Mapping[str, int], classes_generation: int,
             strict: bool = True) -> PodPlan:
        """`plan_pod` of this pod, made once per facts and PriorityClasses; raises `InvalidPod`."""
        known = self._plans.get(strict) if self._plans else None
        if known is not None and known[0] == facts and known[1] == classes_generation:
            answer = known[2]
        else:
            try:
                answer = plan_pod(self.obj, facts, classes, strict=strict)
            except InvalidPod as exc:
                answer = exc
            if self._plans is None:
                self._plans = {}
            self._plans[strict] = (facts, classes_generation, answer)
        if isinstance(answer, InvalidPod):
            raise InvalidPod(str(answer), permanent=answer.permanent)  # fresh: no traceback piles up
        return answer
