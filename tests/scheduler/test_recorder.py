"""The recorder's writes against a real HTTP server on 127.0.0.1: a failure reported again joins its
earlier Event (a count, not a new Event per try), and an unchanged condition is not written again."""

from __future__ import annotations

import asyncio
from typing import Any

from gpupool_sched.kube.kubeapi import KubeApi
from gpupool_sched.metrics import SchedulerMetrics
from gpupool_sched.writer.recorder import EventRecorder, says_unschedulable
from tests.support.recording_server import RecordingServer, with_recording_server

MESSAGE = "0/3 nodes are available: 3 no single GPU with 48 free memory units."


def _run(test: Any, workers: int = 1, **recorder_args: Any) -> None:
    async def body(api: KubeApi, server: RecordingServer) -> None:
        metrics = SchedulerMetrics()
        recorder = EventRecorder(api, metrics, workers=workers, **recorder_args)
        recorder.start()
        try:
            await test(recorder, server, metrics)
        finally:
            await recorder.stop()

    asyncio.run(with_recording_server(body))


async def _drain(recorder: EventRecorder) -> None:
    await asyncio.wait_for(recorder.flush(), timeout=10)


def _outcome(metrics: SchedulerMetrics, outcome: str, reason: str = "FailedScheduling") -> float:
    return metrics.registry.get_sample_value("gpupool_scheduler_events_posted_total",
                                             {"reason": reason, "outcome": outcome}) or 0.0


def _kinds(server: RecordingServer) -> list[tuple[str, str]]:
    return [(r["method"], r["path"].split("/")[-2] if r["method"] == "PATCH" and "/events/" in r["path"]
             else r["path"].rsplit("/", 1)[-1]) for r in server.seen]


def test_a_failure_reported_again_updates_the_count_of_its_event() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE)
        await _drain(recorder)
        post, condition = server.seen
        assert (post["method"], post["path"]) == ("POST", "/api/v1/namespaces/team-a/events")
        name = post["body"]["metadata"]["name"]
        assert name.startswith("p.") and post["body"]["count"] == 1
        assert condition["path"].endswith("/pods/p/status")
        for _ in range(3):  # tried again at once: the condition already says it, the Event is fresh
            recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await _drain(recorder)
        assert len(server.seen) == 2
        assert _outcome(metrics, "aggregated") == 3
        await asyncio.sleep(0.3)  # past series_refresh_s: the next one writes the count
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await _drain(recorder)
        update = server.seen[2]
        assert (update["method"], update["path"]) == ("PATCH", f"/api/v1/namespaces/team-a/events/{name}")
        assert update["headers"]["Content-Type"] == "application/merge-patch+json"
        assert update["body"]["count"] == 5 and update["body"]["lastTimestamp"]
        assert (_outcome(metrics, "posted"), _outcome(metrics, "updated")) == (1, 1)

    _run(test, series_refresh_s=0.25)


def test_a_new_message_or_another_pod_is_a_new_event() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        recorder.unschedulable("team-a", "p", "uid-p", "0/4 nodes are available: 4 Insufficient cpu.",
                               condition=False)
        recorder.unschedulable("team-a", "q", "uid-q", MESSAGE, condition=False)
        await _drain(recorder)
        assert _kinds(server) == [("POST", "events")] * 3
        assert len({r["body"]["metadata"]["name"] for r in server.seen}) == 3

    _run(test)


def test_a_changed_condition_is_written_even_when_the_event_joins_its_series() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE)
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE)  # e.g. someone else reset the condition
        await _drain(recorder)
        assert _kinds(server) == [("POST", "events"), ("PATCH", "status"), ("PATCH", "status")]

    _run(test)


def test_after_the_window_the_same_failure_is_a_new_event() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await asyncio.sleep(0.3)
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await _drain(recorder)
        assert _kinds(server) == [("POST", "events"), ("POST", "events")]

    _run(test, series_window_s=0.25, series_refresh_s=0.0)


def test_an_expired_event_starts_a_new_series() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await _drain(recorder)
        server.answers.append((404, {"kind": "Status", "reason": "NotFound", "message": "events not found"}))
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)  # its update: 404
        await _drain(recorder)
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE, condition=False)
        await _drain(recorder)
        assert _kinds(server) == [("POST", "events"), ("PATCH", "events"), ("POST", "events")]

    _run(test, series_refresh_s=0.0)


def test_normal_events_are_never_joined() -> None:
    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        recorder.scheduled("team-a", "p", "uid-p", "n1")
        recorder.scheduled("team-a", "p", "uid-p", "n1")
        await _drain(recorder)
        assert _kinds(server) == [("POST", "events"), ("POST", "events")]
        assert all(r["body"]["metadata"]["generateName"] == "p." for r in server.seen)

    _run(test)


