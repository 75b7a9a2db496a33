"""GPU health from NVML events, with recovery.

Xid critical errors and double-bit ECC errors mark the GPU (or, when the event names a GPU instance,
that MIG device) Unhealthy; Xids caused by applications are ignored (config health.ignoredXids).
Unlike NVIDIA's plugin, a device returns to Healthy once it has been quiet for
health.recoveryQuietPeriodSeconds and NVML answers for it normally again; 0 disables recovery.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pynvml

from gpupool_common.inventory import NodeInventory
from gpupool_deviceplugin.board import DeviceBoard
from gpupool_deviceplugin.config import HealthConfig
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.nvml.session import HealthEvent, NvmlSession

log = logging.getLogger(__name__)


@dataclass
class _Bad:
    reason: str
    last_error: float
    next_probe: float


class HealthMonitor:
    def __init__(self, session: NvmlSession, inventory: NodeInventory, board: DeviceBoard,
                 config: HealthConfig, metrics: PluginMetrics) -> None:
        self.session = session
        self.inventory = inventory
        self.board = board
        self.config = config
        self.metrics = metrics
        self._bad: dict[str, _Bad] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        handles = [self.session.handle_by_uuid(g.uuid) for g in self.inventory.gpus]
        event_set, unwatched = self.session.create_event_set(handles)
        if unwatched:
            log.warning("GPUs %s report no critical NVML events; their health is not monitored", unwatched)
        self.ready.set()
        log.info("health monitoring started (ignored Xids %s, recovery after %.0fs quiet)",
                 list(self.config.ignored_xids), self.config.recovery_quiet_period_s)
        try:
            while not self._stop.is_set():
                try:
                    self._step(event_set)
                except Exception:  # a bug or a driver surprise must not end health monitoring for good
                    self.metrics.health_events.labels(kind="monitor_error", action="ignored").inc()
                    log.exception("health monitoring step failed; continuing")
                    self._stop.wait(1.0)
        finally:
            self.session.free_event_set(event_set)

    def _step(self, event_set: object) -> None:
        try:
            event = self.session.wait_event(event_set, self.config.event_wait_ms)
        except pynvml.NVMLError as exc:
            self._on_wait_error(exc)
            event = None
        if event is not None:
            self.handle(event)
        self.recover_due()

    def _on_wait_error(self, exc: pynvml.NVMLError) -> None:
        # e.g. GPU_IS_LOST: NVML no longer tells which GPU, so every GPU is suspect
        log.error("waiting for NVML events failed: %s; marking all GPUs unhealthy", exc)
        for gpu in self.inventory.gpus:
            self._mark(gpu.uuid, f"NVML event wait failed: {exc}", kind="nvml_error")
        self._stop.wait(1.0)

    def handle(self, event: HealthEvent) -> None:
        if self.inventory.gpu_by_uuid(event.gpu_uuid) is None:  # e.g. a GPU that appeared after discovery
            self.metrics.health_events.labels(kind="unknown_device", action="ignored").inc()
            log.warning("NVML event for %s, which is not a GPU of this plugin; ignored", event.gpu_uuid)
            return
        if event.is_xid and event.xid in self.config.ignored_xids:
            self.metrics.health_events.labels(kind="xid", action="ignored").inc()
            log.info("ignoring application Xid %d on %s", event.xid, event.gpu_uuid)
            return
        kind = "xid" if event.is_xid else "double_bit_ecc" if event.is_double_bit_ecc else "other"
        reason = f"Xid {event.xid}" if event.is_xid else kind.replace("_", " ")
        target = self._target(event)
        self._mark(target, reason, kind=kind)

    def _target(self, event: HealthEvent) -> str:
        """The MIG device an event names (by GPU instance / compute instance), else the GPU."""
        if event.gpu_instance_id is None:
            return event.gpu_uuid
        gpu = self.inventory.gpu_by_uuid(event.gpu_uuid)
        for mig in gpu.mig_devices if gpu else ():
            if mig.gpu_instance_id == event.gpu_instance_id and (
                    event.compute_instance_id is None or mig.compute_instance_id == event.compute_instance_id):
                return mig.uuid
        return event.gpu_uuid

    def _mark(self, uuid: str, reason: str, *, kind: str) -> None:
        now = time.monotonic()
        quiet = self.config.recovery_quiet_period_s
        self._bad[uuid] = _Bad(reason, now, now + quiet)
        self.metrics.health_events.labels(kind=kind, action="marked").inc()
        if self.board.mark_unhealthy(uuid, reason):
            log.warning("device %s is Unhealthy: %s", uuid, reason)

    def recover_due(self) -> None:
        quiet = self.config.recovery_quiet_period_s
        if quiet <= 0:
            return
        now = time.monotonic()
        for uuid, bad in list(self._bad.items()):
            if now < bad.next_probe:
                continue
            problem = self.session.probe(uuid)
            if problem is None:
                del self._bad[uuid]
                self.board.mark_healthy(uuid)
                self.metrics.health_recoveries.inc()
                log.info("device %s is Healthy again after %.1fs without errors (was: %s)",
                         uuid, now - bad.last_error, bad.reason)
            else:
                bad.next_probe = now + min(quiet, 10.0)
                log.info("device %s still failing NVML checks: %s", uuid, problem)
