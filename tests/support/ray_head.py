"""A private Ray head on 127.0.0.1 for tests: `ray start --head --block` in its own process group, with
PYTHONPATH set so that its workers import this checkout's gpupool; stopped by killing that group (never
`ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def ray_head(num_cpus: int = 2, timeout: float = 120.0) -> Iterator[str]:
    """Yields the head's GCS address (127.0.0.1:PORT) once a driver can connect to it."""
    ray_bin = Path(sys.executable).parent / "ray"
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="gpupool-ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
           f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
           f"--temp-dir={temp}"]
    log = open(temp / "head.log", "wb")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not (temp / "session_latest").exists() or not _gcs_up(port):
            if proc.poll() is not None:
                raise RuntimeError(f"ray head exited ({proc.returncode}): {(temp / 'head.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray head not up after {timeout:.0f}s: {(temp / 'head.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield address
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _gcs_up(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
