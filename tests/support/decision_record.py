"""Recorded scheduling decisions: a scenario run through the real `SchedulerService`, every decision
written down as JSON (test support for issue 18: the redesign must decide exactly as before).

A scenario is a name, a placement policy and a list of steps (plain dicts, see `Scenario`). They are
fed to the service the way its watch would feed them (`on_node`, `on_pod`, `on_pod_group`,
`on_priority_class`, `on_pdb`, `quotas.on_namespace/on_quota`); a `run` step pops the service's
queue and calls `schedule_one` for each pod until nothing is left to try. The API server is
`RecordingApi`: every write (Bindings, Events, PodScheduled conditions, nominatedNodeName,
evictions) is recorded and answered 200, and what it changes comes back to the service as the
watch would bring it (a bound pod with its assignment and Running, a nominated or terminating pod,
the condition); deletions (victims going) are steps of the scenario.

The record, per decision (one popped pod, or a gang decided with it): the writes it caused,
normalised (bound node and devices, Unschedulable message, evictions and for whom, nominations,
Events' reasons and messages); after each `run`, where each of our pods is (bound node, or which
queue set it waits in). Deterministic: fixed timestamps, one fake clock for the ledger, the queue
and the gangs, the cycle's seeded random stream; after each decision every task it started
(binds, evictions, Events) runs to its end before the next pop; the writes of one decision are
sorted (their order across API threads is not part of the decision). Events are never folded into
a series (the recorder's series window is 0), so a repeated Unschedulable is a write of its own.

Runs on the code before issue 18 (commit 7727648) and after. Besides the watch handlers and
`schedule_one` it uses only: `queue.pop/where/pending_counts/backoff`, `binder.drain`,
`preemptor.drain`, `recorder.start/flush/stop`, `state.node_spec`, the `clock` attributes of the
state, queue and gangs, and the recorder's `series_window_s`.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import hashlib
import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client

from gpupool_common.handshake import ASSIGNMENT_ANNOTATION
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_sched.framework.queue import ClusterEvent
from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService

Scenario = dict[str, Any]  # {"name": str, "policy": str, "steps": [step, ...]}
Record = dict[str, Any]

DATA = Path(__file__).resolve().parent.parent / "data" / "decisions"
T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
MAX_DECISIONS = 400  # per run step: a scenario that never settles is a failure, not a hang
BACKOFF_TICK_S = 0.5  # the fake clock's step while pods wait out their backoff
_KIND_ORDER = {"bind": 0, "nominate": 1, "evict": 2, "condition": 3, "event": 4, "event-count": 5, "other": 6}

log = logging.getLogger(__name__)


def stamp(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingApi(KubeApi):
    """Every write is recorded and answered 200 (a lane shares the list); reads come from the world."""

    def __init__(self, world: World) -> None:
        super().__init__(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")), workers=1)
        self.world = world
        self.writes: list[tuple[str, str, Any]] = []

    async def write(self, method: str, api_path: str, body: Mapping[str, Any], content_type: str = "") -> None:
        self.writes.append((method, api_path, copy.deepcopy(dict(body))))
        await asyncio.sleep(0)  # a write is a suspension point, as on the wire

    async def read_pod(self, namespace: str, name: str, timeout_s: float = 15) -> dict[str, Any]:
        obj = self.world.pods.get(f"{namespace}/{name}")
        if obj is None:
            raise ApiError(404, "NotFound", f"pod {namespace}/{name} not found")
        return copy.deepcopy(obj)


class World:
    """One scenario's cluster: the service, its recording API and the objects the watch shows."""

    def __init__(self, policy: str) -> None:
        self.clock = Clock()
        self.api = RecordingApi(self)
        self.service = SchedulerService(SchedulerConfig(policy=policy), self.api)
        for part in (self.service.state, self.service.queue, self.service.gangs):
            if not hasattr(part, "clock"):
                raise AttributeError(f"{type(part).__name__} has no clock to fix")
            part.clock = self.clock
        if not hasattr(self.service.recorder, "series_window_s"):
            raise AttributeError("EventRecorder has no series_window_s")
        self.service.recorder.series_window_s = 0.0  # every report is an Event write of its own
        self.pods: dict[str, dict[str, Any]] = {}  # namespace/name -> the pod as the API server has it
        self.ours: list[str] = []  # our pending pods, in order of creation
        self.terminating: list[str] = []  # evicted, not yet deleted
        self.event_names: dict[str, tuple[str, str]] = {}  # Event name -> (reason, message)
        self.entries: list[dict[str, Any]] = []
        self.decisions = 0
        self._seen = 0  # writes already normalised
        self._rv = 100
        self._created = 0

    # ---- objects ---------------------------------------------------------------------------------
    def rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def node(self, name: str, profile: str, pod_identity: bool = True) -> dict[str, Any]:
        pub = node_publication_for_profile(profile, node_name=name, pod_identity=pod_identity)
        resources = {**pub.host_capacity, **pub.capacity}
        return {"metadata": {"name": name, "labels": dict(pub.labels), "annotations": dict(pub.annotations),
                             "resourceVersion": self.rv(), "creationTimestamp": stamp(0)},
                "spec": {}, "status": {"capacity": resources, "allocatable": resources}}

    def pod(self, step: Mapping[str, Any]) -> dict[str, Any]:
        """A pod from a `pod` or `running` step: name, namespace (default "default"), gpus / units (gpu-memory)
        / mig ({profile: n}) / model, priority + priority_class, group, labels, annotations, grace
        (terminationGracePeriodSeconds), policy (preemptionPolicy), node + scheduler for running pods."""
        self._created += 1
        namespace = step.get("namespace", "default")
        limits: dict[str, str] = {}
        if step.get("gpus"):
            limits["nvidia.com/gpu"] = str(step["gpus"])
        if step.get("units"):
            limits["nvidia.com/gpu-memory"] = str(step["units"])
        for profile, n in (step.get("mig") or {}).items():
            limits[f"nvidia.com/mig-{profile}"] = str(n)
        labels = dict(step.get("labels") or {})
        if step.get("group"):
            labels[POD_GROUP_LABEL] = step["group"]
        annotations = dict(step.get("annotations") or {})
        if step.get("model"):
            annotations["gpupool.io/gpu-model"] = step["model"]
        spec: dict[str, Any] = {
            "schedulerName": step.get("scheduler", "gpupool"),
            "containers": [{"name": "main", "resources": {
                "limits": limits, "requests": {"cpu": step.get("cpu", "1"), "memory": "1Gi", **limits}}}],
        }
        if "priority" in step:
            spec["priority"] = step["priority"]
        if step.get("priority_class"):
            spec["priorityClassName"] = step["priority_class"]
        if step.get("policy"):
            spec["preemptionPolicy"] = step["policy"]
        if step.get("grace") is not None:
            spec["terminationGracePeriodSeconds"] = step["grace"]
        status: dict[str, Any] = {"phase": "Pending"}
        if step.get("node"):
            spec["nodeName"] = step["node"]
            status = {"phase": "Running", "startTime": stamp(self._created)}
        return {"metadata": {"name": step["name"], "namespace": namespace, "uid": f"uid-{namespace}-{step['name']}",
                             "resourceVersion": self.rv(), "creationTimestamp": stamp(self._created),
                             "labels": labels, "annotations": annotations},
                "spec": spec, "status": status}

    def _update(self, key: str, change: Any) -> None:
        obj = self.pods.get(key)
        if obj is None:
            return
        obj = copy.deepcopy(obj)
        change(obj)
        obj["metadata"]["resourceVersion"] = self.rv()
        self.pods[key] = obj
        self.service.on_pod("MODIFIED", copy.deepcopy(obj))

    def _delete(self, key: str) -> None:
        obj = self.pods.pop(key, None)
        if obj is None:
            raise KeyError(f"no pod {key} to delete")
        obj["metadata"]["resourceVersion"] = self.rv()
        if key in self.terminating:
            self.terminating.remove(key)
        self.service.on_pod("DELETED", obj)

    # ---- steps -----------------------------------------------------------------------------------
    async def step(self, index: int, step: Mapping[str, Any]) -> None:
        op = step["op"]
        svc = self.service
        if op == "node":
            svc.on_node("ADDED", self.node(step["name"], step["profile"], step.get("pod_identity", True)))
        elif op == "priority_class":
            obj = {"metadata": {"name": step["name"]}, "value": step["value"]}
            if step.get("policy"):
                obj["preemptionPolicy"] = step["policy"]
            svc.on_priority_class("ADDED", obj)
        elif op == "pdb":
            svc.on_pdb("ADDED", {"metadata": {"namespace": step.get("namespace", "default"), "name": step["name"]},
                                 "spec": {"selector": {"matchLabels": dict(step["match"])}},
                                 "status": {"disruptionsAllowed": step.get("allowed", 0)}})
        elif op == "namespace":  # as quota_kinds' handler: the book, then QuotaChanged
            svc.quotas.on_namespace("ADDED", {"metadata": {"name": step["name"], "labels": dict(step["labels"])}})
            svc.queue.on_event(ClusterEvent.QUOTA_CHANGED)
        elif op == "quota":
            spec = {"namespaceSelector": {"matchLabels": dict(step["selector"])},
                    "guaranteed": {"gpus": step.get("gpus", 0), "memoryUnits": step.get("units", 0)},
                    "borrowingLimit": {"gpus": step.get("borrow", 0), "memoryUnits": step.get("borrow_units", 0)}}
            svc.quotas.on_quota("ADDED", {"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuQuota",
                                          "metadata": {"name": step["name"], "uid": f"uid-quota-{step['name']}",
                                                       "generation": 1}, "spec": spec})
            svc.queue.on_event(ClusterEvent.QUOTA_CHANGED)
        elif op == "pod_group":
            namespace = step.get("namespace", "default")
            svc.on_pod_group("ADDED", {"metadata": {"name": step["name"], "namespace": namespace,
                                                    "uid": f"uid-pg-{namespace}-{step['name']}",
                                                    "resourceVersion": self.rv()},
                                       "spec": {"minMember": step["min_member"]}})
        elif op in ("pod", "running"):
            obj = self.pod(step)
            key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
            if key in self.pods:
                raise ValueError(f"pod {key} exists")
            self.pods[key] = obj
            if op == "pod":
                self.ours.append(key)
            svc.on_pod("ADDED", copy.deepcopy(obj))
        elif op == "delete":
            for name in step["pods"]:
                self._delete(name if "/" in name else f"default/{name}")
        elif op == "evicted_go":  # every evicted pod ends (its grace is over)
            for key in sorted(self.terminating):
                self._delete(key)
        elif op == "advance":
            self.clock.now += step["seconds"]
        elif op == "run":
            await self.settle(None)
            await self.run(index)
            return
        else:
            raise ValueError(f"unknown step {op!r}")
        await self.settle({"step": index, "op": op})

    async def run(self, index: int) -> None:
        """Pop and decide until no pod is ready or backing off (those parked wait for their events)."""
        svc = self.service
        decided = 0
        while True:
            item = svc.queue.pop()
            if item is None:
                if svc.queue.pending_counts()["backoff"]:
                    self.clock.now += BACKOFF_TICK_S
                    continue
                break
            decided += 1
            if decided > MAX_DECISIONS:
                raise RuntimeError(f"step {index}: more than {MAX_DECISIONS} decisions; the scenario never settles")
            self.decisions += 1
            entry: dict[str, Any] = {"decision": self.decisions, "pod": item.key}
            try:
                svc.schedule_one(item)
            except Exception as exc:  # as the service's loop: logged, backed off
                log.exception("scheduling %s failed", item.key)
                entry["error"] = f"{type(exc).__name__}: {exc}"
                svc.queue.backoff(item)
            await self.settle(entry)
        self.entries.append({"after_run": index, "pods": self.where()})

    def where(self) -> dict[str, str]:
        """Each of our pods: bound to a node, gone, or the queue set it waits in."""
        out = {}
        for key in self.ours:
            obj = self.pods.get(key)
            if obj is None:
                out[key] = "deleted"
            elif obj["spec"].get("nodeName"):
                out[key] = f"bound {obj['spec']['nodeName']}"
            else:
                out[key] = str(self.service.queue.where(obj["metadata"]["uid"]))
        return out

    async def settle(self, entry: dict[str, Any] | None) -> None:
        """Let every task run to its end, record the writes (sorted) and bring their effects back."""
        svc = self.service
        writes: list[dict[str, Any]] = []
        while True:
            for _ in range(3):
                await svc.binder.drain()
                await svc.preemptor.drain()
                await svc.recorder.flush()
                await asyncio.sleep(0)
            raw = self.api.writes[self._seen:]
            if not raw:
                break
            self._seen = len(self.api.writes)
            batch = sorted((self.normalise(w) for w in raw), key=lambda w: (_KIND_ORDER[w["kind"]], _dump(w)))
            writes += batch
            for write in batch:
                self.feed_back(write)
        if entry is not None and (writes or "decision" in entry):
            entry["writes"] = writes
            self.entries.append(entry)

    # ---- writes --------------------------------------------------------------------------------
    def normalise(self, write: tuple[str, str, Any]) -> dict[str, Any]:
        method, api_path, body = write
        parts = api_path.strip("/").split("/")
        if method == "POST" and parts[-1] == "bindings":
            meta = body["metadata"]
            node = body["target"]["name"]
            return {"kind": "bind", "pod": f"{meta['namespace']}/{meta['name']}", "node": node,
                    "devices": self.devices(node, meta.get("uid"),
                                            (meta.get("annotations") or {}).get(ASSIGNMENT_ANNOTATION)),
                    "annotations": sorted(meta.get("annotations") or {})}
        if method == "POST" and parts[-1] == "events":
            obj = body["involvedObject"]
            name = body["metadata"].get("name")
            if name:
                self.event_names[name] = (body["reason"], body["message"])
            return {"kind": "event", "on": f"{obj['kind']} {obj['namespace']}/{obj['name']}", "type": body["type"],
                    "reason": body["reason"], "message": body["message"]}
        if method == "PATCH" and len(parts) == 6 and parts[4] == "events":
            reason, message = self.event_names.get(parts[5], ("?", "?"))
            return {"kind": "event-count", "reason": reason, "message": message, "count": body.get("count")}
        if method == "PATCH" and parts[-1] == "status" and "pods" in parts:
            pod = f"{parts[3]}/{parts[5]}"
            status = body.get("status") or {}
            if "nominatedNodeName" in status:
                return {"kind": "nominate", "pod": pod, "node": status["nominatedNodeName"]}
            conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                          for c in status.get("conditions") or ()]
            return {"kind": "condition", "pod": pod, "conditions": conditions}
        if method == "POST" and parts[-1] == "eviction":
            options = body.get("deleteOptions") or {}
            return {"kind": "evict", "pod": f"{parts[3]}/{parts[5]}", "grace": options.get("gracePeriodSeconds"),
                    "uid": (options.get("preconditions") or {}).get("uid")}
        return {"kind": "other", "method": method, "path": api_path, "body": _scrub(body)}

    def devices(self, node: str, uid: str | None, annotation: str | None) -> Any:
        """What the assignment gives each container, GPUs and MIG devices named by their index on the node."""
        if annotation is None:
            return None
        assignment = json.loads(annotation)
        spec = self.service.state.node_spec(node)
        names: dict[str, str] = {}
        for gpu in spec.gpus if spec is not None else ():
            names[gpu.uuid] = f"gpu{gpu.index}"
            for i, mig in enumerate(gpu.mig_slices):
                names[mig.uuid] = f"gpu{gpu.index}/mig{i}:{mig.profile}"
        out = {}
        for container in assignment.get("containers") or ():
            got: dict[str, Any] = {res: [names.get(d, d) for d in ids]
                                   for res, ids in sorted((container.get("devices") or {}).items())}
            memory = container.get("memory")
            if memory:
                got["memory"] = {"gpu": names.get(memory["gpu"], memory["gpu"]), "units": memory["units"],
                                 "unit_mib": memory["unit_mib"]}
            out[container["name"]] = got
        if assignment.get("node") != node or assignment.get("pod_uid") != uid:
            out["mismatch"] = {"node": assignment.get("node"), "pod_uid": assignment.get("pod_uid")}
        return out

    def feed_back(self, write: Mapping[str, Any]) -> None:
        """What the write changed, back to the service as a watch event."""
        kind = write["kind"]
        key = str(write.get("pod", ""))
        if kind == "bind":
            def bind(obj: dict[str, Any]) -> None:
                obj["spec"]["nodeName"] = write["node"]
                obj["metadata"]["annotations"].update(self._binding_annotations(obj))
                obj["status"] = {**obj["status"], "phase": "Running",
                                 "startTime": _later(obj["metadata"]["creationTimestamp"], 60)}
            self._update(key, bind)
        elif kind == "nominate":
            self._update(key, lambda obj: obj["status"].__setitem__("nominatedNodeName", write["node"]))
        elif kind == "condition":
            def condition(obj: dict[str, Any]) -> None:
                others = [c for c in obj["status"].get("conditions") or () if c.get("type") != "PodScheduled"]
                obj["status"]["conditions"] = others + list(write["conditions"])
            self._update(key, condition)
        elif kind == "evict":
            def evict(obj: dict[str, Any]) -> None:
                obj["metadata"]["deletionTimestamp"] = stamp(3600)
                obj["metadata"]["deletionGracePeriodSeconds"] = (
                    write["grace"] if write["grace"] is not None
                    else obj["spec"].get("terminationGracePeriodSeconds", 30))
            if key in self.pods and key not in self.terminating:
                self.terminating.append(key)
            self._update(key, evict)

    def _binding_annotations(self, obj: Mapping[str, Any]) -> dict[str, str]:
        """The annotations of the pod's last Binding (the API server copies them onto the pod)."""
        name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
        for method, api_path, body in reversed(self.api.writes):
            if method == "POST" and api_path.endswith("/bindings") and body["metadata"]["name"] == name \
                    and body["metadata"]["namespace"] == namespace:
                return dict(body["metadata"].get("annotations") or {})
        return {}


