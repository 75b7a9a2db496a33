"""A fake NVML library: the same function names, signatures, return types and exceptions as `pynvml`,
answering from a node profile instead of a driver.

This is the only fake in gpupool. Everything above it (discovery, health, the gRPC servers) runs the
production code path against it. Return values are pynvml's own ctypes structures where pynvml returns
one (nvmlPciInfo_t, c_nvmlMemory_t, c_nvmlDeviceAttributes, c_nvmlGpuInstanceInfo_t); handles are
opaque objects, as real handles are to callers; errors are `pynvml.NVMLError` with the real codes.

Health events are injected through an append-only JSON-lines file that a separate process (a test, an
operator) can write while the plugin runs:

    {"uuid": "GPU-...", "xid": 79}                 # Xid critical error on a GPU
    {"uuid": "MIG-...", "xid": 31}                 # ...on one MIG device (GPU + GI/CI ids in the event)
    {"uuid": "GPU-...", "event": "double_bit_ecc"} # uncorrectable ECC error
    {"uuid": "GPU-...", "lost": true}              # every call on this GPU now fails with GPU_IS_LOST
    {"uuid": "GPU-...", "lost": false}             # ...and recovers

A line that is not one of these (not JSON, an unknown UUID or kind, a bad Xid) is logged with its line
number and skipped: it never stops the event stream and never touches another GPU.

The same file scripts what a GPU is doing (engine activity, memory, power, processes), from the moment the
fake reads the line until the next such line for that GPU (lines written before start-up apply too: they
are state, not events):

    {"uuid": "GPU-...", "activity": {"utilization": 80, "memoryUsedMiB": 4000, "powerW": 300}}
    {"uuid": "GPU-...", "activity": {"utilization": 90, "burst": {"everyS": 300, "busyS": 2}}}  # bursty
    {"uuid": "GPU-...", "activity": {"processes": [{"pid": 4242, "utilization": 60, "memoryUsedMiB": 2048},
                                                   {"pid": 4343, "utilization": 0, "memoryUsedMiB": 1024}]}}
    {"uuid": "GPU-...", "activity": {"utilization": 5, "perProcess": false, "deviceSamples": false}}

The device samples utilisation every 1/6 s, as the driver does, into a buffer of the last 20 s that
nvmlDeviceGetSamples / nvmlDeviceGetProcessUtilization read from a timestamp on; a burst scales every
utilisation (device and processes) to 0 outside its busy part. `perProcess: false` makes
nvmlDeviceGetProcessUtilization answer NOT_SUPPORTED and `deviceSamples: false` nvmlDeviceGetSamples, as
on GPUs and drivers without them; MIG device handles answer NOT_SUPPORTED for utilisation, as real ones do.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpupool_deviceplugin.nvml.profile import FakeProfile, load_profile

log = logging.getLogger(__name__)
_UUID_NAMESPACE = uuidlib.UUID("6f1c3c2e-4f0b-4d7e-9a51-8a1b0c6e2d90")
_NOT_A_MIG_ID = 0xFFFFFFFF
_SUPPORTED_EVENTS = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
                     | pynvml.nvmlEventTypeSingleBitEccError)
_EVENT_NAMES = {
    "xid": pynvml.nvmlEventTypeXidCriticalError,
    "double_bit_ecc": pynvml.nvmlEventTypeDoubleBitEccError,
    "single_bit_ecc": pynvml.nvmlEventTypeSingleBitEccError,
}


SAMPLE_PERIOD_S = 1 / 6  # the driver's utilisation sampling period on most products
SAMPLE_BUFFER_S = 20.0    # how far back the sample buffer reaches


class _ActivityModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class BurstScript(_ActivityModel):
    every_s: float = Field(gt=0, alias="everyS")
    busy_s: float = Field(ge=0, alias="busyS")


class ProcessScript(_ActivityModel):
    pid: int = Field(gt=0, lt=2**32)
    utilization: int = Field(default=0, ge=0, le=100)
    memory_used_mib: int = Field(default=0, ge=0, alias="memoryUsedMiB")


class ActivityScript(_ActivityModel):
    """What a GPU does from the moment it is set (see the module docstring)."""

    utilization: int = Field(default=0, ge=0, le=100)
    memory_used_mib: int | None = Field(default=None, ge=0, alias="memoryUsedMiB")  # None: the processes' sum
    power_w: float = Field(default=60.0, ge=0, alias="powerW")
    burst: BurstScript | None = None
    processes: tuple[ProcessScript, ...] = ()
    per_process: bool = Field(default=True, alias="perProcess")
    device_samples: bool = Field(default=True, alias="deviceSamples")

    def busy(self, t: float, since: float) -> bool:
        return self.burst is None or (t - since) % self.burst.every_s < self.burst.busy_s

    def memory_mib(self) -> int:
        return self.memory_used_mib if self.memory_used_mib is not None else sum(p.memory_used_mib
                                                                               for p in self.processes)


IDLE_SCRIPT = ActivityScript()


def fake_gpu_uuid(seed: str, index: int) -> str:
    """Deterministic GPU UUID: the same node name and index always give the same UUID."""
    return f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{seed}/gpu/{index}')}"


def fake_mig_uuid(seed: str, index: int, gpu_instance_id: int) -> str:
    return f"MIG-{uuidlib.uuid5(_UUID_NAMESPACE, f'{seed}/gpu/{index}/gi/{gpu_instance_id}')}"


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(frozen=True, eq=False)
class FakeDeviceHandle:
    """Opaque device handle; `mig` is the position in the parent's MIG list for MIG devices."""

    gpu: int
    mig: int | None = None


