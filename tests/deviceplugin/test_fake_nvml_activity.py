"""Scripted GPU activity in the fake NVML, read through the session as the sampler reads real NVML."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pynvml
import pytest

from gpupool_deviceplugin.nvml.fake import FakeNvml
from gpupool_deviceplugin.nvml.numa import TableNuma
from gpupool_deviceplugin.nvml.session import NvmlSession

MIB = 1 << 20


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def session_for(profile: str, clock: Clock, events: Path | None = None) -> tuple[NvmlSession, FakeNvml]:
    fake = FakeNvml(profile, clock=clock, events_file=events)
    s = NvmlSession(fake, TableNuma({}))
    s.init()
    return s, fake


def test_idle_busy_and_processes_read_as_scripted() -> None:
    clock = Clock()
    s, fake = session_for("l40s-pcie", clock)
    h = s.gpu_handles()[0]
    clock.t += 5
    idle = s.read_activity(h)
    assert (idle.activity_pct, idle.source, idle.processes, idle.memory_used) == (0.0, "samples", {}, 0)
    assert idle.power_w == 60.0 and idle.process_memory == {}
    fake.set_activity(s.uuid(h), {"processes": [{"pid": 11, "utilization": 70, "memoryUsedMiB": 2048},
                                                {"pid": 12, "utilization": 0, "memoryUsedMiB": 1024}],
                                  "utilization": 70, "powerW": 250})
    clock.t += 2
    busy = s.read_activity(h, idle.device_seen_us, idle.process_seen_us)
    assert busy.activity_pct == 70 and busy.processes == {11: 70.0, 12: 0.0}
    assert busy.process_memory == {11: 2048 * MIB, 12: 1024 * MIB}
    assert busy.memory_used == 3072 * MIB and busy.power_w == 250.0
    assert busy.device_seen_us > idle.device_seen_us
    # nothing new since the last round: NOT_FOUND from the sample buffer, the current rate instead
    again = s.read_activity(h, busy.device_seen_us, busy.process_seen_us)
    assert again.source == "rates" and again.activity_pct == 70 and again.processes == {}


def test_a_burst_between_two_rounds_is_seen_from_the_sample_buffer() -> None:
    clock = Clock()
    s, fake = session_for("l40s-pcie", clock)
    h = s.gpu_handles()[0]
    fake.set_activity(s.uuid(h), {"utilization": 90, "burst": {"everyS": 30, "busyS": 2}})
    seen_device = seen_process = 0
    readings = []
    clock.t += 5  # rounds at 15 s, 25 s, ... into the script: never inside a 2 s burst at 0, 30, 60, ...
    for _ in range(12):  # every 10 s for 2 min: the burst is never at a sampling instant...
        clock.t += 10
        r = s.read_activity(h, seen_device, seen_process)
        seen_device, seen_process = r.device_seen_us, r.process_seen_us
        readings.append(r.activity_pct)
        assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 0  # ...so the current rate always says 0
    assert readings.count(90.0) == 5 and readings.count(0.0) == 7  # ...the buffer has each: 0, 30, .., 120 s


def test_unsupported_readings_fall_back_and_mig_is_unknown() -> None:
    clock = Clock()
    s, fake = session_for("l40s-pcie", clock)
    h = s.gpu_handles()[0]
    fake.set_activity(s.uuid(h), {"utilization": 40, "perProcess": False, "deviceSamples": False})
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    r = s.read_activity(h)
    assert (r.activity_pct, r.source, r.processes) == (40.0, "rates", None)

    mig, _ = session_for("a100-mig", clock)
    gpu = next(g for g in mig.gpu_handles() if mig.mig_capable_and_enabled(g)[1])
    handle = mig.handle_by_uuid(mig.mig_devices(gpu)[0].uuid)
    r = mig.read_activity(handle)
    assert (r.activity_pct, r.source, r.processes, r.power_w) == (None, "unknown", None, None)


def test_activity_lines_in_the_events_file_script_a_gpu_and_bad_ones_are_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    events = tmp_path / "events.jsonl"
    clock = Clock()
    s, _ = session_for("l40s-pcie", clock, events)
    h0, h1 = s.gpu_handles()[:2]
    u0, u1 = s.uuid(h0), s.uuid(h1)
    event_set, _ = s.create_event_set([h0, h1])
    with caplog.at_level(logging.WARNING):
        events.write_text("\n".join(json.dumps(line) for line in (
            {"uuid": u0, "activity": {"utilization": 55, "memoryUsedMiB": 100}},
            {"uuid": u1, "activity": {"utilization": 101}},
            {"uuid": "GPU-nope", "activity": {}},
            {"uuid": u1, "xid": 79},
        )) + "\n")
        clock.t += 1
        assert s.read_activity(h0).activity_pct == 55 and s.read_activity(h0).memory_used == 100 * MIB
        assert s.read_activity(h1).activity_pct == 0
        event = s.wait_event(event_set, 200)
        assert event is not None and event.gpu_uuid == u1 and event.xid == 79  # the event stream is intact
        assert s.wait_event(event_set, 50) is None
    text = caplog.text
    assert ":2: bad activity" in text and "utilization" in text and ":3: activity for 'GPU-nope'" in text
    assert "unknown event kind" not in text
