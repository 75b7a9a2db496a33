"""The scheduler's write path (KubeApi.write and the calls built on it) against a real HTTP server on
127.0.0.1: method, path, content type, body, credentials, errors, and a burst queueing for its turn."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from gpupool_sched.kube.kubeapi import ApiError, KubeApi
from tests.support.ports import free_port
from tests.support.recording_server import RecordingServer, with_recording_server


def test_writes_carry_method_path_content_type_body_and_a_fresh_token() -> None:
    async def test(api: KubeApi, server: RecordingServer) -> None:
        await api.bind("team-a", "p-1", "uid-1", "node-7", {"gpupool.io/assignment": "{}"})
        await api.set_unschedulable("team-a", "p-1", "0/3 nodes are available")
        await api.evict("team-a", "p 2", "uid-2", 30)
        await api.patch_custom_status("scheduling.x-k8s.io", "v1alpha1", "podgroups", "team-a", "g",
                                      {"phase": "Running"})
        bind, status, evict, group = server.seen
        assert (bind["method"], bind["path"]) == ("POST", "/api/v1/namespaces/team-a/bindings")
        assert bind["body"]["target"] == {"apiVersion": "v1", "kind": "Node", "name": "node-7"}
        assert bind["body"]["metadata"]["uid"] == "uid-1"
        assert bind["headers"]["Content-Type"] == "application/json"
        assert (status["method"], status["path"]) == ("PATCH", "/api/v1/namespaces/team-a/pods/p-1/status")
        assert status["headers"]["Content-Type"] == "application/strategic-merge-patch+json"
        assert status["body"]["status"]["conditions"][0]["reason"] == "Unschedulable"
        assert evict["path"] == "/api/v1/namespaces/team-a/pods/p%202/eviction"
        assert evict["body"]["deleteOptions"] == {"preconditions": {"uid": "uid-2"}, "gracePeriodSeconds": 30}
        assert group["path"] == "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/team-a/podgroups/g/status"
        assert group["headers"]["Content-Type"] == "application/merge-patch+json"
        # the token is asked for per request (the refresh hook), so a rotated one is used at once
        assert [s["headers"]["Authorization"] for s in server.seen] == [f"Bearer token-{i}" for i in (1, 2, 3, 4)]

    asyncio.run(with_recording_server(test))


def test_a_refusal_becomes_an_api_error_with_the_servers_reason_and_message() -> None:
    async def test(api: KubeApi, server: RecordingServer) -> None:
        server.answers.append((409, {"kind": "Status", "reason": "Conflict",
                                     "message": 'pod p-1 is already assigned to node "n2"'}))
        with pytest.raises(ApiError) as err:
            await api.bind("team-a", "p-1", "uid-1", "node-7", {})
        assert (err.value.status, err.value.reason, err.value.kind) == (409, "Conflict", "conflict")
        assert "already assigned" in err.value.message
        server.answers.append((429, {"kind": "Status", "reason": "TooManyRequests", "message": "PDB"}))
        with pytest.raises(ApiError) as err:
            await api.evict("team-a", "p-1", "uid-1", None)
        assert (err.value.status, err.value.kind) == (429, "throttled")
        await api.bind("team-a", "p-3", "uid-3", "node-7", {})  # the connection pool still works

    asyncio.run(with_recording_server(test))


def test_no_server_is_an_api_error_with_status_0() -> None:
    async def test() -> None:
        cfg = client.Configuration(host=f"http://127.0.0.1:{free_port()}")
        api = KubeApi(client.ApiClient(cfg))
        try:
            with pytest.raises(ApiError) as err:
                await api.post_event({"namespace": "a", "name": "p", "uid": "u"}, kind="Normal",
                                     reason="Scheduled", message="m")
            assert (err.value.status, err.value.kind) == (0, "unreachable")
        finally:
            api.close()

    asyncio.run(test())


def test_a_burst_waits_for_its_turn_before_its_timeout_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of binds queue behind `--bind-workers` threads; a request's timeout counts from when it
    goes on the wire, or the tail of a burst would fail without ever having been sent."""
    monkeypatch.setattr("gpupool_sched.kube.kubeapi.REQUEST_TIMEOUT_S", 0.5)

    async def test(api: KubeApi, server: RecordingServer) -> None:
        server.delay_s = 0.2
        await asyncio.gather(*(api.bind("team-a", f"p-{i}", f"uid-{i}", "node-7", {}) for i in range(12)))
        assert len(server.seen) == 12  # 6 rounds of 0.2 s behind 2 connections: 1.2 s, over the 0.5 s limit
        assert server.most_on_wire == 2

    asyncio.run(with_recording_server(test, workers=2))


def test_reports_on_their_own_lane_do_not_wait_behind_binds() -> None:
    """Every main-lane thread is stuck in a Binding and more Bindings are queued behind them: an Event
    and a PodScheduled condition posted through the reports lane still go out, and the binds follow."""

    async def test(api: KubeApi, server: RecordingServer) -> None:
        server.hold = asyncio.Event()
        reports = api.lane(1)
        binds = [asyncio.ensure_future(api.bind("team-a", f"p-{i}", f"uid-{i}", "node-7", {})) for i in range(6)]
        try:  # on one lane these would wait for the held binds: a timeout, not a hang
            await asyncio.wait_for(reports.post_event(
                {"namespace": "team-a", "name": "q", "uid": "uid-q"}, kind="Warning", reason="FailedScheduling",
                message="0/3 nodes are available"), timeout=10)
            await asyncio.wait_for(reports.set_unschedulable("team-a", "q", "0/3 nodes are available"), timeout=10)
            assert [r["path"].rsplit("/", 1)[-1] for r in server.seen] == ["events", "status"]
            assert not any(b.done() for b in binds)
        finally:
            server.hold.set()
        await asyncio.gather(*binds)
        assert len(server.seen) == 8

    asyncio.run(with_recording_server(test, workers=2))


def test_a_surges_writes_carry_their_preconditions() -> None:
    """A Deployment's count through its scale subresource under a resourceVersion precondition; the
    deletion cost as a merge patch of the pod's annotations, with its UID (docs/defragmentation.md)."""
    async def test(api: KubeApi, server: RecordingServer) -> None:
        await api.scale_deployment("team-a", "serve", 9, "4711")
        await api.set_deletion_cost("team-a", "serve-x", "uid-9", -2147483648)
        scale, cost = server.seen
        assert (scale["method"], scale["path"]) == ("PATCH", "/apis/apps/v1/namespaces/team-a/deployments/serve/scale")
        assert scale["headers"]["Content-Type"] == "application/merge-patch+json"
        assert scale["body"] == {"metadata": {"resourceVersion": "4711"}, "spec": {"replicas": 9}}
        assert (cost["method"], cost["path"]) == ("PATCH", "/api/v1/namespaces/team-a/pods/serve-x")
        assert cost["headers"]["Content-Type"] == "application/merge-patch+json"
        assert cost["body"] == {"metadata": {"uid": "uid-9", "annotations": {
            "controller.kubernetes.io/pod-deletion-cost": "-2147483648"}}}

    asyncio.run(with_recording_server(test))
