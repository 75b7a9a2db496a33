"""The scheduler service run on a copy of the live cluster, writing nothing: the what-if's engine.

`SchedulerService` is built as the scheduler builds it, on a `DryRunApi`: its reads (the start-up LIST
of every kind it watches) go to the API server once, and each later service replays that same listing;
its writes (Bindings, evictions, nominations, Events, status) are recorded and never sent. The state
is fed by the service's own `resync` (the informers' LIST and the watch handlers), the queue is the
service's queue, and each popped pod goes through `schedule_one`: the same cycle, actions, quotas,
gangs and policy as the live scheduler, in the same order.

What a write would have changed comes back to the service as the watch would bring it: a bound pod
(its node, its assignment annotation, Running), a nomination, an evicted pod terminating and then
gone (its grace period is not waited for). The clocks of the ledger, the queue and the gangs are one
fake clock, advanced while pods wait out their backoff, so a what-if never sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_common.handshake import ASSIGNMENT_ANNOTATION
from gpupool_sched.kube.kubeapi import JSON, ApiError, KubeApi
from gpupool_sched.kube.migration_record import MIGRATION_ANNOTATION
from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService

log = logging.getLogger(__name__)

PODS = "/api/v1/pods"
BACKOFF_TICK_S = 0.5  # the fake clock's step while pods wait out their backoff
MAX_DECISIONS_PER_POD = 20  # a what-if that never settles stops (and says so), it does not hang
SETTLE_ROUNDS = 200  # rounds of (run the writers' tasks, feed their writes back) per decision


@dataclass(frozen=True, slots=True)
class Write:
    method: str
    path: str
    body: dict[str, Any]


class DryRunApi(KubeApi):
    """A KubeApi that LISTs each path from the API server once and writes nothing: every write is
    recorded and answered as if it succeeded. A lane (`KubeApi.lane`) shares the recorded writes and the
    listings."""

    def __init__(self, api_client: Any, *, component: str = "gpupool-whatif",
                 offline: Mapping[str, list[dict[str, Any]]] | None = None) -> None:
        """`offline`: the listings (path -> objects) to serve instead of the API server's; any other path
        lists empty (a cluster saved earlier, or a test's)."""
        super().__init__(api_client, workers=1, component=component)
        self.listings: dict[str, list[tuple[list[dict[str, Any]], str]]] = {
            path: [(list(objects), "1")] for path, objects in (offline or {}).items()}
        self.offline = offline is not None
        self.refused: dict[str, ApiError] = {}
        self.writes: list[Write] = []

    async def list_pages(self, path: str, page: int = 500) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        if path in self.refused:
            raise self.refused[path]
        if path not in self.listings and self.offline:
            self.listings[path] = [([], "1")]
        if path not in self.listings:
            pages = []
            try:
                async for items, version in super().list_pages(path, page):
                    pages.append((items, version))
            except ApiError as exc:
                self.refused[path] = exc
                raise
            self.listings[path] = pages
        for items, version in self.listings[path]:
            yield copy.deepcopy(items), version

    def listed(self, path: str) -> list[dict[str, Any]]:
        """What the LIST of `path` returned (empty when it was not listed or was refused)."""
        return [obj for items, _ in self.listings.get(path, ()) for obj in items]

    async def write(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str = JSON) -> None:
        self.writes.append(Write(method, api_path, copy.deepcopy(dict(body))))
        await asyncio.sleep(0)  # a write is a suspension point, as on the wire


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Decision:
    """What the scheduler would do for one pod: bind it (node, assignment), or preempt / move for it."""

    pod: str  # namespace/name
    synthetic: bool
    node: str | None = None
    devices: dict[str, Any] | None = None  # per container: resource -> GPU indices, memory share
    assignment: str | None = None  # the gpupool.io/assignment annotation the Binding carries
    victims: list[str] = field(default_factory=list)  # pods evicted so that it fits (preemption, reclaim)
    moves: list[str] = field(default_factory=list)  # pods moved elsewhere so that it fits (consolidate)
    nominated: str | None = None  # node it waited for while its victims went
    reason: str | None = None  # the last FailedScheduling message, when it is not bound
    evicted_by: str | None = None  # bound, then evicted for this pod (a later decision's victim)


@dataclass
class Outcome:
    """One policy's what-if: the decisions in the order made, and the cluster after them."""

    policy: str  # the policy, or the label of a candidate configuration
    decisions: dict[str, Decision]  # pod -> decision, in the order the pods were first decided
    order: list[str]  # pods in the order they were bound
    pending: list[str]  # the cluster's pending pods the what-if started from
    synthetic: list[str]  # the continuation's pods
    total_gpus: int
    allocated_milli: int
    fragmented_milli: float
    unsettled: list[str]  # pods still deciding when the decision limit was reached


async def run_what_if(api: DryRunApi, config: SchedulerConfig, continuation: Iterable[dict[str, Any]] = (),
                      *, label: str | None = None) -> Outcome:
    """Start a service on `api`, let it decide for every pending pod, then for each continuation pod in
    turn (each arrives once the previous ones are decided). `label`: the outcome's name (the policy's)."""
    service = SchedulerService(config, api)
    clock = FakeClock(1_000_000.0)
    service.state.clock = clock
    service.queue.clock = clock
    service.gangs.clock = clock
    world = _World(service, api, clock)
    await service.resync()
    service.recorder.start()
    try:
        pending = [info.key for info in service.scheduling.pending.values()]
        world.known = {_key(obj): obj for obj in api.listed(PODS)}
        await world.drain()
        synthetic = []
        for obj in continuation:
            key = _key(obj)
            synthetic.append(key)
            world.synthetic.add(key)
            world.known[key] = copy.deepcopy(obj)
            service.on_pod("ADDED", copy.deepcopy(obj))
            await world.drain()
        snap = service.state.snapshot
        total = snap.total_gpu_milli
        fragmented = cluster_fragmentation_milli(snap, service.policies.profile.profile()) if total else 0.0
        return Outcome(label or config.policy, world.decisions, world.bound, sorted(pending), synthetic,
                       total // MILLI, int(snap.used_gpu_milli()), float(fragmented), sorted(world.unsettled))
    finally:
        await service.recorder.stop(flush_s=0.0)
        await service.binder.drain()
        await service.preemptor.drain()


class _World:
    """The pods as the API server would have them after the recorded writes, fed back to the service."""

    def __init__(self, service: SchedulerService, api: DryRunApi, clock: FakeClock) -> None:
        self.service = service
        self.api = api
        self.clock = clock
        self.known: dict[str, dict[str, Any]] = {}  # namespace/name -> the pod
        self.synthetic: set[str] = set()
        self.decisions: dict[str, Decision] = {}
        self.bound: list[str] = []
        self.unsettled: set[str] = set()
        self._seen = len(api.writes)
        self._tries: dict[str, int] = {}
        self._rv = 0

    def decision(self, key: str) -> Decision:
        if key not in self.decisions:
            self.decisions[key] = Decision(key, key in self.synthetic)
        return self.decisions[key]

    async def drain(self) -> None:
        """Pop and decide until no pod is ready or backing off (parked pods wait for their events)."""
        queue = self.service.queue
        while True:
            item = queue.pop()
            if item is None:
                if queue.pending_counts()["backoff"]:
                    self.clock.now += BACKOFF_TICK_S
                    continue
                return
            tries = self._tries[item.key] = self._tries.get(item.key, 0) + 1
            if tries > MAX_DECISIONS_PER_POD:
                self.unsettled.add(item.key)
                queue.done(item.uid)
                continue
            try:
                self.service.schedule_one(item)
            except Exception:  # as the service's loop: logged, backed off
                log.exception("scheduling %s failed unexpectedly", item.key)
                queue.backoff(item)
            await self.settle()

    async def settle(self) -> None:
        """Run the writers' tasks to their end and bring what their writes change back, until quiet."""
        service = self.service
        binds: asyncio.Future[None] | None = None
        for _ in range(SETTLE_ROUNDS):
            for _ in range(3):
                await service.preemptor.drain()
                await service.recorder.flush()
                await asyncio.sleep(0)
            if binds is None or binds.done():
                binds = asyncio.ensure_future(service.binder.drain())
            # a bind may wait at its node's gate for an earlier one's feedback: never block on it
            await asyncio.wait({binds}, timeout=0.01)
            batch = self.api.writes[self._seen:]
            self._seen = len(self.api.writes)
            if batch:
                self.feed_back(batch)
            elif binds.done():
                return
        log.error("the scheduler's writers did not settle after %d rounds; the what-if goes on", SETTLE_ROUNDS)

    # ---- writes --------------------------------------------------------------------------------
    def feed_back(self, batch: list[Write]) -> None:
        parts_of = [w.path.strip("/").split("/") for w in batch]
        moving = any(w.method == "PATCH" and len(p) == 6 and p[4] == "pods"
                     and MIGRATION_ANNOTATION in ((w.body.get("metadata") or {}).get("annotations") or {})
                     for w, p in zip(batch, parts_of, strict=True))
        beneficiary = next((f"{p[3]}/{p[5]}" for w, p in zip(batch, parts_of, strict=True)
                            if w.method == "PATCH" and p[-1] == "status" and "pods" in p
                            and (w.body.get("status") or {}).get("nominatedNodeName")), None)
        for write, parts in zip(batch, parts_of, strict=True):
            if write.method == "POST" and parts[-1] == "bindings":
                self._bound(write.body)
            elif write.method == "POST" and parts[-1] == "eviction":
                victim = f"{parts[3]}/{parts[5]}"
                if beneficiary is not None:
                    d = self.decision(beneficiary)
                    (d.moves if moving else d.victims).append(victim)
                if victim in self.decisions and not moving:
                    self.decisions[victim].evicted_by = beneficiary
                self._evicted(victim)
            elif write.method == "PATCH" and parts[-1] == "status" and "pods" in parts:
                key = f"{parts[3]}/{parts[5]}"
                status = write.body.get("status") or {}
                if "nominatedNodeName" in status:
                    node = status["nominatedNodeName"]
                    if node:
                        self.decision(key).nominated = node
                    self._update(key, lambda obj, node=node: obj["status"].__setitem__("nominatedNodeName", node))
                elif status.get("conditions"):
                    conditions = list(status["conditions"])
                    self._update(key, lambda obj, c=conditions: obj["status"].__setitem__(
                        "conditions", [x for x in obj["status"].get("conditions") or ()
                                       if x.get("type") != "PodScheduled"] + c))
            elif write.method == "POST" and parts[-1] == "events":
                involved = write.body.get("involvedObject") or {}
                key = f"{involved.get('namespace', '')}/{involved.get('name', '')}"
                if write.body.get("reason") == "FailedScheduling" and key in self.known:
                    self.decision(key).reason = str(write.body.get("message") or "")

    def _bound(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        node = str((body.get("target") or {}).get("name") or "")
        annotations = dict(meta.get("annotations") or {})
        d = self.decision(key)
        d.node, d.reason = node, None
        d.assignment = annotations.get(ASSIGNMENT_ANNOTATION)
        d.devices = devices_of(d.assignment, node, self.service)
        self.bound.append(key)

        def bind(obj: dict[str, Any]) -> None:
            obj["spec"]["nodeName"] = node
            obj["metadata"].setdefault("annotations", {}).update(annotations)
            obj["status"] = {**(obj.get("status") or {}), "phase": "Running"}
        self._update(key, bind)

    def _evicted(self, key: str) -> None:
        def terminating(obj: dict[str, Any]) -> None:
            obj["metadata"]["deletionTimestamp"] = "2000-01-01T00:00:00Z"
        self._update(key, terminating)
        obj = self.known.pop(key, None)
        if obj is not None:
            self.service.on_pod("DELETED", obj)

    def _update(self, key: str, change: Any) -> None:
        obj = self.known.get(key)
        if obj is None:
            return
        obj = copy.deepcopy(obj)
        obj.setdefault("status", {})
        change(obj)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = f"{obj['metadata'].get('resourceVersion', '0')}.{self._rv}"
        self.known[key] = obj
        self.service.on_pod("MODIFIED", copy.deepcopy(obj))


def devices_of(annotation: str | None, node: str, service: SchedulerService) -> dict[str, Any] | None:
    """What an assignment gives each container, GPUs named by their index on the node (gpu0, gpu1/mig0:1g.10gb)
    and a memory share as {gpu, units}: the form the e2e test compares with the live scheduler's."""
    return describe_assignment(annotation, _device_names(service, node))


def _device_names(service: SchedulerService, node: str) -> dict[str, str]:
    spec = service.state.node_spec(node)
    names: dict[str, str] = {}
    for gpu in spec.gpus if spec is not None else ():
        names[gpu.uuid] = f"gpu{gpu.index}"
        for i, mig in enumerate(gpu.mig_slices):
            names[mig.uuid] = f"gpu{gpu.index}/mig{i}:{mig.profile}"
    return names


def describe_assignment(annotation: str | None, names: Mapping[str, str]) -> dict[str, Any] | None:
    if not annotation:
        return None
    assignment = json.loads(annotation)
    out: dict[str, Any] = {}
    for container in assignment.get("containers") or ():
        got: dict[str, Any] = {res: [names.get(d, d) for d in ids]
                               for res, ids in sorted((container.get("devices") or {}).items())}
        memory = container.get("memory")
        if memory:
            got["memory"] = {"gpu": names.get(memory["gpu"], memory["gpu"]), "units": memory["units"]}
        out[str(container.get("name"))] = got
    return out


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