def test_one_pods_reports_are_written_in_the_order_they_were_made() -> None:
    """Sixteen workers write reports at once, but a pod's second condition never lands before its
    first: the first one's Event is slow to post here, and the second must still win."""

    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        handle = server.handle

        async def slow_first(request: Any) -> Any:
            if "first" in (await request.text()):
                await asyncio.sleep(0.3)
            return await handle(request)

        server.handle = slow_first  # type: ignore[method-assign]
        recorder.unschedulable("team-a", "p", "uid-p", "first: 0/3 nodes are available")
        recorder.unschedulable("team-a", "p", "uid-p", "second: 0/4 nodes are available")
        await _drain(recorder)
        conditions = [r["body"]["status"]["conditions"][0]["message"] for r in server.seen if "status" in r["body"]]
        assert [m.split(":")[0] for m in conditions] == ["first", "second"]

    _run(test, workers=16)


def test_says_unschedulable_compares_status_reason_and_the_stored_message() -> None:
    def pod(**condition: str) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": "Initialized", "status": "True"},
                                          {"type": "PodScheduled", **condition}]}}

    assert says_unschedulable(pod(status="False", reason="Unschedulable", message=MESSAGE), MESSAGE)
    assert not says_unschedulable(pod(status="False", reason="Unschedulable", message="older"), MESSAGE)
    assert not says_unschedulable(pod(status="True"), MESSAGE)
    assert not says_unschedulable({"status": {}}, MESSAGE)
    long = "x" * 3000  # the API server keeps what was written: the first 1,024 characters
    assert says_unschedulable(pod(status="False", reason="Unschedulable", message=long[:1024]), long)


def test_a_report_that_got_no_answer_is_tried_again_until_it_lands() -> None:
    """The API server restarting: the Event and the condition get 503s, then land on a later try
    (before, a pod reported unschedulable during an outage was never told)."""

    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        unavailable = (503, {"kind": "Status", "reason": "ServiceUnavailable", "message": "restarting"})
        server.answers.extend([unavailable, unavailable, unavailable])  # Event, condition, then the Event again
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if _outcome(metrics, "posted") == 1 and len(server.seen) >= 5:
                break
        await _drain(recorder)
        paths = [r["path"].rsplit("/", 1)[-1] for r in server.seen]
        assert paths == ["events", "status", "events", "status", "events"], paths
        assert _outcome(metrics, "retried") == 2 and _outcome(metrics, "posted") == 1

    _run(test, retry_s=0.1)


def test_a_condition_is_not_written_again_once_the_pod_no_longer_waits() -> None:
    waiting = {"uid-p": True}

    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        unavailable = (503, {"kind": "Status", "reason": "ServiceUnavailable", "message": "restarting"})
        server.answers.extend([(201, {}), unavailable])  # the Event lands, the condition does not
        recorder.unschedulable("team-a", "p", "uid-p", MESSAGE)
        await _drain(recorder)
        waiting["uid-p"] = False  # bound meanwhile: PodScheduled=False must not overwrite it
        await asyncio.sleep(0.4)
        await _drain(recorder)
        assert [r["path"].rsplit("/", 1)[-1] for r in server.seen] == ["events", "status"]

    _run(test, retry_s=0.1, waiting=lambda uid: waiting.get(uid, False))


def _flood(keep_scheduled: bool) -> tuple[int, float]:
    """60 Scheduled reports at once into a recorder with room for 4: (Events posted, counted as dropped)."""
    out: list[tuple[int, float]] = []

    async def test(recorder: EventRecorder, server: RecordingServer, metrics: SchedulerMetrics) -> None:
        for i in range(60):
            recorder.scheduled("team-a", f"p{i}", f"uid-{i}", "n1")
        recorder.unschedulable("team-a", "late", "uid-late", MESSAGE)  # with the backlog: room kept for it
        await _drain(recorder)
        posts = [r for r in server.seen if r["method"] == "POST" and r["body"].get("reason") == "Scheduled"]
        assert len({r["body"]["involvedObject"]["name"] for r in posts}) == len(posts)  # each once
        if keep_scheduled:
            assert any(r["body"].get("reason") == "FailedScheduling" for r in server.seen)
        out.append((len(posts), _outcome(metrics, "dropped", "Scheduled")))

    _run(test, workers=2, capacity=4, keep_scheduled=keep_scheduled)
    return out[0]


def test_with_keep_scheduled_every_bound_pod_gets_its_scheduled_event() -> None:
    posted, dropped = _flood(keep_scheduled=True)
    assert (posted, dropped) == (60, 0)
    best_effort_posted, best_effort_dropped = _flood(keep_scheduled=False)  # the default drops and counts
    assert best_effort_dropped > 0 and best_effort_posted + best_effort_dropped == 60
