"""The sync of a component's caches (the scheduler's, the extender's) from start to stop: the start-up
LIST, the readiness that waits for it, and the end of the loops that keep the caches in step.

Before its first decision a component rebuilds its state from a LIST of every kind it watches, in
the informers' order (classes, budgets, groups and quotas before the pods that name them; nodes
before their pods), so that a restarted process never hands out a device twice. Until that is done
/readyz answers 503."""

from __future__ import annotations

import asyncio
import logging

from gpupool_sched.cache import gcpolicy
from gpupool_sched.kube.informer import Informers
from gpupool_sched.kube.kubeapi import ApiError

log = logging.getLogger(__name__)

NOT_SYNCED = "caches not synced"


async def initial_sync(informers: Informers, *, attempts: int = 1, freeze_gc: bool = False) -> None:
    """LIST every watched kind into the state; a failed LIST is tried again, 1 s, 2 s, 4 s ... later, up
    to `attempts` in all. `freeze_gc`: the process's own, gc.freeze() after it (cache/gcpolicy.py)."""
    for attempt in range(attempts):
        try:
            await informers.list_all(initial=True)
            break
        except ApiError as exc:
            if attempt == attempts - 1:
                raise
            log.warning("listing the cluster failed (%s); retrying", exc)
            await asyncio.sleep(2**attempt)
    if freeze_gc:
        gcpolicy.freeze_startup()  # the first LIST and start-up's objects: out of every later GC pass


def caches_ready(synced: asyncio.Event, detail: str) -> tuple[bool, str]:
    """/readyz's answer: not ready until `synced` is set (the start-up sync is done), then `detail`."""
    if not synced.is_set():
        return False, NOT_SYNCED
    return True, detail


async def stop_syncing(informers: Informers, loops: list[asyncio.Task[None]]) -> None:
    """Cancel the component's loops (its housekeeping, the informers' consistency check, ...) and wait
    for them to end, then stop the informers' re-list."""
    for task in loops:
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    await informers.stop()
