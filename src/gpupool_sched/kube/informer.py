"""What a watch gap hid, recovered: client-go's informer `Replace` for the kinds kopf watches.

kopf answers a watch that expired (410 Gone) by listing again. It hands every listed object to the
handlers as an event of type None and never reports the objects that are missing from the new list:
whatever was deleted during the gap would stay in the scheduler's state for ever (ghost pods holding
GPUs, deleted nodes still chosen). A re-list at start-up has the same gap (the service's LIST, then
kopf's own).

Each `WatchedKind` remembers the last resourceVersion it saw of every object (by UID) and the UIDs it
saw deleted. `replace()` takes a complete LIST at resourceVersion R and turns it into the events the
watch missed, as client-go's `Store.Replace` does:
  * an object known here, absent from the list, last seen at or before R: DELETED (deletions first,
    since a namesake may replace a deleted node);
  * a listed object never seen: ADDED; listed newer than seen: MODIFIED;
  * anything seen newer than R (the watch is ahead of the list) or seen deleted: left alone.
Watch events go through `event()`, which drops versions older than (or equal to) what was seen, so a
list and the watch can interleave in any order.

`Informers` lists every kind when kopf shows it re-listed (an event of type None after the start-up
sync: the watch had a gap), and every `consistency_check_s` in any case; what a list repairs is
logged and counted (`gpupool_scheduler_cache_repairs_total`). From the first sign of a gap until that
list is applied the state is `stale`: kopf's re-list hands over new pods before it says anything of the
nodes deleted meanwhile, and a decision then could bind a pod to a node that is gone. kopf's first
listing of a kind, right after the start-up sync, is re-listed too but does not make the state stale:
its gap is the second or so between two LISTs, and the extender would otherwise answer 503 to
kube-scheduler at every start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpupool_sched.kube.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)

Handler = Callable[[str | None, dict[str, Any]], None]
TOMBSTONE_S = 600.0  # how long a deletion is remembered (a list older than that is not expected)
RELIST_QUIET_S = 0.5  # kopf hands a re-list over object by object: ours starts once it has been quiet this long
RELIST_WAIT_MAX_S = 10.0  # ... or this long after the first of them, however long kopf's takes


def _version(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


def _key(meta: Mapping[str, Any]) -> str:
    uid = meta.get("uid")
    return str(uid) if uid else f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


@dataclass(slots=True)
class _Seen:
    version: int
    namespace: str
    name: str
    deleted_at: float | None = None


@dataclass(slots=True)
class Drift:
    """What one list found the watch had missed."""

    added: int = 0
    updated: int = 0
    deleted: int = 0

    def __bool__(self) -> bool:
        return bool(self.added or self.updated or self.deleted)


class WatchedKind:
    """One watched resource: its API path, its handler, and the versions seen of its objects.

    `on_error` decides about a failed LIST: True when it was handled (e.g. a CRD not installed), False
    to let the error through. `on_listed` runs after each LIST that succeeded."""

    def __init__(self, name: str, path: str, handler: Handler, *,
                 on_error: Callable[[ApiError], bool] | None = None,
                 on_listed: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.path = path
        self.handler = handler
        self.on_error = on_error
        self.on_listed = on_listed  # after every successful LIST (e.g. a CRD is served after all)
        self.clock = clock
        self._seen: dict[str, _Seen] = {}
        self.kopf_listings = 0  # events of type None seen (kopf listing this kind)
        self.kopf_listed = False  # kopf's first listing of it was followed by a re-list of ours

    def __len__(self) -> int:
        return sum(1 for s in self._seen.values() if s.deleted_at is None)

    def event(self, kind: str | None, obj: dict[str, Any]) -> bool:
        """A watch event (or a listed object); False when it was dropped as stale or repeated."""
        meta = obj.get("metadata") or {}
        key = _key(meta)
        version = _version(obj)
        seen = self._seen.get(key)
        if kind == "DELETED":
            if seen is not None and seen.deleted_at is not None:
                return False
            self._seen[key] = _Seen(version, str(meta.get("namespace") or ""), str(meta.get("name") or ""),
                                    self.clock())
        elif seen is None:
            self._seen[key] = _Seen(version, str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        elif seen.deleted_at is not None or (version and version <= seen.version):
            return False  # a deleted object never comes back; an old or repeated version changes nothing
        else:
            seen.version = version
        self.handler(kind, obj)
        return True

    def replace(self, items: list[dict[str, Any]], list_version: int) -> Drift:
        """Make the state what the complete list at `list_version` says, keeping anything newer."""
        drift = Drift()
        listed = {_key(obj.get("metadata") or {}): obj for obj in items}
        now = self.clock()
        for key, seen in list(self._seen.items()):
            if seen.deleted_at is None and key not in listed and seen.version <= list_version:
                seen.deleted_at, seen.version = now, list_version
                meta = {"uid": key, "name": seen.name, "resourceVersion": str(list_version)}
                if seen.namespace:
                    meta["namespace"] = seen.namespace
                self.handler("DELETED", {"metadata": meta})
                drift.deleted += 1
        for key, obj in listed.items():
            known = self._seen.get(key)
            if known is None:
                drift.added += 1
            elif known.deleted_at is None and _version(obj) > known.version:
                drift.updated += 1
            else:
                continue
            self.event("ADDED" if known is None else "MODIFIED", obj)
        for key in [k for k, s in self._seen.items() if s.deleted_at is not None and now - s.deleted_at > TOMBSTONE_S]:
            del self._seen[key]
        return drift


class Informers:
    """The kinds a component watches, listed in order at start-up and again after a gap."""

    def __init__(self, api: KubeApi, kinds: list[WatchedKind], *, registry: CollectorRegistry | None = None,
                 component: str = "scheduler", consistency_check_s: float = 300.0) -> None:
        self.api = api
        self.kinds = {k.name: k for k in kinds}
        self.consistency_check_s = consistency_check_s
        self.synced = False
        self.relists = 0
        self.stale = False  # a gap was seen and its re-list is not applied yet: decide nothing
        self._last_gap_event = 0.0
        self._wanted = False
        self._task: asyncio.Task[None] | None = None
        self.repairs = Counter(
            f"gpupool_{component}_cache_repairs", "Objects a re-list found the watch had missed (a gap), by kind "
            "and change; each was applied as the missed event", ["kind", "change"], registry=registry)
        for kind in self.kinds:
            for change in ("added", "updated", "deleted"):
                self.repairs.labels(kind=kind, change=change)

    def __getitem__(self, name: str) -> WatchedKind:
        return self.kinds[name]

    def watch(self, name: str, kind: str | None, obj: dict[str, Any]) -> None:
        """A kopf event. Type None after the sync means kopf is listing again: the watch had a gap."""
        watched = self.kinds[name]
        if kind is None and self.synced:
            watched.kopf_listings += 1
            if watched.kopf_listed:  # a listing after its first: the watch had a gap
                self.stale = True
            self._last_gap_event = time.monotonic()
            self.relist_soon()
        watched.event(kind, obj)

    async def list_all(self, *, initial: bool = False) -> dict[str, Drift]:
        """LIST every kind, in order, and apply what each list says (`initial`: nothing is drift)."""
        out: dict[str, Drift] = {}
        for kind in self.kinds.values():
            try:
                items, version = await self.api.list_raw(kind.path)
            except ApiError as exc:
                if kind.on_error is not None and kind.on_error(exc):
                    continue
                raise
            if kind.on_listed is not None:
                kind.on_listed()
            drift = kind.replace(items, int(version or 0))
            out[kind.name] = drift
            if initial or not drift:
                continue
            for change in ("added", "updated", "deleted"):
                if n := getattr(drift, change):
                    self.repairs.labels(kind=kind.name, change=change).inc(n)
            log.warning("re-list of %s repaired what the watch missed: %d added, %d updated, %d deleted",
                        kind.name, drift.added, drift.updated, drift.deleted)
        if initial:
            self.synced = True
        else:
            self.relists += 1
        return out

    def relist_soon(self) -> None:
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._relist(), name="relist")

    async def _relist(self) -> None:
        failures = 0
        while self._wanted:
            self._wanted = False
            if failures:
                await asyncio.sleep(min(30.0, 2.0 ** failures))
            began = time.monotonic()
            while (quiet := time.monotonic() - self._last_gap_event) < RELIST_QUIET_S:
                if time.monotonic() - began >= RELIST_WAIT_MAX_S:
                    break
                await asyncio.sleep(RELIST_QUIET_S - quiet)
            listed = [k for k in self.kinds.values() if k.kopf_listings]
            try:
                await self.list_all()
                failures = 0
                for k in listed:
                    k.kopf_listed = True
            except ApiError as exc:
                failures += 1
                self._wanted = True
                log.warning("re-listing after a watch gap failed (%s); trying again", exc)
        self.stale = False

    async def run_checks(self) -> None:
        """The periodic consistency check: a re-list every `consistency_check_s`."""
        if self.consistency_check_s <= 0:
            return
        while True:
            await asyncio.sleep(self.consistency_check_s)
            self.relist_soon()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
