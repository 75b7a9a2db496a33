"""The handshake's plugin side (AdmissionBook): which container a kubelet request belongs to, and the
whole/shared state. Pure logic fed with pod JSON; the process-level tests drive it over gRPC."""

from __future__ import annotations

import json

import pytest

from gpupool_common.handshake import (
    ACK_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    Assignment,
    ContainerAssignment,
    HandshakeError,
    MemoryShare,
    ack_annotations,
    is_acknowledged,
    parse_assignment,
    shapes_conflict,
)
from gpupool_deviceplugin.admission import AdmissionBook, AdmissionError, KubeletPod, Refusal
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.pods import pod_record
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_deviceplugin.resources import build_resources, memory_unit_id
from tests.support.objects import assignment, pod_json

NODE = "node-a"
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
INV = node_publication_for_profile("l40s-pcie", node_name=NODE).inventory
UUIDS = [g.uuid for g in INV.gpus]
RESOURCES = build_resources(INV, PluginConfig(), memory_units=True)
NAMES = [r.name for r in RESOURCES]


def units(gpu: int, *ks: int) -> list[str]:
    return [memory_unit_id(UUIDS[gpu], k) for k in ks]


def all_units(gpu: int) -> list[str]:
    return units(gpu, *range(INV.gpus[gpu].memory_mib // 1024))


@pytest.fixture
def book() -> AdmissionBook:
    b = AdmissionBook(NODE, RESOURCES, 1024)
    b.replace_all([])
    return b


def add(book: AdmissionBook, obj: dict) -> None:
    book.upsert(pod_record(obj, NAMES, NODE))


def test_whole_gpu_assignment_wins_over_topology_and_is_acknowledged(book: AdmissionBook) -> None:
    ann = assignment(NODE, "u1", {"main": {"devices": {GPU: [UUIDS[1], UUIDS[3]]}}})
    add(book, pod_json("p1", "u1", NODE, {"main": {GPU: 2}}, annotations=ann))
    claim = book.preferred(GPU, UUIDS, [], 2)
    assert claim is not None and list(claim.ids) == [UUIDS[1], UUIDS[3]] and claim.pod.name == "p1"
    got = book.claim(GPU, [UUIDS[3], UUIDS[1]])
    assert (got.via, got.container) == ("assignment", "main")
    ack = book.commit(got)
    assert ack.complete and ack.containers == {"main": {GPU: (UUIDS[3], UUIDS[1])}}
    assert book.tenancy().whole == {UUIDS[1]: ("ns/p1",), UUIDS[3]: ("ns/p1",)}


def test_assignment_only_matches_when_its_devices_are_available(book: AdmissionBook) -> None:
    ann = assignment(NODE, "u1", {"main": {"devices": {GPU: [UUIDS[0]]}}})
    add(book, pod_json("p1", "u1", NODE, {"main": {GPU: 1}}, annotations=ann))
    assert book.preferred(GPU, UUIDS[1:], [], 1) is None  # kubelet says GPU 0 is not available
    assert book.preferred(GPU, UUIDS, [], 2) is None  # another shape


def test_multi_container_pod_gets_each_container_its_own_gpu(book: AdmissionBook) -> None:
    ann = assignment(NODE, "u1", {"a": {"memory": (UUIDS[2], 4, 1024)}, "b": {"memory": (UUIDS[0], 4, 1024)},
                                  "c": {"memory": (UUIDS[2], 8, 1024)}})
    add(book, pod_json("p1", "u1", NODE, {"a": {MEM: 4}, "b": {MEM: 4}, "c": {MEM: 8}}, annotations=ann))
    available = [u for g in range(4) for u in all_units(g)]
    first = book.preferred(MEM, available, [], 4)
    assert first.container == "a" and list(first.ids) == units(2, 0, 1, 2, 3)
    book.commit(book.claim(MEM, first.ids))
    available = [u for u in available if u not in first.ids]
    second = book.preferred(MEM, available, [], 4)
    assert second.container == "b" and list(second.ids) == units(0, 0, 1, 2, 3)
    book.commit(book.claim(MEM, second.ids))
    third = book.preferred(MEM, [u for u in available if u not in second.ids], [], 8)
    assert third.container == "c" and list(third.ids) == units(2, *range(4, 12))
    ack = book.commit(book.claim(MEM, third.ids))
    assert ack.complete and set(ack.containers) == {"a", "b", "c"}
    assert book.tenancy().shared == {UUIDS[0]: ("ns/p1",), UUIDS[2]: ("ns/p1",)}


def test_pods_admitted_together_resolve_by_shape_and_age(book: AdmissionBook) -> None:
    old = assignment(NODE, "u-old", {"m": {"memory": (UUIDS[1], 2, 1024)}})
    new = assignment(NODE, "u-new", {"m": {"memory": (UUIDS[3], 2, 1024)}})
    other = assignment(NODE, "u-other", {"m": {"memory": (UUIDS[0], 6, 1024)}})
    add(book, pod_json("new", "u-new", NODE, {"m": {MEM: 2}}, annotations=new, created="2026-01-01T00:00:02Z"))
    add(book, pod_json("old", "u-old", NODE, {"m": {MEM: 2}}, annotations=old, created="2026-01-01T00:00:01Z"))
    add(book, pod_json("other", "u-other", NODE, {"m": {MEM: 6}}, annotations=other))
    available = [u for g in range(4) for u in all_units(g)]
    # different shapes never mix: the 6-unit request is the 6-unit pod's, whatever the age
    assert book.preferred(MEM, available, [], 6).pod.name == "other"
    # same shape: the kubelet admits the oldest first; the overlap is reported
    claim = book.preferred(MEM, available, [], 2)
    assert claim.pod.name == "old" and claim.ambiguous_with == ("ns/new",)
    # Allocate itself is exact: units of GPU 3 can only be the new pod's
    got = book.claim(MEM, units(3, 7, 9))
    assert got.pod.name == "new" and got.ambiguous_with == ()


def test_a_pod_in_progress_goes_before_an_older_one(book: AdmissionBook) -> None:
    a = assignment(NODE, "ua", {"x": {"devices": {GPU: [UUIDS[0]]}}, "y": {"devices": {GPU: [UUIDS[1]]}}})
    b = assignment(NODE, "ub", {"x": {"devices": {GPU: [UUIDS[2]]}}})
    add(book, pod_json("b", "ub", NODE, {"x": {GPU: 1}}, annotations=b, created="2026-01-01T00:00:00Z"))
    add(book, pod_json("a", "ua", NODE, {"x": {GPU: 1}, "y": {GPU: 1}}, annotations=a,
                       created="2026-01-01T00:00:05Z"))
    book.commit(book.claim(GPU, [UUIDS[0]]))  # the kubelet started on pod a
    assert list(book.preferred(GPU, UUIDS[1:], [], 1).ids) == [UUIDS[1]]


def test_init_container_devices_are_reused(book: AdmissionBook) -> None:
    ann = assignment(NODE, "u1", {"init": {"devices": {GPU: [UUIDS[2]]}},
                                  "main": {"devices": {GPU: [UUIDS[2], UUIDS[3]]}}})
    add(book, pod_json("p", "u1", NODE, {"main": {GPU: 2}}, init={"init": {GPU: 1}}, annotations=ann))
    first = book.preferred(GPU, UUIDS, [], 1)
    assert first.container == "init" and list(first.ids) == [UUIDS[2]]
    book.commit(book.claim(GPU, first.ids))
    # kubelet: reuse the init container's GPU (must_include), ask for the rest
    second = book.preferred(GPU, [UUIDS[0], UUIDS[1], UUIDS[3]], [UUIDS[2]], 2)
    assert second.container == "main" and set(second.ids) == {UUIDS[2], UUIDS[3]}
    assert book.commit(book.claim(GPU, [UUIDS[2], UUIDS[3]])).complete


def test_refusals_are_clear(book: AdmissionBook) -> None:
    whole = assignment(NODE, "uw", {"m": {"devices": {GPU: [UUIDS[0]]}}})
    shared = assignment(NODE, "us", {"m": {"memory": (UUIDS[1], 4, 1024)}})
    add(book, pod_json("whole", "uw", NODE, {"m": {GPU: 1}}, annotations=whole))
    add(book, pod_json("shared", "us", NODE, {"m": {MEM: 4}}, annotations=shared))

    def refused(resource: str, ids: list[str]) -> AdmissionError:
        with pytest.raises(AdmissionError) as err:
            book.claim(resource, ids)
        return err.value

    err = refused(GPU, ["GPU-nope"])
    assert err.code is Refusal.INVALID_ARGUMENT and "GPU-nope" in str(err)
    err = refused(MEM, units(1, 0) + units(2, 0))
    assert err.code is Refusal.INVALID_ARGUMENT and "span GPUs" in str(err)
    err = refused(MEM, units(3, 0, 1))
    assert err.code is Refusal.FAILED_PRECONDITION and err.reason == "no_assignment"
    assert "only allocatable to pods scheduled by gpupool" in str(err)
    err = refused(GPU, [UUIDS[1]])  # a foreign whole-GPU request for the shared GPU
    assert err.code is Refusal.FAILED_PRECONDITION and err.reason == "gpu_is_shared" and "ns/shared" in str(err)


def test_memory_on_a_gpu_held_whole_is_refused_and_names_the_holder(book: AdmissionBook) -> None:
    add(book, pod_json("foreign", "uf", NODE, {"m": {GPU: 1}}))  # default-scheduler pod, no assignment
    claim = book.claim(GPU, [UUIDS[2]])
    assert (claim.via, claim.pod.name) == ("foreign", "foreign")
    book.commit(claim)
    assert book.tenancy().whole == {UUIDS[2]: ("ns/foreign",)}
    ann = assignment(NODE, "us", {"m": {"memory": (UUIDS[2], 4, 1024)}})
    add(book, pod_json("shared", "us", NODE, {"m": {MEM: 4}}, annotations=ann))
    with pytest.raises(AdmissionError, match=r"held whole by \['ns/foreign'\]") as err:
        book.claim(MEM, units(2, 0, 1, 2, 3))
    assert err.value.pod.name == "shared"
    # the whole-GPU pod ends: the GPU is free to share
    add(book, pod_json("foreign", "uf", NODE, {"m": {GPU: 1}}, phase="Succeeded", rv="2"))
    assert book.tenancy().whole == {}
    assert book.claim(MEM, units(2, 0, 1, 2, 3)).pod.name == "shared"


def test_unusable_assignments_fail_with_the_reason(book: AdmissionBook) -> None:
    wrong_node = assignment("node-z", "u1", {"m": {"devices": {GPU: [UUIDS[0]]}}})
    add(book, pod_json("p", "u1", NODE, {"m": {GPU: 1}}, annotations=wrong_node))
    with pytest.raises(AdmissionError, match=r"assignment is for node 'node-z'"):
        book.claim(GPU, [UUIDS[0]])
    copied = assignment(NODE, "someone-else", {"m": {"devices": {GPU: [UUIDS[0]]}}})
    add(book, pod_json("p", "u1", NODE, {"m": {GPU: 1}}, annotations=copied, rv="2"))
    with pytest.raises(AdmissionError, match=r"\(copied annotation\?\)"):
        book.claim(GPU, [UUIDS[0]])
    miscounted = assignment(NODE, "u1", {"m": {"memory": (UUIDS[0], 3, 1024)}})
    add(book, pod_json("p", "u1", NODE, {"m": {MEM: 4}}, annotations=miscounted, rv="3"))
    with pytest.raises(AdmissionError, match=r"gives 3 nvidia\.com/gpu-memory but the container requests 4"):
        book.claim(MEM, units(0, 0, 1, 2, 3))
    other_unit = assignment(NODE, "u1", {"m": {"memory": (UUIDS[0], 4, 2048)}})
    add(book, pod_json("p", "u1", NODE, {"m": {MEM: 4}}, annotations=other_unit, rv="4"))
    with pytest.raises(AdmissionError, match=r"assumed 2048 MiB per nvidia\.com/gpu-memory unit"):
        book.claim(MEM, units(0, 0, 1, 2, 3))


def test_acks_on_pods_restore_allocations_after_a_plugin_restart() -> None:
    ann = assignment(NODE, "u1", {"a": {"devices": {GPU: [UUIDS[0]]}}, "b": {"devices": {GPU: [UUIDS[1]]}}})
    book = AdmissionBook(NODE, RESOURCES, 1024)
    pod = pod_json("p", "u1", NODE, {"a": {GPU: 1}, "b": {GPU: 1}}, annotations=ann)
    book.replace_all([pod_record(pod, NAMES, NODE)])
    ack = book.commit(book.claim(GPU, [UUIDS[0]]))
    assert not ack.complete and not is_acknowledged(parse_assignment(ann), ack)
    restarted = AdmissionBook(NODE, RESOURCES, 1024)
    restarted.replace_all([pod_record(pod_json("p", "u1", NODE, {"a": {GPU: 1}, "b": {GPU: 1}},
                                               annotations={**ann, **ack_annotations(ack)}), NAMES, NODE)])
    claim = restarted.preferred(GPU, UUIDS[1:], [], 1)
    assert claim.container == "b"  # a is known to be done
    final = restarted.commit(restarted.claim(GPU, [UUIDS[1]]))
    assert final.complete and is_acknowledged(parse_assignment(ann), final)


def test_protocol_models() -> None:
    a = Assignment(node=NODE, pod_uid="u", containers=(
        ContainerAssignment(name="m", devices={GPU: (UUIDS[0],)}),
        ContainerAssignment(name="s", memory=MemoryShare(gpu=UUIDS[1], units=4, unit_mib=1024))))
    b = Assignment(node=NODE, pod_uid="v", containers=(
        ContainerAssignment(name="m", memory=MemoryShare(gpu=UUIDS[2], units=4, unit_mib=1024)),))
    c = Assignment(node=NODE, pod_uid="w", containers=(ContainerAssignment(name="m", devices={GPU: UUIDS[:2]}),))
    assert a.shapes() == {(GPU, 1), (MEM, 4)}
    assert shapes_conflict(a, b) and not shapes_conflict(b, c) and not shapes_conflict(a, c)
    raw = json.loads(parse_assignment({ASSIGNMENT_ANNOTATION: a.model_dump_json()}).model_dump_json())
    assert raw["version"] == 1
    for bad, message in [
        ('{"version": 2}', "version 2"),
        ("{nope", "not JSON"),
        (json.dumps({"version": 1, "node": NODE, "pod_uid": "u", "containers": [
            {"name": "m", "devices": {MEM: ["x"]}}]}), "goes in `memory`"),
        (json.dumps({"version": 1, "node": NODE, "pod_uid": "u", "containers": [
            {"name": "m", "devices": {GPU: [UUIDS[0]]}},
            {"name": "n", "memory": {"gpu": UUIDS[0], "units": 1, "unit_mib": 1024}}]}), "both whole and shared"),
    ]:
        with pytest.raises(HandshakeError, match=message):
            parse_assignment({ASSIGNMENT_ANNOTATION: bad})
    assert ACK_ANNOTATION == "gpupool.io/allocated"


# -- same-shape pods: which one the kubelet is admitting (issue 8, item 2) ------------------------------
def _same_shape_pair(book: AdmissionBook, resource: str) -> tuple[str, str]:
    """Pod "old" (created first, assigned GPU 0) and pod "new" (assigned GPU 1), same request shape, bound
    in the other order: "new" at resourceVersion 10, "old" at 11. Returns the two keys."""
    def plan(gpu: int) -> dict:
        return {"devices": {GPU: [UUIDS[gpu]]}} if resource == GPU else {"memory": (UUIDS[gpu], 5, 1024)}

    size = 1 if resource == GPU else 5
    add(book, pod_json("new", "u-new", NODE, {"m": {resource: size}}, created="2026-01-01T00:00:02Z", rv="10",
                       annotations=assignment(NODE, "u-new", {"m": plan(1)})))
    add(book, pod_json("old", "u-old", NODE, {"m": {resource: size}}, created="2026-01-01T00:00:01Z", rv="11",
                       annotations=assignment(NODE, "u-old", {"m": plan(0)})))
    return "ns/old", "ns/new"


@pytest.mark.parametrize("resource", [GPU, MEM])
def test_without_the_kubelets_pod_list_the_first_bound_goes_first(book: AdmissionBook, resource: str) -> None:
    """Binds arriving as separate watch events are admitted in arrival order, not by age."""
    _same_shape_pair(book, resource)
    size = 1 if resource == GPU else 5
    available = UUIDS if resource == GPU else [u for g in range(4) for u in all_units(g)]
    claim = book.preferred(resource, available, [], size)
    assert claim.pod.name == "new" and claim.ambiguous_with == ("ns/old",)
    assert book.contended(resource, size)


@pytest.mark.parametrize("resource", [GPU, MEM])
@pytest.mark.parametrize("admitting", ["old", "new"])
def test_the_kubelets_pod_list_says_which_pod_is_admitted(book: AdmissionBook, resource: str,
                                                          admitting: str) -> None:
    """The kubelet lists the pod it is admitting and not the ones still queued: whichever order it admits
    them in (arrival, or oldest first in a batch), each gets its own GPU and the other's is refused."""
    _same_shape_pair(book, resource)
    size = 1 if resource == GPU else 5
    gpu = {"old": 0, "new": 1}[admitting]
    available = UUIDS if resource == GPU else [u for g in range(4) for u in all_units(g)]
    kubelet = {"ns/" + admitting, "ns/unrelated"}
    claim = book.preferred(resource, available, [], size, kubelet=kubelet)
    assert claim.pod.name == admitting and claim.identified and not claim.ambiguous_with
    mine = [UUIDS[gpu]] if resource == GPU else units(gpu, 0, 1, 2, 3, 4)
    other = [UUIDS[1 - gpu]] if resource == GPU else units(1 - gpu, 0, 1, 2, 3, 4)
    with pytest.raises(AdmissionError, match="cannot swap GPUs") as err:
        book.claim(resource, other, kubelet=kubelet)
    assert err.value.reason == "swap" and err.value.pod.name == admitting
    got = book.claim(resource, mine, kubelet=kubelet)
    assert got.pod.name == admitting and got.identified
    ack = book.commit(got)
    assert ack.complete and ack.containers == {"m": {resource: tuple(mine)}}


def test_a_pod_the_kubelet_does_not_have_gets_nobodys_devices(book: AdmissionBook) -> None:
    _same_shape_pair(book, GPU)
    assert book.preferred(GPU, UUIDS, [], 1, kubelet={"ns/someone-else"}) is None
    assert book.unknown({"ns/someone-else", "ns/old"}) == ["ns/someone-else"]


def test_a_pod_of_another_scheduler_is_kept_off_assigned_devices(book: AdmissionBook) -> None:
    _same_shape_pair(book, GPU)
    add(book, pod_json("foreign", "u-f", NODE, {"m": {GPU: 1}}, rv="12"))
    assert book.reserved(GPU) == {UUIDS[0], UUIDS[1]}
    assert book.explains(GPU, 1) and not book.explains(GPU, 2)
    # the kubelet admits the foreign pod and hands it pod old's GPU anyway: it is the foreign pod's now
    claim = book.claim(GPU, [UUIDS[0]], kubelet={"ns/foreign"})
    assert (claim.via, claim.pod.name, claim.displaced) == ("foreign", "foreign", ("ns/old",))


# -- re-lists merged with watch events by resourceVersion (item 4) ---------------------------------------
def test_a_list_older_than_a_bind_keeps_the_freshly_admitted_pod(book: AdmissionBook) -> None:
    ann = assignment(NODE, "u1", {"m": {"devices": {GPU: [UUIDS[2]]}}})
    add(book, pod_json("p", "u1", NODE, {"m": {GPU: 1}}, annotations=ann, rv="105"))  # the watch: bound at 105
    book.commit(book.claim(GPU, [UUIDS[2]]))  # admitted
    other = pod_json("q", "u2", NODE, {"m": {GPU: 1}}, rv="90")
    assert book.replace_all([pod_record(other, NAMES, NODE)], list_rv="100")  # snapshot taken before the bind
    assert {p.name for p in book.pods()} == {"p", "q"}
    assert book.tenancy().whole == {UUIDS[2]: ("ns/p",)}
    assert book.claim(GPU, [UUIDS[3]]).pod.name == "q"  # p is not pending again


def test_a_stale_list_does_not_bring_back_a_deleted_pod(book: AdmissionBook) -> None:
    pod = pod_json("p", "u1", NODE, {"m": {GPU: 1}}, rv="100")
    add(book, pod)
    book.commit(book.claim(GPU, [UUIDS[1]]))
    book.remove("u1", "120")  # deleted at 120
    assert book.replace_all([pod_record(pod, NAMES, NODE)], list_rv="110")  # listed at 110: still there
    assert book.pods() == [] and book.tenancy().whole == {}
    assert book.replace_all([], list_rv="130")
    assert not book.replace_all([pod_record(pod, NAMES, NODE)], list_rv="125")  # older than the one applied
    assert book.pods() == []


def test_a_newer_list_still_replaces_what_it_knows(book: AdmissionBook) -> None:
    add(book, pod_json("p", "u1", NODE, {"m": {GPU: 1}}, rv="100"))
    add(book, pod_json("gone", "u2", NODE, {"m": {GPU: 1}}, rv="101"))
    book.commit(book.claim(GPU, [UUIDS[1]]))
    done = pod_json("p", "u1", NODE, {"m": {GPU: 1}}, rv="140", phase="Succeeded")
    assert book.replace_all([pod_record(done, NAMES, NODE)], list_rv="150")
    assert [p.name for p in book.pods()] == ["p"] and book.pods()[0].terminal
    assert book.tenancy().whole == {}


# -- PodResources reconciliation (item 3) ----------------------------------------------------------------
def test_reconcile_restores_an_allocation_whose_ack_was_lost() -> None:
    """After a plugin restart a pod admitted without an ack looks pending and would capture the next
    same-shape pod's Allocate; the kubelet's records say it holds its units."""
    book = AdmissionBook(NODE, RESOURCES, 1024)
    first = assignment(NODE, "u1", {"m": {"memory": (UUIDS[0], 4, 1024)}})
    second = assignment(NODE, "u2", {"m": {"memory": (UUIDS[0], 4, 1024)}})
    book.replace_all([pod_record(pod_json("first", "u1", NODE, {"m": {MEM: 4}}, annotations=first,
                                          created="2026-01-01T00:00:01Z"), NAMES, NODE),
                      pod_record(pod_json("second", "u2", NODE, {"m": {MEM: 4}}, annotations=second,
                                          created="2026-01-01T00:00:02Z"), NAMES, NODE)])
    result = book.reconcile([KubeletPod("ns", "first", {"m": {MEM: tuple(units(0, 0, 1, 2, 3))}}),
                             KubeletPod("ns", "second", {"m": {}}), KubeletPod("kube-system", "dns", {"c": {}})])
    held = tuple(units(0, 0, 1, 2, 3))
    assert [(c.pod, c.kind, c.now) for c in result.corrections] == [("ns/first", "missing", held)]
    ((pod, ack),) = result.acks
    assert pod.name == "first" and ack.complete and ack.containers == {"m": {MEM: tuple(units(0, 0, 1, 2, 3))}}
    assert book.claim(MEM, units(0, 4, 5, 6, 7)).pod.name == "second"
    assert book.reconcile([KubeletPod("ns", "first", {"m": {MEM: tuple(units(0, 0, 1, 2, 3))}})]).corrections == ()


def test_reconcile_corrects_a_swap_and_frees_the_right_gpu() -> None:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    for name, uid in (("a", "ua"), ("b", "ub")):
        book.upsert(pod_record(pod_json(name, uid, NODE, {"m": {GPU: 1}}), NAMES, NODE))  # other schedulers
    book.commit(book.claim(GPU, [UUIDS[0]]))  # guessed: pod a
    book.commit(book.claim(GPU, [UUIDS[1]]))  # guessed: pod b
    assert book.tenancy().whole == {UUIDS[0]: ("ns/a",), UUIDS[1]: ("ns/b",)}
    result = book.reconcile([KubeletPod("ns", "a", {"m": {GPU: (UUIDS[1],)}}),
                             KubeletPod("ns", "b", {"m": {GPU: (UUIDS[0],)}}),
                             KubeletPod("ns", "stranger", {"x": {GPU: (UUIDS[3],), "example.com/nic": ("eth1",)}})])
    assert sorted((c.pod, c.kind, c.was, c.now) for c in result.corrections) == [
        ("ns/a", "differs", (UUIDS[0],), (UUIDS[1],)), ("ns/b", "differs", (UUIDS[1],), (UUIDS[0],))]
    assert {p.name: a.containers["m"][GPU] for p, a in result.acks} == {"a": (UUIDS[1],), "b": (UUIDS[0],)}
    assert result.unknown_pods == ("ns/stranger",)
    book.remove("ua")
    assert book.tenancy().whole == {UUIDS[0]: ("ns/b",)}  # pod a ended: the GPU it really held is free


def test_reconcile_drops_a_record_of_devices_another_pod_holds() -> None:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    for name, uid in (("a", "ua"), ("b", "ub")):
        book.upsert(pod_record(pod_json(name, uid, NODE, {"m": {GPU: 1}}), NAMES, NODE))
    book.commit(book.claim(GPU, [UUIDS[2]]))  # guessed: pod a, but the kubelet was admitting b
    result = book.reconcile([KubeletPod("ns", "b", {"m": {GPU: (UUIDS[2],)}}), KubeletPod("ns", "a", {"m": {}})])
    assert sorted((c.pod, c.kind) for c in result.corrections) == [("ns/a", "held_by_other"), ("ns/b", "missing")]
    assert book.tenancy().whole == {UUIDS[2]: ("ns/b",)}
    acks = {p.name: a for p, a in result.acks}
    assert acks["a"].containers == {} and not acks["a"].complete and acks["b"].complete
    # a stale ack on pod a (the corrected one is not written yet) does not bring the record back
    stale = ack_annotations(acks["b"].model_copy(update={"pod_uid": "ua"}))
    book.upsert(pod_record(pod_json("a", "ua", NODE, {"m": {GPU: 1}}, annotations=stale, rv="2"), NAMES, NODE))
    assert book.tenancy().whole == {UUIDS[2]: ("ns/b",)}


def test_the_pod_being_admitted_given_devices_nobody_was_assigned_is_refused(book: AdmissionBook) -> None:
    _same_shape_pair(book, MEM)
    with pytest.raises(AdmissionError, match=r"not what gpupool assigned \(5 units on GPU-") as err:
        book.claim(MEM, units(3, 0, 1, 2, 3, 4), kubelet={"ns/new"})
    assert err.value.reason == "not_assigned" and err.value.pod.name == "new"
