"""Keeps the Node's GPU labels and inventory annotation equal to what the plugin discovered,
patching only when they differ from what is on the Node."""

from __future__ import annotations

import logging
import threading

from kubernetes import client

from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.publication import OWNED_ANNOTATIONS, OWNED_LABELS, NodePublication

log = logging.getLogger(__name__)


def node_patch(node_labels: dict[str, str], node_annotations: dict[str, str],
               publication: NodePublication) -> dict | None:
    """The merge patch that brings the Node to `publication`, or None when nothing differs.
    Owned keys the publication no longer contains are removed (null in a merge patch), except those it
    keeps as they are (`NodePublication.keep`)."""
    labels: dict[str, str | None] = {}
    annotations: dict[str, str | None] = {}
    for key in OWNED_LABELS:
        want = publication.labels.get(key)
        if node_labels.get(key) != want:
            labels[key] = want
    for key in OWNED_ANNOTATIONS:
        if key in publication.keep:
            continue
        want = publication.annotations.get(key)
        if node_annotations.get(key) != want:
            annotations[key] = want
    meta = {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}
    return {"metadata": meta} if meta else None


class NodePublisher:
    def __init__(self, api: client.ApiClient, node: str, publication: NodePublication, metrics: PluginMetrics,
                 refresh_s: float) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.publication = publication
        self.metrics = metrics
        self.refresh_s = refresh_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-publisher", daemon=True)
        self.published = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def update(self, publication: NodePublication) -> None:
        """Publish a new state (e.g. a GPU failed or recovered) now rather than at the next refresh."""
        self.publication = publication
        self._wake.set()

    def sync_once(self) -> bool:
        """True when the Node matches (patched or already equal)."""
        node = self.core.read_node(self.node, _request_timeout=10)
        patch = node_patch(node.metadata.labels or {}, node.metadata.annotations or {}, self.publication)
        if patch is None:
            self.metrics.node_patches.labels(result="unchanged").inc()
            return True
        self.core.patch_node(self.node, patch, _request_timeout=10, _content_type="application/merge-patch+json")
        self.metrics.node_patches.labels(result="patched").inc()
        log.info("published GPU labels/inventory on node %s (%s)", self.node,
                 ", ".join(sorted(k for part in patch["metadata"].values() for k in part)))
        return True

    def _run(self) -> None:
        from gpupool_deviceplugin.kube.retrylog import RetryLog

        backoff = 1.0
        retry = RetryLog(log, f"publishing to node {self.node}")  # one line per state change, not per try
        while not self._stop.is_set():
            try:
                self.sync_once()
                retry.succeeded()
                self.published.set()
                backoff = 1.0
                self._wake.wait(self.refresh_s)
                self._wake.clear()
            except Exception as exc:
                self.metrics.node_patches.labels(result="error").inc()
                retry.failed(exc, backoff)
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, 60.0)
