"""Writes the plugin's `gpupool.io/allocated` ack annotations on pods, off the gRPC path."""

from __future__ import annotations

import logging
import queue
import threading

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_deviceplugin.handshake import AllocationAck, ack_annotations
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import PodRecord

log = logging.getLogger(__name__)


class AckWriter:
    """Coalesces acks per pod (the latest wins) and patches them with retries."""

    def __init__(self, api: client.ApiClient, metrics: PluginMetrics, attempts: int = 5) -> None:
        self.core = client.CoreV1Api(api)
        self.metrics = metrics
        self.attempts = attempts
        self._latest: dict[str, tuple[PodRecord, AllocationAck]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ack-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def submit(self, pod: PodRecord, ack: AllocationAck) -> None:
        with self._lock:
            fresh = pod.uid not in self._latest
            self._latest[pod.uid] = (pod, ack)
        if fresh:
            self._queue.put(pod.uid)

    def idle(self) -> bool:
        with self._lock:
            return not self._latest

    def _run(self) -> None:
        while True:
            uid = self._queue.get()
            if uid is None:
                return
            with self._lock:
                item = self._latest.pop(uid, None)
            if item is not None:
                self._patch(*item)

    def _patch(self, pod: PodRecord, ack: AllocationAck) -> None:
        body = {"metadata": {"uid": pod.uid, "annotations": ack_annotations(ack)}}
        delay = 0.1
        for attempt in range(1, self.attempts + 1):
            try:
                self.core.patch_namespaced_pod(pod.name, pod.namespace, body, _request_timeout=10,
                                               _content_type="application/merge-patch+json")
                self.metrics.ack_patches.labels(result="ok").inc()
                return
            except ApiException as exc:
                if exc.status in (404, 409, 422):  # pod gone or replaced by another with that name
                    self.metrics.ack_patches.labels(result="gone").inc()
                    return
                log.warning("ack on pod %s failed (attempt %d): %s", pod.key, attempt, exc.reason)
            except Exception as exc:
                log.warning("ack on pod %s failed (attempt %d): %s", pod.key, attempt, exc)
            threading.Event().wait(delay)
            delay = min(delay * 2, 5.0)
        self.metrics.ack_patches.labels(result="error").inc()
