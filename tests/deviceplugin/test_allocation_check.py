"""The check after Allocate (issue 16, A11): the plugin lists the kubelet's PodResources records every
CHECK_INTERVAL while an allocation is not shown there, for CHECK_WINDOW after its Allocate, and corrects the
record and ack of a pod the kubelet allocated other devices than the plugin credited it with. The real
AdmissionBook and Reconciler; the PodResources client is a stand-in that answers from a dict or not at all
(the real API under the real device manager: test_real_devicemanager.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_common.handshake import AllocationAck
from gpupool_deviceplugin.admission import AdmissionBook, KubeletPod
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.podresources import PodResourcesUnavailable, Reconciler
from gpupool_deviceplugin.pods import PodRecord, pod_record
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_deviceplugin.resources import build_resources
from tests.support.objects import assignment, pod_json
from tests.support.waiting import eventually

NODE = "node-a"
GPU = "nvidia.com/gpu"
INV = node_publication_for_profile("l40s-pcie", node_name=NODE).inventory
UUIDS = [g.uuid for g in INV.gpus]
RESOURCES = build_resources(INV, PluginConfig(), memory_units=True)
NAMES = [r.name for r in RESOURCES]
INTERVAL_S, WINDOW_S = 0.05, 1.0


class Client:
    """PodResources as the kubelet answers: `pods` (None: not answering); counts List calls."""

    socket = Path("/nonexistent/kubelet.sock")

    def __init__(self) -> None:
        self.pods: list[KubeletPod] | None = None
        self.calls = 0

    def list(self) -> list[KubeletPod]:
        self.calls += 1
        if self.pods is None:
            raise PodResourcesUnavailable("not answering")
        return list(self.pods)

    def allocatable(self) -> dict[str, frozenset[str]]:
        return {}

    def close(self) -> None:
        pass


class Acks:
    def __init__(self) -> None:
        self.latest: dict[str, AllocationAck] = {}
        self.lock = threading.Lock()

    def submit(self, pod: PodRecord, ack: AllocationAck) -> None:
        with self.lock:
            self.latest[pod.name] = ack


@pytest.fixture
def setup() -> Iterator[tuple[AdmissionBook, Client, Acks, Reconciler, PluginMetrics]]:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    book.replace_all([])
    client, acks, metrics = Client(), Acks(), PluginMetrics()
    rec = Reconciler(book, client, acks, metrics, RESOURCES, 3600.0,  # type: ignore[arg-type]
                     check_interval_s=INTERVAL_S, check_window_s=WINDOW_S)
    rec.start()
    yield book, client, acks, rec, metrics
    rec.stop()


def same_shape_pair(book: AdmissionBook) -> None:
    """Pods old (GPU 0) and new (GPU 1), one whole GPU each, new bound first."""
    for name, uid, gpu, created, rv in (("new", "un", 1, "2026-01-01T00:00:02Z", "10"),
                                        ("old", "uo", 0, "2026-01-01T00:00:01Z", "11")):
        ann = assignment(NODE, uid, {"m": {"devices": {GPU: [UUIDS[gpu]]}}})
        book.upsert(pod_record(pod_json(name, uid, NODE, {"m": {GPU: 1}}, annotations=ann, created=created, rv=rv),
                               NAMES, NODE))


def admit_guessing(book: AdmissionBook, acks: Acks) -> None:
    """The kubelet admits old then new (creation order) while PodResources does not answer: the plugin
    guesses by bind order (new first), so old gets GPU 1 and new GPU 0, each ack repeating an assignment."""
    for _ in ("old", "new"):
        claim = book.preferred(GPU, UUIDS, [], 1)
        assert claim is not None
        got = book.claim(GPU, claim.ids)
        ack = book.commit(got)
        assert ack is not None and got.pod is not None
        acks.submit(got.pod, ack)


def swapped() -> list[KubeletPod]:
    """What the kubelet holds after admitting old first: GPU 1 for old, GPU 0 for new."""
    return [KubeletPod("ns", "old", {"m": {GPU: (UUIDS[1],)}}), KubeletPod("ns", "new", {"m": {GPU: (UUIDS[0],)}})]


def metric(metrics: PluginMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_a_guessed_ack_is_corrected_by_the_first_list_after_allocate(setup) -> None:
    book, client, acks, _, metrics = setup
    same_shape_pair(book)
    admit_guessing(book, acks)
    assert {n: a.containers["m"][GPU] for n, a in acks.latest.items()} == {"new": (UUIDS[1],), "old": (UUIDS[0],)}
    assert book.unconfirmed() == 2
    time.sleep(3 * INTERVAL_S)  # not answering: the checks keep trying
    assert client.calls >= 2 and book.unconfirmed() == 2
    client.pods = swapped()
    answered = time.monotonic()
    eventually(lambda: {n: a.containers["m"][GPU] for n, a in acks.latest.items()} == {"new": (UUIDS[0],),
                                                                                        "old": (UUIDS[1],)},
               timeout=WINDOW_S, interval=0.01, what="both acks corrected")
    assert time.monotonic() - answered < 10 * INTERVAL_S  # one interval and a List (slack for a busy machine)
    assert all(a.complete for a in acks.latest.values())
    assert book.unconfirmed() == 0
    assert metric(metrics, "gpupool_deviceplugin_reconcile_corrections_total", kind="differs") == 2
    assert metric(metrics, "gpupool_deviceplugin_allocation_checks_total", result="confirmed") == 2
    # nothing left to check: no more Lists
    calls = client.calls
    time.sleep(4 * INTERVAL_S)
    assert client.calls == calls


def test_an_allocation_the_kubelet_has_not_recorded_yet_is_checked_again(setup) -> None:
    """The first List may come before the kubelet recorded the allocation (it does after Allocate returns):
    the container is listed without devices, left alone, and checked again."""
    book, client, acks, _, _ = setup
    same_shape_pair(book)
    client.pods = [KubeletPod("ns", "old", {"m": {}})]
    admit_guessing(book, acks)
    time.sleep(3 * INTERVAL_S)
    assert book.unconfirmed() == 2 and acks.latest["old"].containers["m"][GPU] == (UUIDS[0],)
    client.pods = swapped()
    eventually(lambda: book.unconfirmed() == 0, timeout=WINDOW_S, interval=0.01, what="allocations confirmed")
    assert acks.latest["old"].containers["m"][GPU] == (UUIDS[1],)


def test_past_the_window_the_check_stops_and_says_so(setup) -> None:
    book, client, acks, _, metrics = setup
    same_shape_pair(book)
    admit_guessing(book, acks)
    eventually(lambda: book.unconfirmed() == 0, timeout=3 * WINDOW_S, interval=0.01, what="the window to pass")
    assert metric(metrics, "gpupool_deviceplugin_allocation_checks_total", result="unconfirmed") == 2
    calls = client.calls
    assert WINDOW_S / INTERVAL_S / 4 <= calls <= 2 * WINDOW_S / INTERVAL_S  # every interval, not faster
    time.sleep(4 * INTERVAL_S)
    assert client.calls == calls
