"""Without --fake-nvml and without libnvidia-ml.so.1 (a container the NVIDIA container toolkit did not
inject it into, a machine without the driver) the plugin exits at once with one paragraph saying what is
missing, who provides it on a GPU node and what the dry-run option is: no traceback, no silent retry loop
(the library does not appear later in a running container)."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.plugin_process import plugin_command


def _nvml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_loads(), reason="libnvidia-ml.so.1 loads on this machine (a GPU host): nothing is missing")
def test_missing_nvml_library_is_one_paragraph_and_exit_2(tmp_path: Path) -> None:
    kubelet_dir = tmp_path / "device-plugins"
    kubelet_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "LD_LIBRARY_PATH")}
    done = subprocess.run([*plugin_command(), f"--kubelet-dir={kubelet_dir}", "--metrics-port=0"],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("gpupool-deviceplugin: cannot load NVML: libnvidia-ml.so.1, the NVIDIA driver's "
                           "management library, is not in this container or on its library path (")
    for needed in ("NVIDIA container toolkit", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility",
                   "--fake-nvml PROFILE", "devicePlugin.fakeNvmlProfile"):
        assert needed in line
    assert not list(kubelet_dir.iterdir()), "nothing started: no socket left behind"
