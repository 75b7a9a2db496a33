"""Command-line pieces that `gpupool scheduler` and `gpupool extender` share (`gpupool status` takes a
few): argparse types, the flags they spell alike, and the set-up of their long-running process."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from gpupool_common.clihelp import LOG_LEVELS, log_level

# Every listener of gpupool defaults to 127.0.0.1 on the command line (a local run exposes nothing); the Helm
# chart passes 0.0.0.0 where a pod must be reached (probes, Prometheus, kube-scheduler). docs/observability.md
LISTEN_ADDRESS = "127.0.0.1"


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def at_least(kind: type, floor: float, inclusive: bool) -> Callable[[str], Any]:
    """An argparse type: a `kind` above `floor` (or equal to it, `inclusive`)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not (value >= floor if inclusive else value > floor):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if inclusive else 'positive'}, not {text}")
        return value

    return parse


def positive(kind: type) -> Callable[[str], Any]:
    return at_least(kind, 0, inclusive=False)


def non_negative(kind: type) -> Callable[[str], Any]:
    return at_least(kind, 0, inclusive=True)


def add_kubeconfig(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")


def add_policy(p: argparse.ArgumentParser) -> None:
    from gpupool_sched.placement.registry import POLICIES

    p.add_argument("--policy", default="gpupool", choices=sorted(POLICIES), help="placement policy")


def add_memory_unit(p: argparse.ArgumentParser,
                    help_text: str = "MiB per nvidia.com/gpu-memory unit; must match the device plugin's") -> None:
    p.add_argument("--memory-unit-mib", type=positive(int), default=1024, help=help_text)


def add_gate_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gate-timeout", type=positive(float), default=30.0, metavar="SECONDS",
                   help="how long a bind waits for the device plugin's ack of a same-shape pod on its node")


def add_consistency_check(p: argparse.ArgumentParser, see: str = "") -> None:
    p.add_argument("--consistency-check-interval", type=non_negative(float), default=300.0, metavar="SECONDS",
                   help="re-list every watched kind this often and repair what the watch missed (0: only after "
                        f"a watch gap{see})")


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", type=log_level, choices=LOG_LEVELS, help="any case")


def start_server_process(level: str) -> None:
    """Logging at `level`, and the garbage collector and GIL switch interval of a long-running server:
    once, at process start, before connecting."""
    from gpupool_sched.cache import gcpolicy
    from gpupool_sched.writer.apiwriter import tune_switch_interval

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gcpolicy.tune()
    tune_switch_interval()
