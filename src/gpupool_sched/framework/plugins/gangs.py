"""Gangs on the live cluster: PodGroups (scheduler-plugins' `scheduling.x-k8s.io/v1alpha1`), which
pods belong to which, and the status the scheduler writes back.

A pod joins the PodGroup NAME of its namespace with the label `scheduling.x-k8s.io/pod-group: NAME`.
The group's `spec.minMember` members are placed together or not at all (`placement/gang.py`); this
module only keeps the facts the cycle needs (the group, its members, which of them the ledger holds)
and the status (`phase`, `scheduled`, `running`, `scheduleStartTime`) that `kubectl get pg` shows.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sched.cache.state import ClusterState

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GROUP, VERSION, PLURAL = "scheduling.x-k8s.io", "v1alpha1", "podgroups"
PODGROUPS = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # an object name (DNS subdomain)


@dataclass(slots=True)
class PodGroup:
    key: str  # namespace/name
    uid: str
    min_member: int  # 0 when the object is malformed (see `problem`)
    timeout_s: float | None  # spec.scheduleTimeoutSeconds
    problem: str | None = None  # why the group cannot be scheduled as written
    first_try: float | None = None  # monotonic, first scheduling attempt of any member
    timed_out: bool = False  # the timeout Event was written (once per wait)
    last_message: str = ""  # why the last attempt did not place it
    written: dict[str, Any] = field(default_factory=dict)  # the status last written
    committed: bool = False  # its minimum was placed in one statement (cleared when it is released)
    broken_since: float | None = None  # monotonic: a committed member's Binding failed, the gang is short

    @property
    def namespace(self) -> str:
        return self.key.partition("/")[0]

    @property
    def name(self) -> str:
        return self.key.partition("/")[2]


def group_of(obj: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(namespace/name of the pod's PodGroup or None, the problem with its label or None)."""
    meta = obj.get("metadata") or {}
    name = (meta.get("labels") or {}).get(POD_GROUP_LABEL)
    if name is None:
        return None, None
    if not isinstance(name, str) or not _NAME.match(name):
        return None, (f"label {POD_GROUP_LABEL}={name!r} does not name a PodGroup (lowercase letters, digits, "
                      "'-' and '.', starting and ending with a letter or digit)")
    return f"{meta.get('namespace', '')}/{name}", None


def _parse(obj: Mapping[str, Any]) -> PodGroup | None:
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        return None
    key = f"{meta.get('namespace', '')}/{meta['name']}"
    spec = obj.get("spec") or {}
    minimum, timeout = spec.get("minMember"), spec.get("scheduleTimeoutSeconds")
    problem = None
    if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 1:
        problem = f"PodGroup {key}: spec.minMember must be an integer >= 1, got {minimum!r}"
        minimum = 0
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1):
        problem = problem or f"PodGroup {key}: spec.scheduleTimeoutSeconds must be an integer >= 1, got {timeout!r}"
        timeout = None
    return PodGroup(key, str(meta.get("uid", "")), minimum, float(timeout) if timeout else None, problem)


