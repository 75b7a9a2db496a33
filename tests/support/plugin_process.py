"""The device plugin as a real process (`gpupool-deviceplugin --fake-nvml ...`), for tests and benchmarks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support.ports import free_port

_PORT = re.compile(r"metrics and healthz on http://[^:]+:(\d+)")


def plugin_command() -> list[str]:
    script = Path(sys.executable).parent / "gpupool-deviceplugin"
    if script.exists():
        return [str(script)]
    found = shutil.which("gpupool-deviceplugin")
    return [found] if found else [sys.executable, "-m", "gpupool_deviceplugin.cli"]


class PluginProcess:
    def __init__(self, workdir: Path, kubelet_dir: Path, profile: str | None, *, node: str = "node-a",
                 config: dict[str, Any] | None = None, kubeconfig: Path | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.workdir = workdir
        self.kubelet_dir = kubelet_dir
        self.events = workdir / "nvml-events.jsonl"
        self.log_path = workdir / f"plugin-{node}.log"
        self.config_path = workdir / f"plugin-{node}.yaml"
        cfg = {"metrics": {"port": free_port(), "bindAddress": "127.0.0.1"}, **(config or {})}
        if kubeconfig is None:
            cfg.setdefault("kubernetes", {"mode": "disabled"})
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.events.touch()
        fake = ["--fake-nvml", profile, "--fake-nvml-events", str(self.events)] if profile else []  # None: real NVML
        self.args = [*plugin_command(), *fake, "--node-name", node, "--kubelet-dir", str(kubelet_dir),
                     "--config", str(self.config_path), *(extra_args or [])]
        if kubeconfig is not None:
            self.args += ["--kubeconfig", str(kubeconfig)]
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> PluginProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
        self._log = self.log_path.open("ab")
        self._log_offset = self._log.tell()  # several processes may share a log file: read our part only
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self

    def log(self) -> str:
        with self.log_path.open("rb") as fh:
            fh.seek(getattr(self, "_log_offset", 0))
            return fh.read().decode(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 20.0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log())
            if m:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"plugin exited with {self.proc.returncode} before /{pattern}/:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"/{pattern}/ not in the plugin log within {timeout}s:\n{self.log()[-4000:]}")

    def metrics_port(self) -> int:
        if self.port is None:
            self.port = int(self.wait_log(_PORT.pattern).group(1))
        return self.port

    def http(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.metrics_port()}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def wait_healthz(self, status: int = 200, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            code, body = self.http("/healthz")
            if code == status or time.monotonic() > deadline:
                assert code == status, f"/healthz stayed {code} {body!r}"
                return body
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample on /metrics (0 when absent)."""
        _, text = self.http("/metrics")
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', head))
            if head.split("{")[0] == name and all(sample_labels.get(k) == v for k, v in labels.items()):
                return float(value)
        return 0.0

    def inject(self, **event: Any) -> None:
        """Append one fake NVML event (see gpupool_deviceplugin.nvml.fake)."""
        with self.events.open("a") as fh:
            fh.write(json.dumps(event) + "\n")

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no cleanup, sockets stay behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def plugin_counter(plugin: PluginProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on the plugin's /metrics whose labels include `labels`."""
    _, text = plugin.http("/metrics")
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if line.startswith("#") or head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
