"""The pure rules of elastic inference (framework/plugins/elastic.py)."""

from __future__ import annotations

import pytest

from gpupool_sched.framework.plugins.elastic import (
    DEFAULT_NO_FLAP_S,
    FlapGuard,
    InvalidElastic,
    QueueLength,
    Replica,
    deployment_of,
    give_back_order,
    inflight,
    parse_elastic,
    tiers,
)


def test_annotations_make_the_spec_and_a_plain_deployment_is_not_elastic():
    assert parse_elastic({}) is None
    assert parse_elastic({"other": "x"}) is None
    spec = parse_elastic({"gpupool.io/elastic-min": "2", "gpupool.io/elastic-max": "6"})
    assert spec is not None and (spec.minimum, spec.maximum) == (2, 6)
    assert spec.wants({}, 3) == 6  # always: as many as max allows


@pytest.mark.parametrize("annotations, says", [
    ({"gpupool.io/elastic-min": "2"}, "both needed"),
    ({"gpupool.io/elastic-min": "two", "gpupool.io/elastic-max": "6"}, "not a whole number"),
    ({"gpupool.io/elastic-min": "-1", "gpupool.io/elastic-max": "6"}, "below 0"),
    ({"gpupool.io/elastic-min": "4", "gpupool.io/elastic-max": "2"}, "below gpupool.io/elastic-min"),
    ({"gpupool.io/elastic-min": "1", "gpupool.io/elastic-max": "2", "gpupool.io/elastic-demand": "vibes"},
     "none of always, queue-length"),
    ({"gpupool.io/elastic-min": "1", "gpupool.io/elastic-max": "2", "gpupool.io/elastic-demand": "queue-length"},
     "needs gpupool.io/elastic-target-per-replica"),
])
def test_bad_annotations_are_refused_with_a_message_naming_the_annotation(annotations, says):
    with pytest.raises(InvalidElastic, match=says):
        parse_elastic(annotations)


def test_queue_length_asks_for_ceil_queue_over_target_within_min_and_max():
    base = {"gpupool.io/elastic-min": "2", "gpupool.io/elastic-max": "6",
            "gpupool.io/elastic-demand": "queue-length", "gpupool.io/elastic-target-per-replica": "10"}
    spec = parse_elastic(base)
    assert spec is not None and spec.demand == QueueLength(10)
    assert spec.wants({**base, "gpupool.io/elastic-queue-length": "31"}, 2) == 4
    assert spec.wants({**base, "gpupool.io/elastic-queue-length": "0"}, 4) == 2  # never below min
    assert spec.wants({**base, "gpupool.io/elastic-queue-length": "1000"}, 4) == 6  # never above max
    assert spec.wants(base, 3) == 3  # no signal yet: no more than now
    assert spec.wants({**base, "gpupool.io/elastic-queue-length": "lots"}, 3) == 3


def test_the_deployment_of_a_pod_is_read_from_its_replica_set_and_template_hash():
    assert deployment_of("ReplicaSet/serve/llm-5d9f7c", {"pod-template-hash": "5d9f7c"}) == "serve/llm"
    assert deployment_of("ReplicaSet/serve/llm-5d9f7c", {}) is None  # a bare ReplicaSet
    assert deployment_of("ReplicaSet/serve/other", {"pod-template-hash": "5d9f7c"}) is None
    assert deployment_of("Job/serve/llm-5d9f7c", {"pod-template-hash": "5d9f7c"}) is None
    assert deployment_of("", {}) is None


def test_the_oldest_min_replicas_are_guaranteed_and_the_rest_borrowed():
    pods = [Replica("c", 30.0), Replica("a", 10.0), Replica("d", 40.0), Replica("b", 20.0)]
    guaranteed, borrowed = tiers(pods, 2)
    assert [r.uid for r in guaranteed] == ["a", "b"]
    assert [r.uid for r in borrowed] == ["c", "d"]
    assert tiers(pods, 6) == (sorted(pods, key=lambda r: r.started), [])  # under min: nothing borrowed


def test_give_back_order_is_fewest_in_flight_then_youngest():
    borrowed = [Replica("old-idle", 10.0, 0), Replica("young-busy", 40.0, 5), Replica("young-idle", 30.0, 0),
                Replica("mid-one", 20.0, 1)]
    assert [r.uid for r in give_back_order(borrowed)] == ["young-idle", "old-idle", "mid-one", "young-busy"]


def test_give_back_never_reaches_below_min_since_only_borrowed_replicas_are_candidates():
    pods = [Replica(str(i), float(i), inflight=0) for i in range(6)]
    _, borrowed = tiers(pods, 2)
    assert len(give_back_order(borrowed)) == 4  # at most 6 - 2 go, the two oldest stay


def test_inflight_reads_the_pod_annotation():
    assert inflight({"gpupool.io/inflight": "7"}) == 7
    assert inflight({"gpupool.io/inflight": "x"}) == 0
    assert inflight({"gpupool.io/inflight": "-3"}) == 0
    assert inflight(None) == 0


def test_no_flap_window_defaults_to_five_minutes():
    guard = FlapGuard()
    assert guard.window_s == DEFAULT_NO_FLAP_S == 300.0
    assert guard.may_grow("serve/llm", 0.0)
    guard.gave_back("serve/llm", 1000.0)
    assert not guard.may_grow("serve/llm", 1000.0 + 299.9)
    assert guard.may_grow("serve/llm", 1000.0 + 300.0)
    assert guard.may_grow("serve/other", 1000.0)
    assert guard.until("serve/llm") == 1300.0
