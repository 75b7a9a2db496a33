"""A deposed leader writes nothing (issue 16 A3): every write of a replica elected through the Lease
waits at most its write window, is refused once the window has closed, and is cut off on the wire when
it closes. The window ends where another replica could take the lease (leader.write_window). The same
against the real control plane with a partitioned leader: tests/e2e/test_faults.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from gpupool_sched.scheduler.leader import FENCE_MARGIN_S, LeaderElector
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from tests.support.apiserver import PODS, ApiServer, serving, settle
from tests.support.objects import node_obj, pod_obj


def test_the_write_window_ends_before_a_standby_may_take_the_lease() -> None:
    async def test(server: ApiServer, api: KubeApi) -> None:
        now = [1000.0]
        elector = LeaderElector(api, "kube-system", "l", "me", lease_duration_s=15, renew_deadline_s=10,
                                retry_period_s=2, clock=lambda: now[0])
        assert elector.write_window() < 0  # not leading: no write at all
        await elector._try_acquire_or_renew()  # creates the lease: leader from 1000
        assert elector.is_leader
        now[0] = 1005.0
        assert elector.write_window() == pytest.approx(15 - FENCE_MARGIN_S - 5)
        server.partitioned = True  # renewals get no answer from now on
        now[0] = 1000.0 + 15 - FENCE_MARGIN_S
        assert elector.write_window() <= 0  # a standby may act from 1015 (its clock, after seeing the renewal)

    async def run() -> None:
        async with serving() as (server, api):
            await test(server, api)

    asyncio.run(run())


def test_no_write_reaches_the_server_after_the_window_closes() -> None:
    """One Binding on the wire (held by the server), three queued behind it (lane of one): at the window's
    end the first is cut off and the queued ones are refused unsent."""

    async def run() -> None:
        async with serving() as (server, api):
            deadline = time.monotonic() + 1.0
            api.fence.window = lambda: deadline - time.monotonic()
            api._lane.limit = 1
            server.hold = asyncio.Event()
            for i in range(4):
                server.put(PODS, pod_obj(f"p{i}"))
            results = await asyncio.gather(
                *(api.bind("ns", f"p{i}", f"uid-{i}", "n1", {}) for i in range(4)), return_exceptions=True)
            closed_at = time.monotonic()
            server.hold.set()
            await asyncio.sleep(0.3)
            reasons = sorted(r.reason for r in results if isinstance(r, ApiError))
            assert reasons == ["NotLeader", "NotLeader", "NotLeader", "TimeoutError"], results
            assert len(server.arrivals) == 1 and server.arrivals[0][0] < deadline
            assert closed_at - deadline < 0.5, "the write on the wire outlived the window"

    asyncio.run(run())


def test_a_deposed_leader_binds_nothing_after_its_window() -> None:
    """The service elected through the Lease; the API server then answers nothing (a partition of the
    leader): the Bindings it had decided wait, and none is sent once the window has closed."""

    async def run() -> None:
        async with serving() as (server, api):
            config = SchedulerConfig(leader_elect=True, lease_duration_s=3.0, renew_deadline_s=2.0,
                                     retry_period_s=0.5, identity="a")
            service = SchedulerService(config, api)
            service.on_node("ADDED", node_obj("n1"))
            await service.leader._try_acquire_or_renew()
            window = config.lease_duration_s - FENCE_MARGIN_S  # where a standby could take over, less the margin
            closes_at = time.monotonic() + window
            server.partitioned = True  # the leader's requests go nowhere from now on
            for i in range(3):
                service.on_pod("ADDED", server.put(PODS, pod_obj(f"p{i}", gpus=1)))
            await settle(service, rounds=3)
            await asyncio.sleep(window + 0.5)
            server.partitioned = False  # healed: whatever is still on the wire is delivered now
            await asyncio.sleep(0.3)
            late = [a for a in server.arrivals if a[0] > closes_at and "bindings" in a[2]]
            assert late == [], f"{len(late)} Binding(s) reached the server after the window closed"
            # none of the refused pods lost its place: unknown ones are read, unsent ones retried
            assert all(e.uncertain or e.phase.value != "assumed" for e in service.state.pods.values())

    asyncio.run(run())