def _dump(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def _later(text: str, seconds: float) -> str:
    return (datetime.fromisoformat(text.replace("Z", "+00:00")) + timedelta(seconds=seconds)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def _scrub(body: Any) -> Any:
    """A body without its clock readings."""
    if isinstance(body, dict):
        return {k: _scrub(v) for k, v in body.items() if not k.endswith(("Timestamp", "TransitionTime", "Time"))}
    if isinstance(body, list):
        return [_scrub(v) for v in body]
    return body


# ---- running and comparing -------------------------------------------------------------------------

def run_scenario(scenario: Scenario) -> Record:
    """The scenario's record: {"scenario", "policy", "decisions" (count), "entries"}."""

    async def go() -> Record:
        world = World(scenario.get("policy", "gpupool"))
        world.service.recorder.start()
        try:
            for index, step in enumerate(scenario["steps"]):
                await world.step(index, step)
        finally:
            await world.service.recorder.stop()
            world.api.close()
        return {"scenario": scenario["name"], "policy": scenario.get("policy", "gpupool"),
                "steps_digest": steps_digest(scenario), "decisions": world.decisions, "entries": world.entries}

    return json.loads(json.dumps(asyncio.run(go())))  # JSON's own types (tuples as lists)


def steps_digest(scenario: Scenario) -> str:
    """Which scenario a record is of: a changed scenario needs a new recording (with the old code)."""
    text = json.dumps([scenario.get("policy", "gpupool"), scenario["steps"]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path_of(name: str) -> Path:
    return DATA / f"{name}.json"


def write_record(record: Record, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def first_difference(expected: Record, actual: Record) -> str | None:
    """None when equal (the keys of `actual` are compared: the recording may say more, e.g. its commit);
    else a readable account of the first entry that differs."""
    if all(expected.get(key) == value for key, value in actual.items()):
        return None
    head = [f"scenario {expected.get('scenario')!r}: recorded {expected.get('decisions')} decisions "
            f"(at {expected.get('recorded_at', '?')}), now {actual.get('decisions')}"]
    for key in ("scenario", "policy"):
        if expected.get(key) != actual.get(key):
            head.append(f"{key}: recorded {expected.get(key)!r}, now {actual.get(key)!r}")
    if expected.get("steps_digest") != actual.get("steps_digest"):
        head.append("the scenario's steps changed since it was recorded: record it again with the code before "
                    "the change (tests/support/record_decisions.py), not with the code under test")
    old, new = expected.get("entries", []), actual.get("entries", [])
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else None
        b = new[i] if i < len(new) else None
        if a == b:
            continue
        before = json.dumps(a, indent=1, sort_keys=True).splitlines()
        after = json.dumps(b, indent=1, sort_keys=True).splitlines()
        diff = difflib.unified_diff(before, after, "recorded", "now", lineterm="", n=3)
        head.append(f"first difference at entry {i} of {len(old)} recorded / {len(new)} now "
                    f"({_label(a)} vs {_label(b)}); "
                    + (f"the entries before it are equal, the last being {_label(old[i - 1])}:" if i
                       else "it is the first entry:"))
        head.extend(diff)
        break
    return "\n".join(head)


def _label(entry: Mapping[str, Any] | None) -> str:
    if entry is None:
        return "nothing"
    if "decision" in entry:
        return f"decision {entry['decision']} for {entry['pod']}"
    if "after_run" in entry:
        return f"pods after the run of step {entry['after_run']}"
    return f"step {entry.get('step')} ({entry.get('op')})"


# ---- the scenarios ----------------------------------------------------------------------------------

def _pods(prefix: str, count: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"op": "pod", "name": f"{prefix}-{i}", **fields} for i in range(count)]


def _running(prefix: str, count: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"op": "running", "name": f"{prefix}-{i}", "scheduler": "default-scheduler", "gpus": 1, **fields}
            for i in range(count)]


LONE_PODS: Scenario = {
    "name": "lone_pods",
    "policy": "gpupool",
    "steps": [
        {"op": "node", "name": "l40s-0", "profile": "l40s-pcie"},
        {"op": "node", "name": "mig-0", "profile": "a100-mig"},
        {"op": "node", "name": "pairs-0", "profile": "nvlink-pairs"},
        *_running("other", 2, node="l40s-0"),
        {"op": "pod", "name": "whole-1", "gpus": 1},
        {"op": "pod", "name": "whole-2", "gpus": 2},
        {"op": "pod", "name": "whole-4", "gpus": 4},
        {"op": "pod", "name": "share-20", "units": 20},
        {"op": "pod", "name": "share-10", "units": 10},
        {"op": "pod", "name": "share-40", "units": 40},
        {"op": "pod", "name": "mig-1g", "mig": {"1g.10gb": 1}},
        {"op": "pod", "name": "mig-3g", "mig": {"3g.40gb": 1}},
        {"op": "pod", "name": "mig-2x1g", "mig": {"1g.10gb": 2}},
        {"op": "pod", "name": "mig-2g", "mig": {"2g.20gb": 1}},
        {"op": "pod", "name": "l40s-model", "gpus": 1, "model": "NVIDIA-L40S"},
        {"op": "pod", "name": "cpu-only", "cpu": "2"},
        {"op": "pod", "name": "too-big", "gpus": 16},
        {"op": "pod", "name": "share-too-big", "units": 100},
        {"op": "pod", "name": "mig-unknown", "mig": {"7g.80gb": 1}},
        {"op": "pod", "name": "whole-8", "gpus": 8},
        {"op": "run"},
        {"op": "pod", "name": "mig-2g-b", "mig": {"2g.20gb": 1}},
        {"op": "pod", "name": "whole-3", "gpus": 3},
        {"op": "pod", "name": "l40s-model-b", "gpus": 2, "model": "NVIDIA-L40S"},
        {"op": "run"},
        {"op": "delete", "pods": ["whole-4", "other-0", "other-1"]},
        {"op": "run"},
        {"op": "delete", "pods": ["whole-2", "whole-1", "share-20"]},
        {"op": "run"},
        {"op": "delete", "pods": ["whole-3", "mig-2g"]},
        {"op": "run"},
    ],
}

GANGS: Scenario = {
    "name": "gangs",
    "policy": "gpupool",
    "steps": [
        {"op": "node", "name": "h100-0", "profile": "dgx-h100"},
        {"op": "node", "name": "h100-1", "profile": "dgx-h100"},
        {"op": "node", "name": "l40s-0", "profile": "l40s-pcie"},
        {"op": "namespace", "name": "team-q", "labels": {"team": "q"}},
        {"op": "quota", "name": "q", "selector": {"team": "q"}, "gpus": 3},
        # placed whole
        {"op": "pod_group", "name": "whole", "min_member": 3},
        *_pods("whole", 3, gpus=2, group="whole"),
        # waits for its members
        {"op": "pod_group", "name": "waits", "min_member": 4},
        *_pods("waits", 2, gpus=1, group="waits"),
        # admitted only partly by its GpuQuota
        {"op": "pod_group", "name": "team", "namespace": "team-q", "min_member": 2},
        *_pods("team", 4, gpus=1, group="team", namespace="team-q"),
        # a group that does not exist yet
        {"op": "pod", "name": "ghost-0", "gpus": 1, "group": "ghost"},
        {"op": "run"},
        {"op": "pod", "name": "waits-2", "gpus": 1, "group": "waits"},
        {"op": "pod", "name": "waits-3", "gpus": 1, "group": "waits"},
        {"op": "pod_group", "name": "ghost", "min_member": 1},
        {"op": "run"},
        # short of a member it had: one member gone, another scheduler takes its room, the replacement waits
        {"op": "pod_group", "name": "short", "min_member": 2},
        *_pods("short", 2, gpus=2, group="short"),
        {"op": "run"},
        {"op": "delete", "pods": ["short-0"]},
        {"op": "running", "name": "filler-0", "scheduler": "default-scheduler", "gpus": 2, "node": "h100-1"},
        {"op": "pod", "name": "short-0b", "gpus": 2, "group": "short"},
        {"op": "run"},
        {"op": "delete", "pods": ["filler-0"]},
        {"op": "run"},
        # a gang too big for the cluster; a gang whose members beyond its minimum find no room
        {"op": "pod_group", "name": "huge", "min_member": 2},
        *_pods("huge", 2, gpus=8, group="huge"),
        {"op": "delete", "pods": ["waits-0", "waits-1", "waits-2", "waits-3"]},
        {"op": "pod_group", "name": "extra", "min_member": 2},
        *_pods("extra", 4, gpus=2, group="extra"),
        {"op": "run"},
    ],
}

PREEMPTION: Scenario = {
    "name": "preemption",
    "policy": "gpupool",
    "steps": [
        {"op": "priority_class", "name": "low", "value": 100},
        {"op": "priority_class", "name": "mid", "value": 500},
        {"op": "priority_class", "name": "high", "value": 1000},
        {"op": "priority_class", "name": "polite", "value": 2000, "policy": "Never"},
        {"op": "node", "name": "n1", "profile": "l40s-pcie"},
        {"op": "node", "name": "n2", "profile": "l40s-pcie"},
        {"op": "node", "name": "n3", "profile": "l40s-pcie"},
        {"op": "node", "name": "n4", "profile": "nvlink-pairs"},
        *_running("n1-low", 4, node="n1", priority=100, priority_class="low", labels={"app": "batch"}),
        *_running("n2-mid", 4, node="n2", priority=500, priority_class="mid", labels={"app": "serve"}),
        {"op": "running", "name": "n3-low-ckpt", "scheduler": "default-scheduler", "gpus": 2, "node": "n3",
         "priority": 100, "priority_class": "low", "annotations": {"gpupool.io/checkpoint-grace-seconds": "120"}},
        *_running("n3-low", 2, node="n3", priority=100, priority_class="low", grace=10),
        *_running("n4-guarded", 8, node="n4", priority=100, priority_class="low", labels={"app": "guarded"}),
        {"op": "pdb", "name": "guarded", "match": {"app": "guarded"}, "allowed": 0},
        # a high-priority pod preempts the lowest; a Never pod of higher priority waits
        {"op": "pod", "name": "urgent", "gpus": 4, "priority": 1000, "priority_class": "high"},
        {"op": "pod", "name": "polite", "gpus": 1, "priority": 2000, "priority_class": "polite"},
        {"op": "run"},
        {"op": "evicted_go"},
        {"op": "run"},
        # only protected victims would do: it waits
        {"op": "pod", "name": "huge", "gpus": 8, "priority": 1000, "priority_class": "high"},
        {"op": "run"},
        # a high-priority gang preempts lower pods for its minimum
        {"op": "pod_group", "name": "hg", "min_member": 2},
        *_pods("hg", 2, gpus=2, priority=1000, priority_class="high", group="hg"),
        {"op": "run"},
        {"op": "evicted_go"},
        {"op": "run"},
        # a lower-priority preemptor's holds, taken by a more important pod before it is tried again (above,
        # the Never pod of priority 2000 took one of urgent's held GPUs on n3 the same way)
        {"op": "node", "name": "n5", "profile": "l40s-pcie"},
        *_running("n5-low", 4, node="n5", priority=100, priority_class="low", labels={"app": "batch"}),
        {"op": "pod", "name": "mid-pre", "gpus": 2, "priority": 500, "priority_class": "mid"},
        {"op": "run"},
        {"op": "evicted_go"},
        {"op": "pod", "name": "top", "gpus": 2, "priority": 1000, "priority_class": "high"},
        {"op": "run"},
        {"op": "evicted_go"},
        {"op": "run"},
    ],
}

QUOTA_RECLAIM: Scenario = {
    "name": "quota_reclaim",
    "policy": "gpupool",
    "steps": [
        {"op": "node", "name": "h100-0", "profile": "dgx-h100"},
        {"op": "node", "name": "l40s-0", "profile": "l40s-pcie"},
        {"op": "namespace", "name": "team-a", "labels": {"team": "a"}},
        {"op": "namespace", "name": "team-b", "labels": {"team": "b"}},
        {"op": "namespace", "name": "free", "labels": {}},
        {"op": "quota", "name": "a", "selector": {"team": "a"}, "gpus": 2, "borrow": 8},
        {"op": "quota", "name": "b", "selector": {"team": "b"}, "gpus": 6},
        # team a borrows far beyond its guarantee (priority 100), up to its borrowing limit
        *_pods("a", 8, gpus=1, namespace="team-a", priority=100),
        {"op": "pod", "name": "a-big", "gpus": 4, "namespace": "team-a", "priority": 100},
        {"op": "pod", "name": "free-0", "gpus": 4, "namespace": "free"},
        {"op": "run"},
        # team b (priority 0, within its guarantee) reclaims: victims whatever their priority
        {"op": "pod", "name": "b-train", "gpus": 2, "namespace": "team-b"},
        {"op": "run"},
        {"op": "evicted_go"},
        # a more important borrower of team a may not take what is held for b
        {"op": "pod", "name": "a-urgent", "gpus": 2, "namespace": "team-a", "priority": 1000},
        {"op": "run"},
        # a gang of team b reclaims for its minimum
        {"op": "pod_group", "name": "bg", "namespace": "team-b", "min_member": 2},
        *_pods("bg", 2, gpus=2, namespace="team-b", group="bg"),
        {"op": "run"},
        {"op": "evicted_go"},
        {"op": "run"},
        # b at its guarantee: one more is over quota, and reclaims nothing
        {"op": "pod", "name": "b-more", "gpus": 1, "namespace": "team-b"},
        {"op": "run"},
    ],
}

SCENARIOS: dict[str, Scenario] = {s["name"]: s for s in (LONE_PODS, GANGS, PREEMPTION, QUOTA_RECLAIM)}
