"""The scheduler process's garbage-collector settings and the pause metric they are judged by."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry

from gpupool_sched.cache import gcpolicy
from gpupool_sched.metrics import SchedulerMetrics


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_tune_raises_the_young_threshold(restore_gc: None) -> None:
    gcpolicy.tune()
    assert gc.get_threshold() == (gcpolicy.YOUNG_THRESHOLD, gcpolicy.MIDDLE_THRESHOLD, gcpolicy.OLD_THRESHOLD)
    assert gcpolicy.YOUNG_THRESHOLD > 700  # CPython's default, which the benchmark found too eager


def test_freeze_keeps_startup_objects_out_of_later_passes(restore_gc: None) -> None:
    built_at_start = [{"node": i} for i in range(1000)]
    gcpolicy.freeze_startup()
    assert gc.get_freeze_count() >= len(built_at_start)
    assert not any(o is built_at_start for o in gc.get_objects())  # in no generation a pass walks
    assert built_at_start[999] == {"node": 999}  # still alive and usable
    # cycles made after the freeze are still collected
    class Node:
        other: object = None
    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    assert gc.collect() >= 2


def test_pauses_are_counted_by_generation() -> None:
    metrics = SchedulerMetrics(CollectorRegistry())
    pauses = gcpolicy.GcPauses(lambda g, s: metrics.gc_seconds.labels(generation=str(g)).inc(s))
    pauses.install()
    pauses.install()  # once only
    try:
        assert gc.callbacks.count(pauses) == 1
        before = metrics.registry.get_sample_value("gpupool_scheduler_gc_pause_seconds_total", {"generation": "2"})
        junk = [[i] for i in range(200_000)]  # a full pass has something to walk
        gc.collect(2)
        del junk
        after = metrics.registry.get_sample_value("gpupool_scheduler_gc_pause_seconds_total", {"generation": "2"})
        assert before == 0.0
        assert after is not None and after > 0.0
    finally:
        pauses.remove()
    assert pauses not in gc.callbacks
