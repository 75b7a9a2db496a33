"""Writes the plugin's `gpupool.io/allocated` ack annotations on pods, off the gRPC path.

An ack is what opens the scheduler's shape gate and tells it what the kubelet allocated, so it is never
given up while the pod exists: a failed patch is retried with backoff (per pod, so one failing pod does
not hold up the others) until it is written, or until the pod is gone (deleted, replaced by another pod
of the same name, or no longer bound here).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import PodRecord

log = logging.getLogger(__name__)
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 30.0


class AckWriter:
    """Coalesces acks per pod (the latest wins) and patches them, retrying each with backoff.
    `alive(uid)`: whether the pod still exists on this node (an ack for a pod that is gone is dropped)."""

    def __init__(self, api: client.ApiClient, metrics: PluginMetrics, alive: Callable[[str], bool] | None = None,
                 first_retry_s: float = FIRST_RETRY_S, max_retry_s: float = MAX_RETRY_S) -> None:
        self.core = client.CoreV1Api(api)
        self.metrics = metrics
        self.alive = alive
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self._latest: dict[str, tuple[PodRecord, AllocationAck]] = {}
        self._delay: dict[str, float] = {}  # uid -> the next retry delay (after a failure)
        self._due: list[tuple[float, str]] = []  # heap of (monotonic time, uid)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ack-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def submit(self, pod: PodRecord, ack: AllocationAck) -> None:
        with self._cond:
            waiting = pod.uid in self._latest
            self._latest[pod.uid] = (pod, ack)
            if not waiting:  # a pod already waiting keeps its turn (and its backoff) with the newer ack
                heapq.heappush(self._due, (time.monotonic(), pod.uid))
            self.metrics.acks_pending.set(len(self._latest))
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._latest

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._due else max(0.0, self._due[0][0] - time.monotonic()))
                if self._stopping:
                    return
                _, uid = heapq.heappop(self._due)
                item = self._latest.get(uid)
            if item is None:
                continue
            pod, ack = item
            done = self._attempt(pod, ack)
            with self._cond:
                current = self._latest.get(uid)
                if done and current is not None and current[1] is ack:
                    del self._latest[uid]
                    self._delay.pop(uid, None)
                elif done:  # a newer ack arrived while this one was written: write it now
                    self._delay.pop(uid, None)
                    heapq.heappush(self._due, (time.monotonic(), uid))
                else:
                    delay = self._delay.get(uid, self.first_retry_s)
                    self._delay[uid] = min(delay * 2, self.max_retry_s)
                    heapq.heappush(self._due, (time.monotonic() + delay, uid))
                self.metrics.acks_pending.set(len(self._latest))

    def _attempt(self, pod: PodRecord, ack: AllocationAck) -> bool:
        """One patch; True when there is nothing left to do for this ack (written, or the pod is gone)."""
        if self.alive is not None and not self.alive(pod.uid):
            self.metrics.ack_patches.labels(result="gone").inc()
            log.info("ack for pod %s dropped: the pod is gone", pod.key)
            return True
        body = {"metadata": {"uid": pod.uid, "annotations": ack_annotations(ack)}}
        try:
            self.core.patch_namespaced_pod(pod.name, pod.namespace, body, _request_timeout=10,
                                           _content_type="application/merge-patch+json")
            self.metrics.ack_patches.labels(result="ok").inc()
            return True
        except ApiException as exc:
            if exc.status in (404, 409):  # pod gone, or replaced by another with that name (uid precondition)
                self.metrics.ack_patches.labels(result="gone").inc()
                return True
            why = f"{exc.status} {exc.reason}"
        except Exception as exc:
            why = str(exc)
        self.metrics.ack_patches.labels(result="error").inc()
        log.warning("ack on pod %s failed (%s); retrying in %.1fs", pod.key, why,
                    self._delay.get(pod.uid, self.first_retry_s))
        return False
