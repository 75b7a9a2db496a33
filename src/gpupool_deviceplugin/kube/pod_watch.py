"""Watches the pods bound to this node (field selector spec.nodeName) into the AdmissionBook.

Lists carry their resourceVersion into the book, which merges them with the watch events by version: a
list whose snapshot predates a bind (a re-list asked for by a gRPC call while the watch delivers the bind)
cannot drop the freshly bound pod or its allocation, and a pod deleted after the snapshot stays deleted."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from gpupool_deviceplugin.admission import AdmissionBook
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import pod_record

log = logging.getLogger(__name__)


class PodWatcher:
    def __init__(self, api: client.ApiClient, node: str, resources: Collection[str], book: AdmissionBook,
                 watch_timeout_s: int = 240, metrics: PluginMetrics | None = None) -> None:
        self.core = client.CoreV1Api(api)
        self.metrics = metrics
        self.node = node
        self.resources = tuple(resources)
        self.book = book
        self.watch_timeout_s = watch_timeout_s
        self._selector = f"spec.nodeName={node}"
        self._stop = threading.Event()
        self._relist_lock = threading.Lock()
        self._last_list_started = 0.0
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self.synced = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        # The reader may sit in a blocking TLS read until the server ends the watch; closing the
        # connection from here can block on the same socket, so only signal and let the daemon
        # thread end with the process.
        self._stop.set()
        self._thread.join(timeout=0.2)

    def relist_now(self, timeout_s: float = 2.0) -> bool:
        """Synchronous re-list (the kubelet can see a new pod before our watch does). Concurrent callers
        share one list if it started after they asked."""
        asked = time.monotonic()
        with self._relist_lock:
            if self._last_list_started >= asked:
                return True
            try:
                self._list(timeout_s, reason="sync")
            except Exception as exc:
                log.warning("re-listing pods of node %s failed: %s", self.node, exc)
                return False
            return True

    def _list(self, timeout_s: float = 10.0, reason: str = "watch") -> str:
        self._last_list_started = time.monotonic()
        if self.metrics is not None:
            self.metrics.relists.labels(reason=reason).inc()
        resp = self.core.list_pod_for_all_namespaces(field_selector=self._selector, _preload_content=False,
                                                     _request_timeout=timeout_s)
        data = json.loads(resp.data)
        version = data["metadata"]["resourceVersion"]
        records = [pod_record(item, self.resources, self.node) for item in data.get("items", ())]
        if not self.book.replace_all(records, version):
            log.info("pod list at resourceVersion %s is older than one already applied; ignored", version)
        self.synced.set()
        return version

    def _run(self) -> None:
        from gpupool_deviceplugin.kube.retrylog import RetryLog

        backoff = 0.5
        version: str | None = None
        retry = RetryLog(log, f"pod watch for node {self.node}")  # one line per state change, not per try
        while not self._stop.is_set():
            try:
                if version is None:
                    with self._relist_lock:
                        version = self._list()
                    retry.succeeded()
                version = self._stream(version)
                backoff = 0.5
            except Exception as exc:
                if self._stop.is_set():
                    return
                retry.failed(exc, backoff)
                version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _stream(self, version: str) -> str | None:
        """Apply watch events from `version`; the version to resume from, or None to re-list."""
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=self._selector, watch=True, resource_version=version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s, _preload_content=False,
            _request_timeout=(10, self.watch_timeout_s + 30))
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return version
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # typically 410 Gone: our version is too old
                    log.info("pod watch ended by the API server (%s); re-listing", obj.get("message", obj))
                    return None
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                record = pod_record(obj, self.resources, self.node)
                if kind == "DELETED":
                    self.book.remove(record.uid, record.resource_version)
                else:
                    self.book.upsert(record)
        finally:
            resp.close()
            resp.release_conn()
        return version
