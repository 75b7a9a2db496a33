"""The narrow NVML interface of gpupool: the only module that calls NVML functions.

`lib` is either the real `pynvml` module or a `FakeNvml`; both expose the same functions and raise
`pynvml.NVMLError`. Everything else in the device plugin talks to `NvmlSession`, never to `lib`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpupool_deviceplugin.nvml.numa import NumaReader, SysfsNuma, TableNuma

NOT_A_MIG_ID = 0xFFFFFFFF
# Events that can make a device unusable; single-bit ECC errors are corrected by hardware.
CRITICAL_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError


@dataclass(frozen=True)
class NvLinkEnd:
    """The far end of one active NVLink."""

    remote_bus_id: str
    remote_is_switch: bool | None  # None: the driver cannot tell


@dataclass(frozen=True)
class MigInfo:
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    gpu_instance_slices: int
    compute_instance_slices: int
    memory_mib: int
    placement_start: int | None
    placement_size: int | None
    profile_variant: int | None  # NVML_GPU_INSTANCE_PROFILE_* of its GPU instance, when readable


@dataclass(frozen=True)
class HealthEvent:
    """One NVML event, resolved to the GPU's UUID (and GI/CI when it names a MIG device)."""

    gpu_uuid: str
    event_type: int
    xid: int
    gpu_instance_id: int | None
    compute_instance_id: int | None

    @property
    def is_xid(self) -> bool:
        return bool(self.event_type & pynvml.nvmlEventTypeXidCriticalError)

    @property
    def is_double_bit_ecc(self) -> bool:
        return bool(self.event_type & pynvml.nvmlEventTypeDoubleBitEccError)


_NO_SUCH_READING = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
_SAMPLE_FIELDS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


@dataclass(frozen=True)
class ActivityReading:
    """One sampling round of one GPU (see `NvmlSession.read_activity`)."""

    activity_pct: float | None   # highest device utilisation since the last round; None: unknown
    source: str                  # "samples" (the driver's buffer), "rates" (one current value) or "unknown"
    processes: dict[int, float] | None  # pid -> highest SM utilisation since the last round; None: unavailable
    process_memory: dict[int, int | None] | None  # running compute processes: pid -> bytes; None: unavailable
    memory_used: int | None
    memory_total: int | None
    power_w: float | None
    device_seen_us: int   # newest device sample timestamp: pass it back next round
    process_seen_us: int  # newest per-process sample timestamp: pass it back next round


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_code(exc: pynvml.NVMLError) -> int:
    return int(getattr(exc, "value", -1))


