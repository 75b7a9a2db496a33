"""Samples NVML every interval on its own thread (never on a gRPC thread), attributes each GPU's activity
to the pods holding it, feeds the idle tracker and publishes metrics and the node's idle pods.

Attribution (docs/idle-and-elastic.md): per-process samples are used for a GPU only when every process
NVML reports on it maps to a pod that holds that GPU (pid -> pod through /proc/<pid>/cgroup, which needs
the host's PID namespace); otherwise the GPU's own activity and memory apply to every tenant. The
fallback can only make a pod look busier than it is, never idler.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpupool_common.inventory import NodeInventory
from gpupool_deviceplugin.idle import IdlePolicy, IdleTracker, Sample
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.nvml.session import ActivityReading, NvmlSession

log = logging.getLogger(__name__)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class Tenant:
    uid: str
    namespace: str
    name: str
    started: float | None = None  # the latest start of its running containers (epoch s); None: none runs


def tenants_from_book(book: Any) -> dict[str, tuple[Tenant, ...]]:
    """GPU UUID -> the live pods holding it whole or sharing it, from the AdmissionBook (pods assigned the
    GPU count from their bind: their containers may not run yet, see Tenant.started)."""
    by_key: dict[str, Any] = {}
    for pod in sorted(book.pods(), key=lambda p: p.created):
        if not pod.terminal:
            by_key[pod.key] = pod  # a re-created pod of the same name: the newest
    tenancy = book.tenancy()
    out: dict[str, tuple[Tenant, ...]] = {}
    for gpu in set(tenancy.whole) | set(tenancy.shared):
        keys = sorted(set(tenancy.whole.get(gpu, ())) | set(tenancy.shared.get(gpu, ())))
        out[gpu] = tuple(Tenant(by_key[k].uid, by_key[k].namespace, by_key[k].name, by_key[k].started)
                         for k in keys if k in by_key)
    return out


def pod_uid_of_pid(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The pod UID in a process's cgroup path (kubepods.slice/...pod<uid>.slice or kubepods/.../pod<uid>),
    None when the process is not visible (another PID namespace) or not in a pod."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found = _POD_UID.search(text)
    return found.group(1).replace("_", "-") if found else None


def attribute(reading: ActivityReading | None, tenants: tuple[Tenant, ...],
              uid_of_pid: Callable[[int], str | None]) -> tuple[dict[str, tuple[float | None, int | None]], str]:
    """Per tenant UID, (activity %, memory bytes) on this GPU, and how: "process" (every process NVML lists
    belongs to a tenant: each tenant gets its own processes' highest utilisation and memory) or "device" (the
    GPU's own figures for every tenant: some process is nobody's we know, none is listed, or the GPU is busy
    while no process's samples show it).

    A GPU NVML could not read (None): every tenant's activity is unknown, which counts as activity."""
    if reading is None:
        return {t.uid: (None, None) for t in tenants}, "device"
    if reading.processes is not None and reading.process_memory is not None:
        pids = set(reading.processes) | set(reading.process_memory)
        owners = {pid: uid_of_pid(pid) for pid in pids}
        mine = {t.uid for t in tenants}
        # no process listed says nothing about who keeps the engine busy: the device's figures then
        if owners and all(owner in mine for owner in owners.values()):
            out: dict[str, tuple[float | None, int | None]] = {}
            for t in tenants:
                own = [pid for pid, owner in owners.items() if owner == t.uid]
                activity = max((reading.processes.get(pid, 0.0) for pid in own), default=0.0)
                used = [reading.process_memory.get(pid) for pid in own]
                memory = None if any(u is None for u in used) else sum(u for u in used if u is not None)
                out[t.uid] = (activity, memory)
            # a busy engine that no process's samples show (they lag, or a process is not listed): the
            # per-process view does not explain the GPU, so it is not used
            device_busy = reading.activity_pct is None or reading.activity_pct > 0
            if not device_busy or any(a for a, _ in out.values()):
                return out, "process"
    return {t.uid: (reading.activity_pct, reading.memory_used) for t in tenants}, "device"


class IdleSampler:
    def __init__(self, session: NvmlSession, inventory: NodeInventory,
                 tenants: Callable[[], Mapping[str, tuple[Tenant, ...]]], policy: IdlePolicy, interval_s: float,
                 metrics: PluginMetrics, *, uid_of_pid: Callable[[int], str | None] = pod_uid_of_pid,
                 on_idle_pods: Callable[[dict[str, float]], None] | None = None, publish_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.session = session
        self.gpus = [g.uuid for g in inventory.gpus if not g.mig_enabled]  # MIG devices: not measured yet
        self.tenants = tenants
        self.tracker: IdleTracker[tuple[str, str]] = IdleTracker(policy)
        self.interval_s = interval_s
        self.metrics = metrics
        self.uid_of_pid = uid_of_pid
        self.on_idle_pods = on_idle_pods
        self.publish_interval_s = publish_interval_s
        self.clock = clock
        self.wall = wall
        self._seen: dict[str, tuple[int, int]] = {}  # GPU -> (device, process) newest sample timestamps
        self._labels: dict[tuple[str, str], tuple[str, str, str]] = {}  # (uid, gpu) -> metric labels
        self._idle_since: dict[str, float] = {}  # pod UID -> wall time it became idle (stable while idle)
        self._published: dict[str, float] | None = None
        self._published_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-sampler", daemon=True)
        self.rounds = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        log.info("idle sampling every %gs (window %gs, activity < %g %%, memory within %g %%, start grace %gs)",
                 self.interval_s, self.tracker.policy.window_s, self.tracker.policy.threshold_pct,
                 self.tracker.policy.memory_change_pct, self.tracker.policy.start_grace_s)
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a bug or a driver surprise must not end sampling for good
                self.metrics.idle_samples.labels(result="error").inc()
                log.exception("idle sampling round failed; continuing")
            self._stop.wait(self.interval_s)

    def read(self, uuid: str) -> ActivityReading | None:
        device_since, process_since = self._seen.get(uuid, (0, 0))
        try:
            reading = self.session.read_activity(self.session.handle_by_uuid(uuid), device_since, process_since)
        except pynvml.NVMLError as exc:
            self.metrics.idle_samples.labels(result="error").inc()
            log.debug("idle sampling: GPU %s: %s", uuid, exc)
            return None
        self._seen[uuid] = (reading.device_seen_us, reading.process_seen_us)
        self.metrics.idle_samples.labels(result="ok").inc()
        return reading

    def sample_once(self) -> None:
        """One round: read every GPU, attribute, track, publish."""
        now = self.clock()
        tenants = self.tenants()
        m = self.metrics
        live: set[tuple[str, str]] = set()
        for uuid in self.gpus:
            reading = self.read(uuid)
            if reading is not None:
                self._gpu_gauge(m.gpu_activity, uuid, reading.activity_pct)
                self._gpu_gauge(m.gpu_memory_used, uuid, reading.memory_used)
                self._gpu_gauge(m.gpu_power, uuid, reading.power_w)
            on_gpu = tenants.get(uuid, ())
            per_pod, how = attribute(reading, on_gpu, self.uid_of_pid)
            wall = self.wall()
            for t in on_gpu:
                key = (t.uid, uuid)
                live.add(key)
                activity, memory = per_pod[t.uid]
                starting = t.started is None or wall - t.started < self.tracker.policy.start_grace_s
                # not running yet (an image pull), or in its start grace: never evidence of idleness
                self.tracker.observe(key, Sample(now, None if starting else activity, memory))
                labels = self._labels[key] = (t.namespace, t.name, uuid)
                state = self.tracker.state(key, now)
                assert state is not None
                m.pod_idle_seconds.labels(*labels).set(state.idle_s)
                m.pod_idle.labels(*labels).set(int(state.idle))
                self._pod_gauge(m.pod_activity, labels, activity)
                self._pod_gauge(m.pod_memory_used, labels, memory)
                for via in ("process", "device"):
                    m.pod_attribution.labels(*labels, via).set(int(via == how))
        for key in self.tracker.retain(live):
            gone = self._labels.pop(key, None)
            if gone is not None:
                for gauge in (m.pod_idle_seconds, m.pod_idle, m.pod_activity, m.pod_memory_used):
                    _remove(gauge, *gone)
                for via in ("process", "device"):
                    _remove(m.pod_attribution, *gone, via)
        self.rounds += 1
        self._publish(now)

    def idle_pods(self, now: float) -> dict[str, float]:
        """Pod UID -> wall time it became idle, for pods idle on every GPU they hold here."""
        by_pod: dict[str, list[float]] = {}
        busy: set[str] = set()
        for key in self.tracker.tracked():
            uid = key[0]
            state = self.tracker.state(key, now)
            if state is None or not state.idle:
                busy.add(uid)
            else:
                by_pod.setdefault(uid, []).append(state.idle_s)
        wall = self.wall()
        idle = {uid: min(spans) for uid, spans in by_pod.items() if uid not in busy}
        self._idle_since = {uid: self._idle_since.get(uid, float(int(wall - span))) for uid, span in idle.items()}
        return dict(self._idle_since)

    def _publish(self, now: float) -> None:
        idle = self.idle_pods(now)
        self.metrics.idle_pods.set(len(idle))
        if self.on_idle_pods is None or idle == self._published:
            return
        if now - self._published_at < self.publish_interval_s:
            return  # changed again soon after the last patch: published at a later round
        self._published, self._published_at = idle, now
        self.on_idle_pods(idle)

    @staticmethod
    def _gpu_gauge(gauge: Any, uuid: str, value: float | None) -> None:
        if value is None:
            _remove(gauge, uuid)
        else:
            gauge.labels(uuid).set(value)

    @staticmethod
    def _pod_gauge(gauge: Any, labels: tuple[str, str, str], value: float | None) -> None:
        if value is None:
            _remove(gauge, *labels)
        else:
            gauge.labels(*labels).set(value)


def _remove(gauge: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)
