"""The kopf wiring: what kopf would do with our handlers, checked on the registry itself."""

from __future__ import annotations

import asyncio
import inspect

import kopf
import pytest
from kubernetes import client

from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.kube.kubeapi import KubeApi
from gpupool_sched.kube.watch import NoDiffBase, build_registry
from gpupool_sched.scheduler.elastic import ElasticConfig
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from gpupool_sched.writer.recorder import EventRecorder


@pytest.fixture
def service() -> SchedulerService:
    return SchedulerService(SchedulerConfig(), KubeApi(client.ApiClient(client.Configuration())))


def test_watch_handlers_are_coroutines(service: SchedulerService) -> None:
    """kopf runs plain-function handlers on its thread pool; the state, the queue and the binder's
    asyncio gates must only ever be touched from the event loop's thread."""
    registry = build_registry(service)
    handlers = list(registry._watching.get_all_handlers())
    assert {h.selector.any_name for h in handlers if h.selector is not None} == {
        "pods", "nodes", "priorityclasses", "poddisruptionbudgets", "podgroups", "gpuquotas", "namespaces", "jobs",
        "deployments", "horizontalpodautoscalers"}
    for h in handlers:
        assert inspect.iscoroutinefunction(h.fn), f"{h.id} would run on kopf's thread pool"
    assert not list(registry._changing.get_all_handlers()), "on.create/update/delete store state on objects"
    assert not list(registry._spawning.get_all_handlers()), "daemons and timers store state on objects"


def test_jobs_are_watched_only_while_defragmentation_is_on() -> None:
    """Only the consolidate action reads Jobs (whether their pods may move): with `--defrag off` the
    scheduler neither lists nor watches them (and the chart grants nothing on them)."""
    off = SchedulerService(SchedulerConfig(defrag=DefragConfig(enabled=False)),
                           KubeApi(client.ApiClient(client.Configuration())))
    assert "jobs" not in off.informers.kinds
    handlers = list(build_registry(off)._watching.get_all_handlers())
    assert "jobs" not in {h.selector.any_name for h in handlers if h.selector is not None}


def test_deployments_and_hpas_are_watched_only_while_elastic_inference_is_on() -> None:
    """Only elastic inference reads Deployments and HPAs: with `--elastic off` the scheduler neither lists
    nor watches them (and the chart grants nothing more on them)."""
    off = SchedulerService(SchedulerConfig(elastic=ElasticConfig(enabled=False)),
                           KubeApi(client.ApiClient(client.Configuration())))
    assert not {"deployments", "horizontalpodautoscalers"} & set(off.informers.kinds)


def test_startup_drops_kopfs_diff_base(service: SchedulerService) -> None:
    """on.event needs no diff: the startup activity replaces the storage that deep-copies each object."""
    registry = build_registry(service)
    settings = kopf.OperatorSettings()
    (startup,) = [h for h in registry._activities.get_all_handlers() if h.activity == "startup"]

    async def started() -> None:
        async def no_start() -> None:
            return None

        service.start = no_start  # type: ignore[method-assign]
        await startup.fn(settings=settings)

    asyncio.run(started())
    assert isinstance(settings.persistence.diffbase_storage, NoDiffBase)
    assert settings.persistence.diffbase_storage.build(body=kopf.Body({"metadata": {}})) is None
    assert settings.posting.enabled is False and settings.peering.standalone is True


def test_event_queue_is_bounded_and_drops_are_counted(service: SchedulerService) -> None:
    """A burst of reports beyond the queue's room is dropped and counted, never held in memory."""
    recorder = EventRecorder(service.api, service.metrics, workers=1, capacity=3)

    async def burst() -> None:
        for i in range(10):  # no worker started: nothing drains the queue
            recorder.scheduled("ns", f"p{i}", f"uid-{i}", "n1")

    asyncio.run(burst())
    assert recorder.queued == 3
    dropped = service.metrics.registry.get_sample_value(
        "gpupool_scheduler_events_posted_total", {"reason": "Scheduled", "outcome": "dropped"})
    assert dropped == 7


def test_reports_post_on_a_lane_apart_from_the_binds(service: SchedulerService) -> None:
    """The recorder's writes go through a lane of their own (its own limit), so that a burst of
    queued Bindings cannot hold every Event back (tests/scheduler/test_kubeapi_writes.py shows why)."""
    reports = service.recorder.api
    assert reports is not service.api and reports.api_client is service.api.api_client
    assert reports._lane is not service.api._lane and reports._writer is service.api._writer
    assert reports._lane.limit == service.config.event_workers
    assert service.binder.api is service.api


def test_kopf_retries_the_api_for_ever_and_at_most_2s_apart() -> None:
    """kopf's default backoffs give up after 54 s (a watch then ends for good) and wait up to 8 s after the
    API server is back; ours never give up and wait at most 2 s, afresh for every request."""
    import collections.abc
    import itertools

    settings = kopf.OperatorSettings()
    assert isinstance(settings.networking.error_backoffs, collections.abc.Sized)  # kopf's: a limit
    from gpupool_sched.kube.watch import configure

    configure(settings)
    backoffs = settings.networking.error_backoffs
    assert not isinstance(backoffs, collections.abc.Sized)  # kopf counts no limit
    assert isinstance(backoffs, collections.abc.Iterable)
    first = list(itertools.islice(iter(backoffs), 100))
    assert len(first) == 100 and max(first) == 2.0 and first[0] == 0.5
    assert list(itertools.islice(iter(backoffs), 3)) == first[:3]  # anew for each request
