"""The `gpupool.io/migration` record (kube/migration_record.py): what a standby or the next leader reads
back is what the leader held, for every kind of GPU demand, and anything else is refused with a reason."""

from __future__ import annotations

import json

import pytest

from gpupool_sched.kube.migration_record import (
    MIGRATION_ANNOTATION,
    MigrationRecord,
    RecordedMove,
    decode,
    encode,
    record_of,
)
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import GpuShape, PodRequest


def _moves() -> tuple[RecordedMove, ...]:
    share = PodRequest.of_shapes("ns/a", [GpuShape(1, 0, 10240)], cpu_milli=500, memory_mib=1024,
                                 gpu_models=frozenset({"NVIDIA-L40S"}), priority=7, namespace="ns")
    mixed = PodRequest.of_shapes("ns/b", [GpuShape(2, 1000), GpuShape(mig_profile="1g.10gb", mig_count=1)],
                                 namespace="ns")
    return (
        RecordedMove("uid-a", "ns/a", "ReplicaSet/a-1", share,
                     Placement("n2", (3,), 0, 10240, score=0.5, breakdown={"fgd": 1.0})),
        RecordedMove("uid-b", "ns/b", "StatefulSet/b", mixed,
                     Placement("n3", (0, 1), 1000, 81920, extras=(Placement("n3", mig_devices=("MIG-1",)),))),
    )


def test_what_is_read_back_is_what_was_held() -> None:
    record = MigrationRecord("n1", 1764669450.5, 1764669600.25, _moves())
    back = decode(encode(record))
    assert back.node == "n1" and (back.at, back.until) == pytest.approx((1764669450.5, 1764669600.25))
    for before, after in zip(record.moves, back.moves, strict=True):
        assert (after.mover, after.mover_key, after.owner) == (before.mover, before.mover_key, before.owner)
        assert after.request.gpu_shapes() == before.request.gpu_shapes()
        assert (after.request.cpu_milli, after.request.memory_mib, after.request.gpu_models, after.request.priority,
                after.request.namespace) == (before.request.cpu_milli, before.request.memory_mib,
                                             before.request.gpu_models, before.request.priority, "ns")
        d, b = after.destination, before.destination
        assert [(p.node, p.gpu_indices, p.gpu_milli, p.gpu_memory_mib, p.mig_devices) for p in d.parts()] == \
            [(p.node, p.gpu_indices, p.gpu_milli, p.gpu_memory_mib, p.mig_devices) for p in b.parts()]


def test_a_pod_without_the_annotation_has_no_record() -> None:
    assert record_of({"metadata": {"annotations": {"other": "x"}}}) is None
    assert record_of({"metadata": {}}) is None
    pod = {"metadata": {"annotations": {MIGRATION_ANNOTATION: encode(MigrationRecord("n1", 0.5, 1.0, _moves()))}}}
    found = record_of(pod)
    assert found is not None and [m.mover for m in found.moves] == ["uid-a", "uid-b"]


@pytest.mark.parametrize("raw, why", [
    ("not json", "unreadable"),
    ("{}", "unreadable"),
    (json.dumps({"node": "", "at": 0, "until": 1, "moves": []}), "no node"),
    (json.dumps({"node": "n1", "at": 0, "until": "soon", "moves": []}), "unreadable"),
    (json.dumps({"node": "n1", "until": 1, "moves": []}), "unreadable"),
    (json.dumps({"node": "n1", "at": 0, "until": 1, "moves": [{"uid": "u"}]}), "unreadable"),
    # a shape no pod could ask for (a share of two GPUs)
    (json.dumps({"node": "n1", "at": 0, "until": 1, "moves": [{
        "uid": "u", "pod": "ns/p", "owner": "ReplicaSet/r",
        "request": {"shapes": [[2, 500, 0, None, 0]], "cpu": 0, "memory": 0, "models": [], "priority": 0},
        "to": {"node": "n2", "gpus": [0, 1], "milli": 500, "memoryMiB": 0, "mig": []}}]}), "unreadable"),
])
def test_anything_else_is_refused_with_a_reason(raw: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        decode(raw)
    assert MIGRATION_ANNOTATION in str(err.value)


def test_a_moved_mark_round_trips_and_anything_else_is_refused() -> None:
    from gpupool_sched.kube.migration_record import MOVED_ANNOTATION, MovedMark, decode_moved, encode_moved
    mark = MovedMark(1764669450.25, "uid-a", "uid-0", "ns/db-0", "StatefulSet/ns/db")
    assert decode_moved(encode_moved(mark)) == mark
    for raw in ("not json", "{}", json.dumps({"at": "soon", "mover": "m", "lineage": "l"}),
                json.dumps({"at": 1, "mover": "", "lineage": "l"}), "[]"):
        with pytest.raises(ValueError, match=MOVED_ANNOTATION):
            decode_moved(raw)


def test_a_surge_record_round_trips_and_anything_else_is_refused() -> None:
    from gpupool_sched.writer.surge_record import SURGE_RECORD, SurgeRecord
    record = SurgeRecord(8, "uid-a", "ns/t-1", "ReplicaSet/ns/t", "uid-big", 1764669450.5, 1764669750.5)
    assert SurgeRecord.decode(record.encode()) == record
    for raw in ("not json", "{}", json.dumps({**json.loads(record.encode()), "replicas": "eight"}), "[]"):
        with pytest.raises(ValueError, match=SURGE_RECORD):
            SurgeRecord.decode(raw)
