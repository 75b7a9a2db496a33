"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.

Only the leader binds; standbys keep watching so that their state is warm when they take over.
Expiry is judged on the local clock from when this process last saw the lease *change*, never from
the timestamps written by another host (clock skew). The leader stops binding as soon as it has not
renewed for `renew_deadline_s` (< `lease_duration_s`), so that a standby that takes over after
`lease_duration_s` never overlaps with it. The kubernetes package ships a thread-based elector
(`kubernetes.leaderelection`); this one runs on the scheduler's event loop and releases the lease on
a clean shutdown, which makes hand-overs on upgrades immediate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gpupool_sched.kube.kubeapi import ApiError, KubeApi, now_rfc3339

log = logging.getLogger(__name__)

FENCE_MARGIN_S = 1.0  # of a lease's duration, kept back for clock-rate drift and a write's last hop


class LeaderElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("need retry period < renew deadline < lease duration")
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.clock = clock
        self._renewed_at: float | None = None  # last successful acquire/renew (local clock)
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self.holder: str | None = None
        self.changed = asyncio.Event()  # set on every change of `is_leader`
        self.transitions = 0

    @property
    def is_leader(self) -> bool:
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline_s

    def write_window(self) -> float:
        """Seconds for which a write of this process may still reach the API server (<= 0: none).

        A standby takes the lease only after `leaseDurationSeconds` on its own clock without seeing it
        change, counted from when it read this leader's last renewal. That renewal was sent after
        `_renewed_at`, so no other replica acts before `_renewed_at + lease_duration_s` here (equal
        clock rates; FENCE_MARGIN_S covers drift and the last hop). Writes stop there: none queued
        beyond it is sent, and one on the wire is cut off (kubeapi.write, apiwriter.Lane)."""
        if self._renewed_at is None:
            return float("-inf")
        return self._renewed_at + self.lease_duration_s - FENCE_MARGIN_S - self.clock()

    async def run(self) -> None:
        was = False
        while True:
            try:
                await self._try_acquire_or_renew()
            except ApiError as exc:
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            now = self.is_leader
            if now != was:
                self.transitions += 1
                # acquiring is routine (every start); losing it stops this replica's binds: worth a warning
                log.log(logging.INFO if now else logging.WARNING, "%s leadership of lease %s/%s",
                        "acquired" if now else "lost", self.namespace, self.name)
                self.changed.set()
                self.changed = asyncio.Event()
                was = now
            await asyncio.sleep(self.retry_period_s)

    async def _try_acquire_or_renew(self) -> None:
        lease = await self.api.call(self.api.read_lease_sync, self.namespace, self.name)
        now = self.clock()
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0)}
            await self.api.call(self.api.write_lease_sync, self.namespace, body, True)
            self._renewed_at = now
            self.holder = self.identity
            return
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = holder or None
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        mine = holder == self.identity
        if not mine and holder and now - self._observed_at < duration:
            self._renewed_at = None  # somebody else leads and is renewing
            return
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        new_spec = self._spec(transitions)
        if mine and spec.get("acquireTime"):
            new_spec["acquireTime"] = spec["acquireTime"]
        lease["spec"] = new_spec
        try:
            await self.api.call(self.api.write_lease_sync, self.namespace, lease, False)
        except ApiError as exc:
            if exc.status == 409:  # somebody else wrote it first
                self._renewed_at = None
                return
            raise
        self._renewed_at = now
        self.holder = self.identity

    def _spec(self, transitions: int) -> dict[str, Any]:
        stamp = now_rfc3339(micro=True)
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration_s),
                "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": transitions}

    async def release(self) -> None:
        """Give the lease up (clean shutdown): a standby takes over at its next retry."""
        if not self.is_leader:
            return
        self._renewed_at = None
        try:
            lease = await self.api.call(self.api.read_lease_sync, self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                await self.api.call(self.api.write_lease_sync, self.namespace, lease, False)
        except ApiError as exc:
            log.warning("releasing lease %s/%s: %s", self.namespace, self.name, exc)


class AlwaysLeader:
    """Without --leader-elect the one scheduler is always the leader (its writes are never fenced)."""

    is_leader = True
    holder = None
    transitions = 0

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    async def run(self) -> None:
        return None

    async def release(self) -> None:
        return None
