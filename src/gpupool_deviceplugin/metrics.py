"""Prometheus metrics and the /metrics + /healthz HTTP endpoint of the device plugin."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)
NS = "gpupool_deviceplugin"


class PluginMetrics:
    """All metrics of one plugin process, in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.devices = Gauge(f"{NS}_devices", "Devices advertised to the kubelet", ["resource", "health"], registry=r)
        self.gpu_healthy = Gauge(f"{NS}_gpu_hardware_healthy", "1 when NVML reports no unrecovered error",
                                 ["uuid", "index"], registry=r)
        self.gpu_mode = Gauge(f"{NS}_gpu_mode", "1 for the GPU's current pool mode", ["uuid", "mode"], registry=r)
        self.allocations = Counter(f"{NS}_allocations_total", "Allocate calls per container",
                                   ["resource", "via", "result"], registry=r)
        self.allocate_seconds = Histogram(f"{NS}_allocate_seconds", "Allocate handling time", ["resource"],
                                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5),
                                          registry=r)
        self.preferred = Counter(f"{NS}_preferred_allocations_total", "GetPreferredAllocation answers",
                                 ["resource", "source"], registry=r)
        self.registrations = Counter(f"{NS}_registrations_total", "Register calls to the kubelet",
                                     ["resource", "result"], registry=r)
        self.handshake_failures = Counter(f"{NS}_handshake_failures_total",
                                          "Allocations refused or mis-matched by the assignment handshake",
                                          ["resource", "reason"], registry=r)
        self.handshake_ambiguous = Counter(f"{NS}_handshake_ambiguous_total",
                                           "Requests that matched pending containers of several pods",
                                           ["resource", "call"], registry=r)
        self.health_events = Counter(f"{NS}_health_events_total", "NVML health events", ["kind", "action"],
                                     registry=r)
        self.health_recoveries = Counter(f"{NS}_health_recoveries_total", "Devices returned to Healthy",
                                         registry=r)
        self.nvml_init_failures = Counter(f"{NS}_nvml_init_failures_total", "Failed NVML start-ups", registry=r)
        self.node_patches = Counter(f"{NS}_node_patches_total", "Node label/annotation patches", ["result"],
                                    registry=r)
        self.ack_patches = Counter(f"{NS}_ack_patches_total", "Pod ack annotation patch attempts", ["result"],
                                   registry=r)
        self.acks_pending = Gauge(f"{NS}_acks_pending", "Acks waiting to be written (retried until written)",
                                  registry=r)
        self.relists = Counter(f"{NS}_pod_relists_total", "Full lists of the node's pods", ["reason"], registry=r)
        self.pod_resources_calls = Counter(f"{NS}_pod_resources_calls_total", "kubelet PodResources List calls",
                                           ["purpose", "result"], registry=r)
        self.reconcile_corrections = Counter(f"{NS}_reconcile_corrections_total",
                                             "Allocation records corrected to what the kubelet reports", ["kind"],
                                             registry=r)
        self.allocation_checks = Counter(f"{NS}_allocation_checks_total",
                                         "Allocations checked against the kubelet's PodResources records after "
                                         "Allocate: confirmed (corrected first if they differed), or unconfirmed "
                                         "within the check window", ["result"], registry=r)
        self.kubelet_restarts = Counter(f"{NS}_kubelet_restarts_total", "kubelet.sock re-creations seen",
                                        registry=r)
        self.registered = Gauge(f"{NS}_registered", "1 while the resource is registered with the running "
                                "kubelet (0: not yet, being re-registered, or kubelet.sock is gone)", ["resource"],
                                registry=r)
        pod_gpu = ["namespace", "pod", "uuid"]
        self.pod_idle_seconds = Gauge(f"{NS}_pod_gpu_idle_seconds", "Seconds since the pod's last activity on the "
                                      "GPU (engine activity at or above the threshold, or memory used moving by "
                                      "more than the allowed change)", pod_gpu, registry=r)
        self.pod_idle = Gauge(f"{NS}_pod_gpu_idle", "1 while the pod is idle on the GPU under the definition "
                              "(idle for the whole window, past its start grace)", pod_gpu, registry=r)
        self.pod_activity = Gauge(f"{NS}_pod_gpu_activity_percent", "The pod's highest engine activity on the GPU "
                                  "since the previous sample (the GPU's own when per-process samples cannot be "
                                  "attributed)", pod_gpu, registry=r)
        self.pod_memory_used = Gauge(f"{NS}_pod_gpu_memory_used_bytes", "GPU memory the pod's processes use (the "
                                     "GPU's whole used memory when per-process data cannot be attributed)", pod_gpu,
                                     registry=r)
        self.pod_attribution = Gauge(f"{NS}_pod_gpu_attribution", "1 for how the pod's activity on the GPU is "
                                     "measured: process (its own processes) or device (the whole GPU's)",
                                     [*pod_gpu, "via"], registry=r)
        self.gpu_activity = Gauge(f"{NS}_gpu_activity_percent", "The GPU's highest engine activity since the "
                                  "previous sample", ["uuid"], registry=r)
        self.gpu_memory_used = Gauge(f"{NS}_gpu_memory_used_bytes", "GPU memory used", ["uuid"], registry=r)
        self.gpu_power = Gauge(f"{NS}_gpu_power_watts", "GPU power draw", ["uuid"], registry=r)
        self.idle_pods = Gauge(f"{NS}_idle_pods", "Pods idle on every GPU they hold on this node", registry=r)
        self.idle_samples = Counter(f"{NS}_idle_samples_total", "NVML activity readings of a GPU", ["result"],
                                    registry=r)
        self.node_info = Gauge(f"{NS}_node_info", "Always 1; names the node this plugin serves (for joins "
                               "on instance)", ["node"], registry=r)


class StatusServer:
    """Serves /metrics and /healthz on a background thread. `health()` returns (ok, detail)."""

    def __init__(self, metrics: PluginMetrics, health: Callable[[], tuple[bool, str]],
                 address: str, port: int) -> None:
        registry = metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path.startswith("/healthz"):
                    ok, detail = health()
                    self._send(200 if ok else 503, (detail + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