@dataclass(frozen=True, eq=False)
class FakeGpuInstanceHandle:
    gpu: int
    gpu_instance_id: int


@dataclass
class FakeEventData:
    """Field-for-field what pynvml's c_nvmlEventData_t carries."""

    device: FakeDeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass(eq=False)
class FakeEventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    offset: int = 0
    line: int = 0  # lines of the events file before `offset`, for messages
    pending: deque[FakeEventData] = field(default_factory=deque)


@dataclass(frozen=True)
class _Mig:
    uuid: str
    profile: str
    gpu_instance_id: int
    compute_instance_id: int
    placement: int


class FakeNvml:
    """Module-like stand-in for `pynvml`, built from a FakeProfile.

    `seed` makes UUIDs unique per node (the node name); `events_file` is the injection channel.
    """

    def __init__(self, profile: FakeProfile | str, *, seed: str | None = None,
                 events_file: str | Path | None = None, poll_interval_s: float = 0.005,
                 clock: Callable[[], float] = time.time) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.clock = clock  # wall seconds: NVML's sample timestamps are microseconds since the epoch
        self.seed = seed or self.profile.name
        self.events_file = Path(events_file) if events_file else None
        self._poll = poll_interval_s
        self._lock = threading.Lock()
        self._init_attempts = 0
        self._initialized = 0
        self._lost: set[int] = set()
        self._start_offset, self._start_line = self._file_end()
        self._activity_offset = self._activity_line = 0
        self._scripts: dict[int, list[tuple[float, ActivityScript]]] = {}  # gpu -> (since, script), in order
        p = self.profile
        self._gpu_uuids = [g.uuid or fake_gpu_uuid(self.seed, g.index) for g in p.gpus]
        self._gpus = [FakeDeviceHandle(g.index) for g in p.gpus]
        self._migs: list[list[_Mig]] = []
        self._mig_handles: list[list[FakeDeviceHandle]] = []
        for g in p.gpus:
            migs = []
            for k, dev in enumerate(g.mig if g.mig_on else ()):
                gi = k + 1
                migs.append(_Mig(dev.uuid or fake_mig_uuid(self.seed, g.index, gi), dev.profile, gi, 0, dev.placement))
            self._migs.append(migs)
            self._mig_handles.append([FakeDeviceHandle(g.index, k) for k in range(len(migs))])

    # -- library -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        with self._lock:
            self._init_attempts += 1
            if self._init_attempts <= self.profile.nvml.init_failures:
                raise _error(getattr(pynvml, f"NVML_ERROR_{self.profile.nvml.init_error}"))
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._require_init()
            self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._require_init()
        return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._require_init()
        return self.profile.cuda_driver_version

    # -- devices -------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDeviceHandle:
        self._require_init()
        if not 0 <= index < len(self._gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDeviceHandle:
        self._require_init()
        for i, u in enumerate(self._gpu_uuids):
            if u == uuid:
                return self._gpus[i]
        for i, migs in enumerate(self._migs):
            for k, m in enumerate(migs):
                if m.uuid == uuid:
                    return self._mig_handles[i][k]
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeDeviceHandle) -> int:
        self._check(handle)
        return handle.gpu

    def nvmlDeviceGetMinorNumber(self, handle: FakeDeviceHandle) -> int:
        self._check(handle)
        return handle.gpu

    def nvmlDeviceGetUUID(self, handle: FakeDeviceHandle) -> str:
        self._check(handle)
        if handle.mig is not None:
            return self._migs[handle.gpu][handle.mig].uuid
        return self._gpu_uuids[handle.gpu]

    def nvmlDeviceGetName(self, handle: FakeDeviceHandle) -> str:
        self._check(handle)
        product = self.profile.gpu_product(handle.gpu)
        if handle.mig is not None:
            return f"{product} MIG {self._migs[handle.gpu][handle.mig].profile}"
        return product

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDeviceHandle, version: int | None = None) -> Any:
        self._check(handle)
        mib = self._mig_spec(handle).memory_mib if handle.mig is not None else self.profile.gpu_memory_mib(handle.gpu)
        mem = pynvml.c_nvmlMemory_t()
        mem.total = mib * 1024 * 1024
        used = 0 if handle.mig is not None else min(self._script_at(handle.gpu, self.clock())[1].memory_mib(), mib)
        mem.used = used * 1024 * 1024
        mem.free = mem.total - mem.used
        return mem

    def nvmlDeviceGetPciInfo(self, handle: FakeDeviceHandle) -> Any:
        self._check(handle)
        return self._pci(self.profile.gpus[handle.gpu].pci_bus_id)

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: FakeDeviceHandle, device2: FakeDeviceHandle) -> int:
        self._check(device1)
        self._check(device2)
        if device1.mig is not None or device2.mig is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.profile.pcie_level(device1.gpu, device2.gpu)

    # -- NVLink --------------------------------------------------------------------------------
    def nvmlDeviceGetNvLinkState(self, device: FakeDeviceHandle, link: int) -> int:
        self._link(device, link)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: FakeDeviceHandle, link: int) -> Any:
        return self._pci(self._link(device, link)[0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeDeviceHandle, link: int) -> int:
        return self._link(handle, link)[1]

    # -- MIG -----------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: FakeDeviceHandle) -> list[int]:
        self._check(device)
        if not self.profile.mig_capable or device.mig is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = int(self.profile.gpus[device.gpu].mig_on)
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeDeviceHandle) -> int:
        self._check(device)
        if not self.profile.mig_capable:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeDeviceHandle, index: int) -> FakeDeviceHandle:
        self._check(device)
        if not self.profile.gpus[device.gpu].mig_on:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(self._mig_handles[device.gpu]):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._mig_handles[device.gpu][index]

    def nvmlDeviceIsMigDeviceHandle(self, device: FakeDeviceHandle) -> int:
        self._check(device)
        return int(device.mig is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: FakeDeviceHandle) -> FakeDeviceHandle:
        self._check(migDevice)
        if migDevice.mig is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpus[migDevice.gpu]

    def nvmlDeviceGetGpuInstanceId(self, device: FakeDeviceHandle) -> int:
        return self._mig_of(device).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: FakeDeviceHandle) -> int:
        return self._mig_of(device).compute_instance_id

    def nvmlDeviceGetAttributes(self, device: FakeDeviceHandle) -> Any:
        spec = self._mig_spec(device)
        attrs = pynvml.c_nvmlDeviceAttributes()
        attrs.gpuInstanceSliceCount = spec.gpu_instance_slices
        attrs.computeInstanceSliceCount = spec.compute_instance_slices
        attrs.multiprocessorCount = 14 * spec.compute_instance_slices
        attrs.memorySizeMB = spec.memory_mib
        return attrs

    nvmlDeviceGetAttributes_v2 = nvmlDeviceGetAttributes

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: FakeDeviceHandle, profile: int, version: int = 2) -> Any:
        self._check(device)
        if not self.profile.mig_capable or device.mig is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for name, spec in self.profile.mig_profiles.items():
            if spec.variant == profile:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id = spec.profile_id
                info.sliceCount = spec.gpu_instance_slices
                info.instanceCount = 7 // spec.gpu_instance_slices
                info.multiprocessorCount = 14 * spec.gpu_instance_slices
                info.memorySizeMB = spec.memory_mib
                info.name = f"MIG {name}".encode()
                return info
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstanceById(self, device: FakeDeviceHandle, gpuInstanceId: int) -> FakeGpuInstanceHandle:
        self._check(device)
        if not any(m.gpu_instance_id == gpuInstanceId for m in self._migs[device.gpu]):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeGpuInstanceHandle(device.gpu, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: FakeGpuInstanceHandle) -> Any:
        self._require_init()
        mig = next(m for m in self._migs[gpuInstance.gpu] if m.gpu_instance_id == gpuInstance.gpu_instance_id)
        spec = self.profile.mig_profiles[mig.profile]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = mig.gpu_instance_id
        info.profileId = spec.profile_id
        info.placement.start = mig.placement
        info.placement.size = spec.placement_size
        return info

    # -- activity ------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: FakeDeviceHandle) -> Any:
        self._check(handle)
        if handle.mig is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = self.clock()
        since, script = self._script_at(handle.gpu, now)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = script.utilization if script.busy(now, since) else 0
        util.memory = util.gpu // 2
        return util

    def nvmlDeviceGetSamples(self, device: FakeDeviceHandle, sampling_type: int, timeStamp: int) -> Any:
        self._check(device)
        if device.mig is not None or sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._script_at(device.gpu, self.clock())[1].device_samples:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        samples = []
        for t_us, since, script in self._sample_grid(device.gpu, timeStamp):
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = t_us
            sample.sampleValue.uiVal = script.utilization if script.busy(t_us / 1e6, since) else 0
            samples.append(sample)
        if not samples:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlDeviceGetProcessUtilization(self, handle: FakeDeviceHandle, timeStamp: int) -> list[Any]:
        self._check(handle)
        if handle.mig is not None or not self._script_at(handle.gpu, self.clock())[1].per_process:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        samples = []
        for t_us, since, script in self._sample_grid(handle.gpu, timeStamp):
            busy = script.busy(t_us / 1e6, since)
            for proc in script.processes:
                sample = pynvml.c_nvmlProcessUtilizationSample_t()
                sample.pid = proc.pid
                sample.timeStamp = t_us
                sample.smUtil = proc.utilization if busy else 0
                sample.memUtil = sample.smUtil // 2
                samples.append(sample)
        if not samples:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)  # what the driver says when no process ran since timeStamp
        return samples

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDeviceHandle) -> list[Any]:
        self._check(handle)
        if handle.mig is not None:
            return []  # a MIG handle lists its own processes; the fake runs none there
        procs = []
        for proc in self._script_at(handle.gpu, self.clock())[1].processes:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid = proc.pid
            info.usedGpuMemory = proc.memory_used_mib * 1024 * 1024
            info.gpuInstanceId = info.computeInstanceId = _NOT_A_MIG_ID
            procs.append(pynvml.nvmlStructToFriendlyObject(info))
        return procs

    def nvmlDeviceGetPowerUsage(self, handle: FakeDeviceHandle) -> int:
        self._check(handle)
        if handle.mig is not None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = self.clock()
        since, script = self._script_at(handle.gpu, now)
        watts = script.power_w if script.busy(now, since) or script.burst is None else min(script.power_w, 60.0)
        return int(watts * 1000)  # milliwatts

    def set_activity(self, uuid: str, script: ActivityScript | dict[str, Any]) -> None:
        """Script a GPU from now on (what an activity line of the events file does; for in-process tests)."""
        if isinstance(script, dict):
            script = ActivityScript.model_validate(script)
        gpu = self._gpu_uuids.index(uuid)
        with self._lock:
            self._scripts.setdefault(gpu, []).append((self.clock(), script))

    # -- events --------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._require_init()
        return FakeEventSet(offset=self._start_offset, line=self._start_line)

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeDeviceHandle) -> int:
        self._check(handle)
        return _SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: FakeDeviceHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._check(handle)
        if eventTypes & ~_SUPPORTED_EVENTS:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        eventSet.registered[handle.gpu] = eventSet.registered.get(handle.gpu, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._require_init()
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            self._drain(eventSet)
            if eventSet.pending:
                return eventSet.pending.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _error(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(self._poll, remaining))

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        eventSet.registered.clear()
        eventSet.pending.clear()

    # -- internals -----------------------------------------------------------------------------
    def _require_init(self) -> None:
        if self._initialized <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _check(self, handle: FakeDeviceHandle) -> None:
        self._require_init()
        if not isinstance(handle, FakeDeviceHandle):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.gpu in self._lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _mig_of(self, device: FakeDeviceHandle) -> _Mig:
        self._check(device)
        if device.mig is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._migs[device.gpu][device.mig]

    def _mig_spec(self, device: FakeDeviceHandle):
        if device.mig is None:
            self._check(device)
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.profile.mig_profiles[self._mig_of(device).profile]

    def _pci(self, bus_id: str) -> Any:
        info = pynvml.nvmlPciInfo_t()
        domain, bus, rest = bus_id.split(":")
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        return info

    def _link(self, device: FakeDeviceHandle, link: int) -> tuple[str, int]:
        """(remote PCI bus id, remote device type) of an active link, or the NVML error."""
        self._check(device)
        p = self.profile
        total = p.links_of(device.gpu)
        if device.mig is not None or total == 0:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < total:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if p.nvswitch:
            switch = link % p.nvswitch.switches
            return f"{0x100 + switch:08X}:00:00.0", pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        seen = 0
        for bridge in p.nvlink_bridges:
            if device.gpu in bridge.gpus:
                if link < seen + bridge.links:
                    peer = bridge.gpus[1] if bridge.gpus[0] == device.gpu else bridge.gpus[0]
                    return p.gpus[peer].pci_bus_id, pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
                seen += bridge.links
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _script_at(self, gpu: int, t: float, *, read: bool = True) -> tuple[float, ActivityScript]:
        """(since, script) in force on a GPU at wall time t (idle when nothing was scripted)."""
        if read:
            self._read_activity()
        with self._lock:
            current: tuple[float, ActivityScript] = (0.0, IDLE_SCRIPT)
            for since, script in self._scripts.get(gpu, ()):
                if since > t:
                    break
                current = (since, script)
            return current

    def _sample_grid(self, gpu: int, after_us: int) -> list[tuple[int, float, ActivityScript]]:
        """The buffered sample instants after `after_us` (microseconds), each with its script."""
        self._read_activity()
        now = self.clock()
        start = max(after_us / 1e6, now - SAMPLE_BUFFER_S)
        k = int(start / SAMPLE_PERIOD_S) + 1
        out = []
        while k * SAMPLE_PERIOD_S <= now:
            t = k * SAMPLE_PERIOD_S
            t_us = int(t * 1e6)
            if t_us > after_us:
                since, script = self._script_at(gpu, t, read=False)
                out.append((t_us, since, script))
            k += 1
        return out

    def _read_activity(self) -> None:
        """Apply the activity lines appended to the events file since the last read."""
        if self.events_file is None:
            return
        with self._lock:
            try:
                with self.events_file.open("rb") as fh:
                    fh.seek(self._activity_offset)
                    chunk = fh.read()
            except OSError:
                return
            end = chunk.rfind(b"\n")
            if end < 0:
                return
            self._activity_offset += end + 1
            now = self.clock()
            for raw in chunk[: end + 1].split(b"\n")[:-1]:
                self._activity_line += 1
                try:
                    line = json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # the event reader reports bad lines
                if not isinstance(line, dict) or "activity" not in line:
                    continue
                uuid = line.get("uuid")
                if uuid not in self._gpu_uuids:
                    log.warning("fake NVML events file %s:%d: activity for %r, not a GPU of this node (MIG devices "
                                "are not scripted); line ignored", self.events_file, self._activity_line,
                                str(uuid)[:80])
                    continue
                try:
                    script = ActivityScript.model_validate(line["activity"])
                except ValidationError as exc:
                    why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                    log.warning("fake NVML events file %s:%d: bad activity (%s); line ignored", self.events_file,
                                self._activity_line, why)
                    continue
                self._scripts.setdefault(self._gpu_uuids.index(uuid), []).append((now, script))

    def _file_end(self) -> tuple[int, int]:
        """(size, complete lines) of the events file now: events written before start-up are history."""
        if self.events_file is None:
            return 0, 0
        try:
            data = self.events_file.read_bytes()
        except OSError:
            return 0, 0
        end = data.rfind(b"\n") + 1
        return end, data.count(b"\n", 0, end)

    def _drain(self, event_set: FakeEventSet) -> None:
        """Read complete new lines of the events file into the set's queue."""
        if self.events_file is None:
            return
        try:
            with self.events_file.open("rb") as fh:
                fh.seek(event_set.offset)
                chunk = fh.read()
        except OSError:
            return  # not there (yet), or not a file: nothing injected
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        event_set.offset += end + 1
        for raw in chunk[: end + 1].split(b"\n")[:-1]:
            event_set.line += 1
            if not raw.strip():
                continue
            problem = self._apply(event_set, raw)
            if problem is not None:
                log.warning("fake NVML events file %s:%d: %s; line ignored", self.events_file, event_set.line, problem)

    def _apply(self, event_set: FakeEventSet, raw: bytes) -> str | None:
        """Queue the event one line describes; what is wrong with the line, or None."""
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, deep nesting
            return f"not a JSON object ({exc})"
        if not isinstance(line, dict):
            return f"not a JSON object (a {type(line).__name__})"
        if "activity" in line:
            return None  # a scripted activity, not an event (read by _read_activity)
        uuid = line.get("uuid")
        if not isinstance(uuid, str):
            return "no \"uuid\" string"
        try:
            handle = self.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            return f"no GPU or MIG device {uuid[:80]!r} on this node"
        if "lost" in line:
            if not isinstance(line["lost"], bool):
                return "\"lost\" must be true or false"
            with self._lock:
                (self._lost.add if line["lost"] else self._lost.discard)(handle.gpu)
            return None
        kind = "xid" if "xid" in line else line.get("event", "")
        event_type = _EVENT_NAMES.get(kind) if isinstance(kind, str) else None
        if event_type is None:
            known = ", ".join(["xid", *(f"event={k}" for k in _EVENT_NAMES if k != "xid"), "lost"])
            return f"unknown event kind {str(kind)[:40]!r} (known: {known})"
        xid = line.get("xid", 0)
        if kind == "xid" and not (type(xid) is int and 0 < xid < 2**32):
            return f"\"xid\" must be a positive integer, got {str(xid)[:40]!r}"
        if not event_set.registered.get(handle.gpu, 0) & event_type:
            return None
        gi = ci = _NOT_A_MIG_ID
        if handle.mig is not None:
            mig = self._migs[handle.gpu][handle.mig]
            gi, ci = mig.gpu_instance_id, mig.compute_instance_id
        event_set.pending.append(FakeEventData(self._gpus[handle.gpu], event_type, xid, gi, ci))
        return None
