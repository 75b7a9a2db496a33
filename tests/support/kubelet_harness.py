"""The real kubelet device manager, for device plugin tests: a driver for hack/kubelet-harness, a Go program
that links k8s.io/kubernetes/pkg/kubelet/cm/devicemanager of the cluster's pinned release and is steered
with JSON lines on stdin/stdout (see hack/kubelet-harness/main.go for the commands).

Where kubelet_standin.py re-implements the device manager's allocation path in Python, this runs the
kubelet's own code: registration (it dials the plugin back and asks GetDevicePluginOptions), capacity,
devicesToAllocate -> GetPreferredAllocation -> Allocate per container, the runtime options a container is
given, the checkpoint file, a restart (a new manager on the same directory), and optionally the kubelet's
PodResources v1 API served by the kubelet's own server over that manager.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool_devcluster.binaries import kubelet_harness_binary
from gpupool_devcluster.errors import DevClusterError

CHECKPOINT_FILE = "kubelet_internal_checkpoint"


class HarnessError(AssertionError):
    """The harness answered ok=false to a command that was expected to succeed."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The kubelet's admission failed (UnexpectedAdmissionError): the plugin or the manager said no."""

    container: str
    error: str


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What the device manager gives the runtime for one container (DeviceRunContainerOptions)."""

    devices: dict[str, tuple[str, ...]]  # resource -> device IDs held (GetDevices), sorted
    envs: dict[str, str]
    mounts: tuple[dict[str, Any], ...]
    cdi_devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Capacity:
    capacity: dict[str, int]
    allocatable: dict[str, int]
    healthy: dict[str, frozenset[str]]  # resource -> healthy device IDs (GetAllocatableDevices)
    registrations: dict[str, int]  # kubelet_device_plugin_registration_total per resource


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    pod_uid: str
    container: str
    resource: str
    devices: tuple[str, ...]
    devices_by_numa: dict[str, tuple[str, ...]]
    envs: dict[str, str]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    entries: tuple[CheckpointEntry, ...]
    registered: dict[str, frozenset[str]]

    def of(self, pod_uid: str) -> dict[tuple[str, str], CheckpointEntry]:
        return {(e.container, e.resource): e for e in self.entries if e.pod_uid == pod_uid}


def harness_binary() -> Path:
    """The built harness, or an AssertionError that says how to build it (tests fail, never skip)."""
    try:
        return kubelet_harness_binary()
    except DevClusterError as exc:
        raise AssertionError(f"the kubelet device manager harness is missing: {exc}") from None


class KubeletHarness:
    """One harness process serving `directory`/kubelet.sock (and PodResources on `pod_resources`, a socket
    path, when given); its klog output goes to `log_path`."""

    def __init__(self, directory: Path, log_path: Path, *, pod_resources: Path | None = None,
                 binary: Path | None = None, verbosity: int = 4) -> None:
        self.directory = directory
        self.log_path = log_path
        self.pod_resources = pod_resources
        self.args = [str(binary or harness_binary()), "--dir", str(directory), f"--v={verbosity}"]
        if pod_resources is not None:
            self.args += ["--pod-resources", str(pod_resources)]
        self._proc: subprocess.Popen[str] | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()

    # -- process -------------------------------------------------------------------------------
    def start(self, *, sources_ready: bool = True) -> KubeletHarness:
        self._log = self.log_path.open("a")
        self._proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True, name="kubelet-harness-stdout").start()
        self.call("start", sources_ready=sources_ready)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self.call("quit", timeout=10)
                self._proc.wait(10)
            except (AssertionError, subprocess.TimeoutExpired, BrokenPipeError):
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        self._proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # -- protocol ------------------------------------------------------------------------------
    def request(self, op: str, *, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply, whatever `ok` says."""
        assert self._proc is not None and self._proc.stdin is not None, "harness not started"
        self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self._proc.stdin.flush()
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"kubelet harness: no reply to {op} within {timeout}s; log:\n"
                                 f"{self.log()[-3000:]}") from None
        if line is None:
            raise AssertionError(f"kubelet harness exited ({self._proc.wait()}) on {op}; log:\n{self.log()[-3000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, op: str, *, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Send one command that must succeed."""
        reply = self.request(op, timeout=timeout, **fields)
        if not reply.get("ok"):
            raise HarnessError(f"kubelet harness {op}: {reply.get('error')}")
        return reply

    # -- the kubelet's operations --------------------------------------------------------------
    def capacity(self) -> Capacity:
        return _capacity(self.call("capacity"))

    def wait(self, *, capacity: dict[str, int] | None = None, registrations: dict[str, int] | None = None,
             timeout: float = 15.0) -> Capacity:
        """Until GetCapacity reports `capacity` exactly and each resource registered at least as often."""
        return _capacity(self.call("wait", timeout=timeout + 5, capacity=capacity or {},
                                   registrations=registrations or {}, timeout_s=timeout))

    def admit(self, pod: dict[str, Any]) -> dict[str, RunOptions] | Refused:
        """Kubelet admission of a pod (the API server's JSON): Allocate per container, init containers first;
        then each container's run options. A refusal comes back as `Refused`."""
        reply = self.request("admit", pod=pod)
        if not reply.get("ok"):
            return Refused(reply.get("container", ""), reply.get("error", ""))
        return {name: RunOptions(devices={r: tuple(ids) for r, ids in view["devices"].items()},
                                 envs=dict(view["envs"]), mounts=tuple(view["mounts"]),
                                 cdi_devices=tuple(view["cdi_devices"]))
                for name, view in reply["containers"].items()}

    def remove(self, uid: str) -> None:
        """The pod is deleted: it leaves the pod manager; the device manager frees its devices lazily (at the
        next allocation or PodResources List). A pod whose admission failed stays known until removed."""
        self.call("remove", uid=uid)

    def checkpoint(self) -> Checkpoint:
        reply = self.call("checkpoint")
        entries = tuple(CheckpointEntry(e["pod_uid"], e["container"], e["resource"], tuple(e["devices"]),
                                        {k: tuple(v) for k, v in e["devices_by_numa"].items()}, dict(e["envs"]))
                        for e in reply["entries"])
        return Checkpoint(entries, {r: frozenset(ids) for r, ids in reply["registered_devices"].items()})

    def restart(self, *, sources_ready: bool = False) -> None:
        """A kubelet restart: the manager stops, a new one starts on the same directory with every admitted
        container reported running; config sources are not ready until `sources_ready()`."""
        self.call("restart", sources_ready=sources_ready)

    def sources_ready(self) -> None:
        self.call("sources_ready")


def _capacity(reply: dict[str, Any]) -> Capacity:
    return Capacity(capacity=dict(reply["capacity"]), allocatable=dict(reply["allocatable"]),
                    healthy={r: frozenset(ids) for r, ids in reply["healthy_devices"].items()},
                    registrations=dict(reply["registrations"]))