class Gangs:
    """PodGroups by key and the live pods that name each (whatever their state)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.groups: dict[str, PodGroup] = {}
        self.members: dict[str, set[str]] = {}  # group key -> pod UIDs
        self._member_of: dict[str, str] = {}  # pod UID -> group key
        self.clock = clock
        self.available = True  # False: the PodGroup CRD is not installed (listing it failed with 404)

    # ---- watch ---------------------------------------------------------------------------------
    def apply_group(self, kind: str | None, obj: Mapping[str, Any]) -> str | None:
        """A PodGroup event; returns the key of the group when its members may now be schedulable."""
        group = _parse(obj)
        if group is None:
            return None
        if kind == "DELETED":
            self.groups.pop(group.key, None)
            return group.key
        old = self.groups.get(group.key)
        if old is not None and old.uid == group.uid:
            group.first_try, group.timed_out, group.written = old.first_try, old.timed_out, old.written
            group.last_message = old.last_message
            group.committed, group.broken_since = old.committed, old.broken_since
            if (old.min_member, old.timeout_s, old.problem) == (group.min_member, group.timeout_s, group.problem):
                self.groups[group.key] = group
                return None  # a status write of ours, or metadata
        self.groups[group.key] = group
        return group.key

    def track(self, uid: str, key: str | None) -> str | None:
        """The pod `uid` names group `key` (None: none). Returns the key it joined when new."""
        old = self._member_of.get(uid)
        if old == key:
            return None
        if old is not None:
            self.untrack(uid)
        if key is None:
            return None
        self._member_of[uid] = key
        self.members.setdefault(key, set()).add(uid)
        return key

    def untrack(self, uid: str) -> None:
        key = self._member_of.pop(uid, None)
        if key is None:
            return
        members = self.members.get(key)
        if members is not None:
            members.discard(uid)
            if not members:
                del self.members[key]

    def member_of(self, uid: str) -> str | None:
        return self._member_of.get(uid)

    # ---- what the cycle and the status need --------------------------------------------------------
    def placed(self, key: str, state: ClusterState) -> list[str]:
        """Members the ledger holds (assumed, bound or confirmed)."""
        return [uid for uid in self.members.get(key, ()) if uid in state.pods]

    def status(self, group: PodGroup, state: ClusterState, ended: Mapping[str, str]) -> dict[str, Any]:
        """The PodGroup status the cluster should show. `ended`: member UID -> Succeeded/Failed."""
        members = self.members.get(group.key, set())
        placed = [state.pods[uid] for uid in members if uid in state.pods]
        running = sum(1 for e in placed if not e.pending)
        succeeded = sum(1 for uid in members if ended.get(uid) == "Succeeded")
        failed = sum(1 for uid in members if ended.get(uid) == "Failed")
        scheduled = len(placed) + succeeded + failed
        if group.min_member and succeeded >= group.min_member:
            phase = "Finished" if failed else "Succeeded"
        elif group.min_member and running >= group.min_member:
            phase = "Running"
        elif group.min_member and scheduled >= group.min_member:
            phase = "Scheduled"
        elif group.first_try is not None:
            phase = "Scheduling"
        else:
            phase = "Pending"
        return {"phase": phase, "scheduled": scheduled, "running": running, "succeeded": succeeded,
                "failed": failed}

    def started(self, key: str) -> None:
        group = self.groups.get(key)
        if group is not None and group.first_try is None:
            group.first_try = self.clock()

    def overdue(self, key: str) -> PodGroup | None:
        """The group, if it has waited longer than its scheduleTimeoutSeconds and was not told yet."""
        group = self.groups.get(key)
        if group is None or group.timeout_s is None or group.first_try is None or group.timed_out:
            return None
        if self.clock() - group.first_try < group.timeout_s:
            return None
        group.timed_out = True
        return group

    def scheduled(self, key: str) -> None:
        """The gang's minimum was placed: its next wait is a new one."""
        group = self.groups.get(key)
        if group is not None:
            group.first_try, group.timed_out = None, False
            group.committed, group.broken_since = True, None

    def broke(self, key: str) -> PodGroup | None:
        """A member of the committed gang `key` failed its Binding: the group, when this starts a repair."""
        group = self.groups.get(key)
        if group is None or not group.committed or group.broken_since is not None:
            return None
        group.broken_since = self.clock()
        return group

    def to_release(self, state: ClusterState, default_timeout_s: float) -> list[PodGroup]:
        """Broken gangs still short of their minimum after their timeout (scheduleTimeoutSeconds, else
        `default_timeout_s`): their bound members are to be released. Healed ones stop being broken."""
        out = []
        now = self.clock()
        for group in self.groups.values():
            if group.broken_since is None:
                continue
            if len(self.placed(group.key, state)) >= group.min_member:
                group.broken_since = None  # whole again
            elif now - group.broken_since >= (group.timeout_s or default_timeout_s):
                group.broken_since, group.committed = None, False
                out.append(group)
        return out
