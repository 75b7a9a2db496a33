"""The sweep's Ray backend: the same :func:`run_one` as a Ray task per run, on the cluster at ``address``
(``auto``: the one this machine belongs to, as in a KubeRay RayJob; ``ray://host:10001``: a Ray client
connection; ``host:6379``: a head's GCS address). Ray is the optional ``gpupool[ray]`` extra, imported
only here and only when ``--ray`` is given."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool_sched.errors import UserError
from gpupool_sched.simulate.sweep import RunOutput, run_one
from gpupool_sched.simulate.sweep_grid import RunConfig


def import_ray() -> Any:
    try:
        import ray
    except ModuleNotFoundError:
        raise UserError("--ray needs Ray (the 'ray' extra): pip install 'gpupool[ray]'") from None
    return ray


@dataclass(frozen=True, slots=True)
class RayCluster:
    """Runs as Ray tasks of one CPU each; results come back to this process, which writes them."""

    address: str

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """A head's GCS address (HOST:PORT) must answer: Ray itself retries an unreachable one for minutes.
        ``auto`` and ``ray://`` addresses are left to Ray."""
        if self.address == "auto" or "://" in self.address:
            return
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UserError(f"--ray {self.address}: expected auto, ray://HOST:10001 or HOST:PORT")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        except OSError as exc:
            raise UserError(f"--ray {self.address}: cannot connect to the Ray cluster: "
                            f"{exc.strerror or exc}") from None

    def __call__(self, configs: Sequence[RunConfig], done: Callable[[RunOutput], None]) -> None:
        if not configs:
            return
        ray = import_ray()
        try:
            ray.init(address=self.address, logging_level="warning", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"--ray {self.address}: cannot connect to the Ray cluster: {first}") from None
        try:
            task = ray.remote(num_cpus=1)(run_one)
            pending = [task.remote(c) for c in configs]
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    done(ray.get(ref))
        finally:
            ray.shutdown()
