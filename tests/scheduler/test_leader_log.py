"""Acquiring the Lease is routine (every start of the scheduler) and logged at INFO; losing it stops the
replica's binds and stays a WARNING (issue 22, item 6: the demo showed "acquired leadership" as a WARNING)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from gpupool_sched.scheduler.leader import LeaderElector


class FakeApi:
    """A Lease store: the first read finds none (so the elector creates it), later reads what was written."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def read_lease_sync(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.lease

    def write_lease_sync(self, namespace: str, body: dict[str, Any], create: bool) -> None:
        self.lease = body


def test_acquiring_leadership_is_info_and_losing_it_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    api = FakeApi()
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration_s=3.0, renew_deadline_s=2.0,  # type: ignore[arg-type]
                            retry_period_s=0.01, clock=lambda: clock[0])

    async def scenario() -> None:
        task = asyncio.create_task(elector.run())
        await asyncio.sleep(0.05)
        assert elector.is_leader
        api.lease["spec"]["holderIdentity"] = "other"  # type: ignore[index]  # somebody else takes it
        api.lease["spec"]["renewTime"] = "later"  # type: ignore[index]
        clock[0] = 5.0  # past our renew deadline
        await asyncio.sleep(0.05)
        assert not elector.is_leader
        task.cancel()

    with caplog.at_level(logging.INFO, logger="gpupool_sched.scheduler.leader"):
        asyncio.run(scenario())
    records = [(r.levelname, r.getMessage()) for r in caplog.records if "leadership" in r.getMessage()]
    assert records[0] == ("INFO", "acquired leadership of lease ns/lease"), records
    assert ("WARNING", "lost leadership of lease ns/lease") in records, records
