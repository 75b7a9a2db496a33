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
list and the watch can interleave in any order. A list is read and applied a page at a time (`Listing`,
500 objects a page as client-go's pager): a re-list keeps only what it adds or changes until its
deletions are known, and the start-up list hands each page over as it comes, so the whole list is never
held at once (10,000 pods are ~100 MiB parsed; kopf's own listing runs at the same time).

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
LIST_PAGE = 500  # objects per LIST page (client-go's pager default)
RELIST_WAIT_MAX_S = 10.0  # ... or this long after the first of them, however long kopf's takes


def _version(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


def _key(meta: Mapping[str, Any]) -> str:
    uid = meta.get("uid")
    return str(uid) if uid else f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without metadata.managedFields (kube-scheduler's informer transform, TransformStripManagedFields):
    the API server's record of who set which field, never read here, and about half of a pod's parsed
    size (a pending pod's object is kept until it is bound). A shallow copy: the caller's dict is kopf's."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or "managedFields" not in meta:
        return obj
    return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


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
        self.handler(kind, without_managed_fields(obj))
        return True

    def replace(self, items: list[dict[str, Any]], list_version: int) -> Drift:
        """Make the state what the complete list at `list_version` says, keeping anything newer."""
        listing = self.listing()
        listing.page(items)
        return listing.end(list_version)

    def listing(self) -> Listing:
        """Apply one LIST a page at a time (`Listing`)."""
        return Listing(self, eager=all(s.deleted_at is not None for s in self._seen.values()))


class Listing:
    """One LIST of a kind, applied as its pages come, so that the whole list is never held at once.

    A list that replaces known objects (`eager` False: a re-list) keeps only the objects it adds or
    changes, and applies them after its deletions (`end`), since a namesake may replace a deleted
    object. A list where nothing is known yet (start-up) has no deletions to wait for: each object is
    handed over as its page comes. Watch events may interleave between pages; versions decide, as
    everywhere (`WatchedKind.event`)."""

    def __init__(self, kind: WatchedKind, *, eager: bool) -> None:
        self.kind = kind
        self.eager = eager
        self.listed: set[str] = set()
        self.held: list[tuple[str, dict[str, Any]]] = []  # a re-list's additions and changes, until `end`
        self.drift = Drift()

    def page(self, items: list[dict[str, Any]]) -> None:
        seen = self.kind._seen
        for obj in items:
            key = _key(obj.get("metadata") or {})
            self.listed.add(key)
            known = seen.get(key)
            if known is not None and (known.deleted_at is not None or _version(obj) <= known.version):
                continue
            if self.eager:
                self._apply(key, obj)
            else:
                self.held.append((key, obj))

    def _apply(self, key: str, obj: dict[str, Any]) -> None:
        known = self.kind._seen.get(key)
        if self.kind.event("ADDED" if known is None else "MODIFIED", obj):
            if known is None:
                self.drift.added += 1
            else:
                self.drift.updated += 1

    def end(self, list_version: int) -> Drift:
        """The list is complete: what it lacks and was last seen at or before `list_version` is gone."""
        kind, now = self.kind, self.kind.clock()
        for key, seen in list(kind._seen.items()):
            if seen.deleted_at is None and key not in self.listed and seen.version <= list_version:
                seen.deleted_at, seen.version = now, list_version
                meta = {"uid": key, "name": seen.name, "resourceVersion": str(list_version)}
                if seen.namespace:
                    meta["namespace"] = seen.namespace
                kind.handler("DELETED", {"metadata": meta})
                self.drift.deleted += 1
        held, self.held = self.held, []
        for key, obj in held:
            self._apply(key, obj)
        for key in [k for k, s in kind._seen.items() if s.deleted_at is not None and now - s.deleted_at > TOMBSTONE_S]:
            del kind._seen[key]
        return self.drift


class Informers:
    """The kinds a component watches, listed in order at start-up and again after a gap."""

    def __init__(self, api: KubeApi, kinds: list[WatchedKind], *, registry: CollectorRegistry | None = None,
                 component: str = "scheduler", consistency_check_s: float = 300.0) -> None:
        self.api = api
        self.kinds = {k.name: k for k in kinds}
        self.consistency_check_s = consistency_check_s
        self.page = LIST_PAGE
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
            listing, version, pages = kind.listing(), "", 0
            try:
                async for items, page_version in self.api.list_pages(kind.path, self.page):
                    if kind.on_listed is not None and not pages:
                        kind.on_listed()
                    pages += 1
                    version = page_version
                    listing.page(items)
            except ApiError as exc:
                if kind.on_error is not None and kind.on_error(exc):
                    continue
                raise
            drift = listing.end(int(version or 0))
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