class NvmlSession:
    """Discovery and events through NVML. Thread-safe for one event watcher plus other callers."""

    def __init__(self, lib: Any, numa: NumaReader) -> None:
        self.lib = lib
        self.numa = numa
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def init(self) -> None:
        self.lib.nvmlInit()

    def shutdown(self) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            self.lib.nvmlShutdown()

    def driver_version(self) -> str | None:
        try:
            return _text(self.lib.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            return None

    def cuda_driver_version(self) -> int | None:
        try:
            return int(self.lib.nvmlSystemGetCudaDriverVersion())
        except pynvml.NVMLError:
            return None

    # -- GPUs ------------------------------------------------------------------------------------
    def gpu_handles(self) -> list[Any]:
        return [self.lib.nvmlDeviceGetHandleByIndex(i) for i in range(self.lib.nvmlDeviceGetCount())]

    def handle_by_uuid(self, uuid: str) -> Any:
        return self.lib.nvmlDeviceGetHandleByUUID(uuid)

    def uuid(self, handle: Any) -> str:
        return _text(self.lib.nvmlDeviceGetUUID(handle))

    def name(self, handle: Any) -> str:
        return _text(self.lib.nvmlDeviceGetName(handle))

    def memory_mib(self, handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)

    def pci_bus_id(self, handle: Any) -> str:
        return _text(self.lib.nvmlDeviceGetPciInfo(handle).busId).upper()

    def numa_node(self, bus_id: str) -> int | None:
        return self.numa(bus_id)

    def topology_level(self, a: Any, b: Any) -> int:
        """NVML_TOPOLOGY_* level of the closest common ancestor of two GPUs."""
        return int(self.lib.nvmlDeviceGetTopologyCommonAncestor(a, b))

    def nvlinks(self, handle: Any) -> list[NvLinkEnd]:
        """Active NVLinks of a GPU; [] when the GPU has none or NVML does not support NVLink on it."""
        ends: list[NvLinkEnd] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if self.lib.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(self.lib.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).upper()
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                break  # past the GPU's last link, or no NVLink at all
            try:
                kind = self.lib.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
                is_switch: bool | None = kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                is_switch = None  # old driver: the caller decides from the remote bus id
            ends.append(NvLinkEnd(remote, is_switch))
        return ends

    # -- MIG -------------------------------------------------------------------------------------
    def mig_capable_and_enabled(self, handle: Any) -> tuple[bool, bool]:
        """(MIG supported, MIG currently enabled)."""
        try:
            current, _pending = self.lib.nvmlDeviceGetMigMode(handle)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return False, False
        return True, current == pynvml.NVML_DEVICE_MIG_ENABLE

    def _profile_variants(self, handle: Any) -> dict[int, int]:
        """GPU instance profile ID (as in nvmlGpuInstanceInfo_t) -> NVML_GPU_INSTANCE_PROFILE_* variant."""
        variants: dict[int, int] = {}
        for variant in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
            try:
                info = self.lib.nvmlDeviceGetGpuInstanceProfileInfo(handle, variant)
            except pynvml.NVMLError:
                continue  # variant not supported by this product
            variants[int(info.id)] = variant
        return variants

    def mig_devices(self, handle: Any) -> list[MigInfo]:
        out: list[MigInfo] = []
        variants = self._profile_variants(handle)
        for index in range(self.lib.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = self.lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except pynvml.NVMLError_NotFound:
                continue  # MIG device slots may be sparse
            attrs = self.lib.nvmlDeviceGetAttributes(mig)
            gi = int(self.lib.nvmlDeviceGetGpuInstanceId(mig))
            start = size = variant = None
            try:
                info = self.lib.nvmlGpuInstanceGetInfo(self.lib.nvmlDeviceGetGpuInstanceById(handle, gi))
                start, size = int(info.placement.start), int(info.placement.size)
                variant = variants.get(int(info.profileId))
            except (pynvml.NVMLError_NoPermission, pynvml.NVMLError_NotSupported):
                pass  # placement needs privileges on some drivers; profile and memory do not
            out.append(MigInfo(
                uuid=self.uuid(mig),
                gpu_instance_id=gi,
                compute_instance_id=int(self.lib.nvmlDeviceGetComputeInstanceId(mig)),
                gpu_instance_slices=int(attrs.gpuInstanceSliceCount),
                compute_instance_slices=int(attrs.computeInstanceSliceCount),
                memory_mib=int(attrs.memorySizeMB),
                placement_start=start,
                placement_size=size,
                profile_variant=variant,
            ))
        return out

    # -- health ----------------------------------------------------------------------------------
    def create_event_set(self, handles: Sequence[Any]) -> tuple[Any, list[str]]:
        """An event set with critical events registered on each GPU that supports them.

        Returns the set and the UUIDs of GPUs that support no critical event (left unwatched)."""
        event_set = self.lib.nvmlEventSetCreate()
        unwatched = []
        for handle in handles:
            try:
                supported = self.lib.nvmlDeviceGetSupportedEventTypes(handle) & CRITICAL_EVENTS
                if supported:
                    self.lib.nvmlDeviceRegisterEvents(handle, supported, event_set)
                    continue
            except pynvml.NVMLError_NotSupported:
                pass
            unwatched.append(self.uuid(handle))
        return event_set, unwatched

    def wait_event(self, event_set: Any, timeout_ms: int) -> HealthEvent | None:
        """The next event, or None on timeout. Raises NVMLError for anything else."""
        try:
            data = self.lib.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return HealthEvent(
            gpu_uuid=self.uuid(data.device),
            event_type=int(data.eventType),
            xid=int(data.eventData),
            gpu_instance_id=None if gi == NOT_A_MIG_ID else gi,
            compute_instance_id=None if ci == NOT_A_MIG_ID else ci,
        )

    def free_event_set(self, event_set: Any) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            self.lib.nvmlEventSetFree(event_set)

    # -- activity --------------------------------------------------------------------------------
    def read_activity(self, handle: Any, device_since_us: int = 0, process_since_us: int = 0) -> ActivityReading:
        """Engine activity, memory and power of one GPU since the previous round.

        Device activity: the highest of the driver's buffered utilisation samples newer than
        `device_since_us` (nvmlDeviceGetSamples), so that a burst between two rounds is seen; where the
        driver keeps no such buffer (NOT_SUPPORTED) or has no new sample (NOT_FOUND), the current value of
        nvmlDeviceGetUtilizationRates; None where neither answers (MIG devices). Per process: the highest SM
        utilisation of each pid in nvmlDeviceGetProcessUtilization's samples newer than `process_since_us`
        (NOT_FOUND: no process ran a kernel since, {}), None where unsupported. Raises NVMLError for anything
        else (a lost GPU)."""
        activity: float | None = None
        source = "unknown"
        device_seen = device_since_us
        try:
            kind, samples = self.lib.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                          device_since_us)
            name = _SAMPLE_FIELDS.get(kind)
            if samples and name is not None:
                activity = float(max(getattr(s.sampleValue, name) for s in samples))
                device_seen = max(device_since_us, *(int(s.timeStamp) for s in samples))
                source = "samples"
        except (*_NO_SUCH_READING, pynvml.NVMLError_NotFound):
            pass
        if activity is None:
            try:
                activity = float(self.lib.nvmlDeviceGetUtilizationRates(handle).gpu)
                source = "rates"
            except _NO_SUCH_READING:
                pass
        sampled: dict[int, float] = {}
        processes: dict[int, float] | None = sampled
        process_seen = process_since_us
        try:
            for s in self.lib.nvmlDeviceGetProcessUtilization(handle, process_since_us):
                pid = int(s.pid)
                sampled[pid] = max(sampled.get(pid, 0.0), float(s.smUtil))
                process_seen = max(process_seen, int(s.timeStamp))
        except pynvml.NVMLError_NotFound:
            pass  # no process sampled since: none ran a kernel
        except _NO_SUCH_READING:
            processes = None
        try:
            running = self.lib.nvmlDeviceGetComputeRunningProcesses(handle)
            process_memory: dict[int, int | None] | None = {
                int(p.pid): None if p.usedGpuMemory is None else int(p.usedGpuMemory) for p in running}
        except _NO_SUCH_READING:
            process_memory = None
        memory = self.lib.nvmlDeviceGetMemoryInfo(handle)
        try:
            power: float | None = int(self.lib.nvmlDeviceGetPowerUsage(handle)) / 1000
        except _NO_SUCH_READING:
            power = None
        return ActivityReading(activity, source, processes, process_memory, int(memory.used), int(memory.total),
                               power, device_seen, process_seen)

    def probe(self, uuid: str) -> str | None:
        """None when NVML answers normally for this device, else the NVML error text."""
        try:
            handle = self.lib.nvmlDeviceGetHandleByUUID(uuid)
            self.lib.nvmlDeviceGetMemoryInfo(handle)
            self.lib.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError as exc:
            return f"{exc} (NVML error {_nvml_code(exc)})"
        return None


def open_real(sysfs_root: Path = Path("/sys")) -> NvmlSession:
    """The real library (libnvidia-ml.so.1 through pynvml); NUMA from sysfs."""
    return NvmlSession(pynvml, SysfsNuma(sysfs_root))


def open_fake(profile: str | Path, *, seed: str | None = None, events_file: str | Path | None = None) -> NvmlSession:
    """The fake library for a profile; NUMA from the profile (the fake machine's sysfs)."""
    from gpupool_deviceplugin.nvml.fake import FakeNvml

    fake = FakeNvml(str(profile), seed=seed, events_file=events_file)
    table = {g.pci_bus_id: g.numa_node for g in fake.profile.gpus}
    return NvmlSession(fake, TableNuma(table))
