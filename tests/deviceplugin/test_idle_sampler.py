"""The idle sampler: NVML activity (the fake GPU, scripted) attributed to the pods of the assignment book,
tracked, scraped over real HTTP, and the node's idle pods handed to the publisher."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_common.idlepods import idle_pods_annotation, parse_idle_pods
from gpupool_deviceplugin.admission import AdmissionBook
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.idle import IdlePolicy
from gpupool_deviceplugin.idle_sampler import IdleSampler, Tenant, pod_uid_of_pid, tenants_from_book
from gpupool_deviceplugin.metrics import PluginMetrics, StatusServer
from gpupool_deviceplugin.nvml.fake import FakeNvml
from gpupool_deviceplugin.nvml.numa import TableNuma
from gpupool_deviceplugin.nvml.session import NvmlSession
from gpupool_deviceplugin.pods import pod_record
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_deviceplugin.resources import build_resources
from tests.support.objects import assignment, pod_json

NODE = "node-i"
GPU = "nvidia.com/gpu"
INV = node_publication_for_profile("l40s-pcie", node_name=NODE).inventory
assert INV is not None
UUIDS = [g.uuid for g in INV.gpus]
RESOURCES = build_resources(INV, PluginConfig(), memory_units=True)
UID_TRAIN, UID_BUSY, UID_IDLE = (f"{c * 8}-{c * 4}-{c * 4}-{c * 4}-{c * 12}" for c in "abc")
POLICY = IdlePolicy(window_s=60, start_grace_s=30, max_gap_s=30)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def running(obj: dict, started: str | None = "2026-01-01T00:00:00Z") -> dict:
    """The pod with its container running since `started` (None: not running yet, e.g. pulling its image)."""
    state = {"running": {"startedAt": started}} if started else {"waiting": {"reason": "ContainerCreating"}}
    obj["status"] = {"phase": "Running" if started else "Pending",
                     "containerStatuses": [{"name": "main", "state": state}]}
    return obj


def make_book(started: dict[str, str | None] | None = None) -> AdmissionBook:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    names = [r.name for r in RESOURCES]
    pods = [
        pod_json("trainer", UID_TRAIN, NODE, {"main": {GPU: 1}},
                 annotations=assignment(NODE, UID_TRAIN, {"main": {"devices": {GPU: [UUIDS[0]]}}})),
        pod_json("busy", UID_BUSY, NODE, {"main": {"nvidia.com/gpu-memory": 4}},
                 annotations=assignment(NODE, UID_BUSY, {"main": {"memory": (UUIDS[1], 4, 1024)}})),
        pod_json("idle", UID_IDLE, NODE, {"main": {"nvidia.com/gpu-memory": 4}},
                 annotations=assignment(NODE, UID_IDLE, {"main": {"memory": (UUIDS[1], 4, 1024)}})),
    ]
    when = started or {}
    book.replace_all([pod_record(running(p, when.get(p["metadata"]["name"], "2026-01-01T00:00:00Z")), names, NODE)
                      for p in pods])
    return book


@pytest.fixture
def rig() -> Iterator[tuple[Clock, FakeNvml, NvmlSession, PluginMetrics, StatusServer]]:
    clock = Clock()
    fake = FakeNvml("l40s-pcie", seed=NODE, clock=clock)
    session = NvmlSession(fake, TableNuma({}))
    session.init()
    metrics = PluginMetrics()
    server = StatusServer(metrics, lambda: (True, "ok"), "127.0.0.1", 0)
    server.start()
    yield clock, fake, session, metrics, server
    server.stop()


def scrape(server: StatusServer, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(dict(re.findall(r'(\w+)="([^"]*)"', head)).get(k) == v
                                              for k, v in labels.items()):
            return float(value)
    return None


def step(sampler: IdleSampler, clock: Clock, seconds: float, every: float = 10.0) -> None:
    end = clock.t + seconds
    while clock.t < end:
        clock.t += every
        sampler.sample_once()


def test_tenants_come_from_the_assignment_book() -> None:
    tenants = tenants_from_book(make_book())
    since = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    assert tenants == {UUIDS[0]: (Tenant(UID_TRAIN, "ns", "trainer", since),),
                       UUIDS[1]: (Tenant(UID_BUSY, "ns", "busy", since), Tenant(UID_IDLE, "ns", "idle", since))}


def test_idle_and_busy_pods_on_whole_and_shared_gpus(rig) -> None:
    clock, fake, session, metrics, server = rig
    book = make_book()
    pids = {101: UID_BUSY, 102: UID_IDLE}
    published: list[dict[str, float]] = []
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), POLICY, 10, metrics,
                          uid_of_pid=pids.get, on_idle_pods=published.append, publish_interval_s=0,
                          clock=clock, wall=clock)
    fake.set_activity(UUIDS[1], {"utilization": 60, "processes": [
        {"pid": 101, "utilization": 60, "memoryUsedMiB": 3000}, {"pid": 102, "utilization": 0, "memoryUsedMiB": 2000}]})
    start = clock.t
    step(sampler, clock, 120)
    idle = {"namespace": "ns", "pod": "idle", "uuid": UUIDS[1]}
    busy = {"namespace": "ns", "pod": "busy", "uuid": UUIDS[1]}
    trainer = {"namespace": "ns", "pod": "trainer", "uuid": UUIDS[0]}
    # per-process attribution on the shared GPU: one tenant busy, the other idle
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **idle) == 1
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle_seconds", **idle) == 110  # since its first sample
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **busy) == 0
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_activity_percent", **busy) == 60
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_memory_used_bytes", **idle) == 2000 << 20
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_attribution", **idle, via="process") == 1
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **trainer) == 1  # GPU 0 does nothing
    assert scrape(server, "gpupool_deviceplugin_gpu_activity_percent", uuid=UUIDS[1]) == 60
    assert scrape(server, "gpupool_deviceplugin_gpu_power_watts", uuid=UUIDS[1]) == 60.0
    assert scrape(server, "gpupool_deviceplugin_idle_pods") == 2
    assert set(published[-1]) == {UID_TRAIN, UID_IDLE}
    assert published[-1][UID_IDLE] == start + 10  # idle since its first sample: a stable value to publish
    since = parse_idle_pods(idle_pods_annotation(published[-1]))
    assert since[UID_IDLE].timestamp() == int(start + 10)

    # a process no tenant owns (an MPS server, or no host PID namespace): the GPU's activity applies to both
    fake.set_activity(UUIDS[1], {"utilization": 60, "processes": [{"pid": 999, "utilization": 60}]})
    step(sampler, clock, 10)
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **idle) == 0
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_attribution", **idle, via="device") == 1
    assert set(published[-1]) == {UID_TRAIN}

    # the trainer gets busy: it leaves the idle pods
    fake.set_activity(UUIDS[0], {"utilization": 80})
    step(sampler, clock, 10)
    assert published[-1] == {}
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle_seconds", **trainer) == 0

    # a tenant that leaves loses its series
    book.remove(UID_TRAIN)
    step(sampler, clock, 10)
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle_seconds", **trainer) is None


def test_without_a_pid_to_pod_mapping_the_idle_tenant_of_a_busy_gpu_is_never_idle(rig) -> None:
    clock, fake, session, metrics, server = rig
    book = make_book()
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), POLICY, 10, metrics,
                          uid_of_pid=lambda pid: None, clock=clock, wall=clock)
    fake.set_activity(UUIDS[1], {"utilization": 60, "processes": [
        {"pid": 101, "utilization": 60, "memoryUsedMiB": 3000}, {"pid": 102, "utilization": 0, "memoryUsedMiB": 2000}]})
    step(sampler, clock, 600)
    labels = {"namespace": "ns", "pod": "idle", "uuid": UUIDS[1]}
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **labels) == 0
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_activity_percent", **labels) == 60
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_attribution", **labels, via="device") == 1


def test_a_bursty_pod_is_never_idle_under_the_default_window(rig) -> None:
    clock, fake, session, metrics, server = rig
    book = make_book()
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), IdlePolicy(), 10, metrics,
                          clock=clock, wall=clock)
    fake.set_activity(UUIDS[0], {"utilization": 95, "burst": {"everyS": 300, "busyS": 2}, "memoryUsedMiB": 9000})
    clock.t += 5  # sampling instants never fall inside a burst
    labels = {"namespace": "ns", "pod": "trainer", "uuid": UUIDS[0]}
    worst = 0.0
    for _ in range(360):  # one hour
        step(sampler, clock, 10)
        assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **labels) == 0
        worst = max(worst, scrape(server, "gpupool_deviceplugin_pod_gpu_idle_seconds", **labels) or 0)
    assert 290 <= worst <= 300


def test_where_the_driver_keeps_no_sample_buffer_bursts_between_samples_are_missed(rig) -> None:
    """The documented limit: with only the current rate, a 2 s burst between 10 s samples is invisible."""
    clock, fake, session, metrics, server = rig
    book = make_book()
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), IdlePolicy(), 10, metrics,
                          clock=clock, wall=clock)
    fake.set_activity(UUIDS[0], {"utilization": 95, "burst": {"everyS": 300, "busyS": 2}, "deviceSamples": False,
                                 "perProcess": False})
    clock.t += 5
    step(sampler, clock, 900)
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", namespace="ns", pod="trainer", uuid=UUIDS[0]) == 1


def test_a_lost_gpu_makes_its_tenants_busy_not_idle(rig, tmp_path: Path) -> None:
    clock, fake, session, metrics, server = rig
    book = make_book()
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), POLICY, 10, metrics, clock=clock,
                          wall=clock)
    step(sampler, clock, 120)
    labels = {"namespace": "ns", "pod": "trainer", "uuid": UUIDS[0]}
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **labels) == 1
    fake._lost.add(0)  # what a {"lost": true} line of the events file does
    step(sampler, clock, 10)
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **labels) == 0
    assert scrape(server, "gpupool_deviceplugin_idle_samples_total", result="error") == 1


def test_publication_is_rate_limited_and_only_on_change(rig) -> None:
    clock, fake, session, metrics, _ = rig
    book = make_book()
    published: list[dict[str, float]] = []
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), POLICY, 10, metrics,
                          on_idle_pods=published.append, publish_interval_s=60, clock=clock, wall=clock)
    step(sampler, clock, 30)
    assert published == [{}]
    step(sampler, clock, 60)  # every tenant idle after 60 s: changed, and 60 s since the last patch
    assert len(published) == 2 and set(published[1]) == {UID_TRAIN, UID_BUSY, UID_IDLE}
    fake.set_activity(UUIDS[0], {"utilization": 80})
    step(sampler, clock, 10)
    assert len(published) == 2  # changed, but the last patch was 10 s ago
    step(sampler, clock, 60)
    assert len(published) == 3 and set(published[2]) == {UID_BUSY, UID_IDLE}
    step(sampler, clock, 120)
    assert len(published) == 3  # nothing changed: no patch


def test_pod_uid_from_cgroup_paths(tmp_path: Path) -> None:
    uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
        "cri-containerd-abc.scope\n")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text(f"12:memory:/kubepods/besteffort/pod{uid}/0123abcd\n")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cgroup").write_text("0::/system.slice/containerd.service\n")
    assert pod_uid_of_pid(7, tmp_path) == uid and pod_uid_of_pid(8, tmp_path) == uid
    assert pod_uid_of_pid(9, tmp_path) is None and pod_uid_of_pid(10, tmp_path) is None


def test_a_pod_whose_containers_do_not_run_yet_is_never_idle_and_its_grace_starts_with_them(rig) -> None:
    clock, _, session, metrics, server = rig
    just = "2027-01-15T08:00:00Z"  # == the rig's clock at start (1_800_000_000)
    book = make_book({"trainer": None, "busy": just})  # trainer: pulling its image; busy: just started
    sampler = IdleSampler(session, INV, lambda: tenants_from_book(book), POLICY, 10, metrics, clock=clock,
                          wall=clock)
    step(sampler, clock, 600)  # every GPU does nothing for 10 min
    trainer = {"namespace": "ns", "pod": "trainer", "uuid": UUIDS[0]}
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", **trainer) == 0
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle_seconds", **trainer) == 0
    assert scrape(server, "gpupool_deviceplugin_pod_gpu_idle", namespace="ns", pod="busy", uuid=UUIDS[1]) == 1

    book2 = make_book({"busy": "2027-01-15T08:10:00Z"})  # its container (re)started at the clock's now
    sampler2 = IdleSampler(session, INV, lambda: tenants_from_book(book2), POLICY, 10, PluginMetrics(),
                           clock=clock, wall=clock)
    states = []
    for _ in range(12):
        step(sampler2, clock, 10)
        state = sampler2.tracker.state((UID_BUSY, UUIDS[1]), clock.t)
        assert state is not None
        states.append(state.idle)
    # 30 s of grace from the container's start (its last sample within it at 20 s), then the 60 s window:
    # idle from 80 s on, not before
    assert states == [False] * 7 + [True] * 5


def test_per_process_samples_that_do_not_explain_a_busy_gpu_are_not_used() -> None:
    from gpupool_deviceplugin.idle_sampler import attribute
    from gpupool_deviceplugin.nvml.session import ActivityReading

    tenants = (Tenant(UID_BUSY, "ns", "busy"), Tenant(UID_IDLE, "ns", "idle"))
    owners = {101: UID_BUSY, 102: UID_IDLE}.get

    def reading(device: float | None, per_process: dict[int, float]) -> ActivityReading:
        return ActivityReading(device, "samples", per_process, {101: 1 << 30, 102: 1 << 30}, 2 << 30, 48 << 30,
                               100.0, 0, 0)

    assert attribute(reading(70, {101: 70, 102: 0}), tenants, owners) == (
        {UID_BUSY: (70, 1 << 30), UID_IDLE: (0, 1 << 30)}, "process")
    assert attribute(reading(0, {}), tenants, owners)[1] == "process"  # nothing runs: nobody is busy
    # the engine is busy and no process's samples show it: every tenant gets the GPU's figures
    assert attribute(reading(70, {}), tenants, owners) == ({UID_BUSY: (70, 2 << 30), UID_IDLE: (70, 2 << 30)},
                                                          "device")
    assert attribute(reading(None, {}), tenants, owners)[0][UID_IDLE] == (None, 2 << 30)
    assert attribute(None, tenants, owners) == ({UID_BUSY: (None, None), UID_IDLE: (None, None)}, "device")
