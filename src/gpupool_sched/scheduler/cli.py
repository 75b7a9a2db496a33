"""`gpupool scheduler` (also `python -m gpupool_sched`): run the GPU scheduler against a cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from typing import Any

from gpupool_common.clihelp import LOG_LEVELS, DefaultsHelpFormatter, log_level
from gpupool_sched.errors import OneLineParser, UserError
from gpupool_sched.scheduler import gcpolicy

# Every listener of gpupool defaults to 127.0.0.1 on the command line (a local run exposes nothing); the Helm
# chart passes 0.0.0.0 where a pod must be reached (probes, Prometheus, kube-scheduler). docs/observability.md
LISTEN_ADDRESS = "127.0.0.1"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scheduler",
        help="run the GPU scheduler: binds pending pods of its scheduler name",
        description="Watch pending pods with spec.schedulerName = --scheduler-name and bind them to nodes and "
        "GPUs chosen by the placement core; the device plugin hands each container exactly those GPUs "
        "(docs/scheduler.md).",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def _at_least(kind: type, floor: float, inclusive: bool) -> Callable[[str], Any]:
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


def _positive(kind: type) -> Callable[[str], Any]:
    return _at_least(kind, 0, inclusive=False)


def _non_negative(kind: type) -> Callable[[str], Any]:
    return _at_least(kind, 0, inclusive=True)


def _percentage(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..100")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gpupool_sched.placement.registry import POLICIES

    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")
    p.add_argument("--scheduler-name", default="gpupool", help="pods with this spec.schedulerName are ours")
    p.add_argument("--policy", default="gpupool", choices=sorted(POLICIES), help="placement policy")
    p.add_argument("--metrics-port", type=_port, default=10251,
                   help="port of /metrics, /healthz and /readyz; 0: off")
    p.add_argument("--metrics-address", default=LISTEN_ADDRESS,
                   help="address the metrics port listens on (0.0.0.0 in a pod, as the Helm chart sets)")
    p.add_argument("--leader-elect", action="store_true", help="run as one of several replicas; only the leader binds")
    p.add_argument("--lease-namespace", default="kube-system", help="namespace of the leader-election Lease")
    p.add_argument("--lease-name", default=None, help="Lease name (default: <scheduler-name>-scheduler)")
    p.add_argument("--lease-duration", type=_positive(float), default=15.0, metavar="SECONDS",
                   help="with --leader-elect: how long a Lease not renewed keeps other replicas from taking it")
    p.add_argument("--renew-deadline", type=_positive(float), default=10.0, metavar="SECONDS",
                   help="with --leader-elect: the leader stops binding when it could not renew for this long "
                        "(less than --lease-duration)")
    p.add_argument("--retry-period", type=_positive(float), default=2.0, metavar="SECONDS",
                   help="with --leader-elect: how often replicas try to take or renew the Lease "
                        "(less than --renew-deadline)")
    p.add_argument("--identity", default=None, help="this replica's name in the Lease (default: hostname_random)")
    p.add_argument("--memory-unit-mib", type=_positive(int), default=1024,
                   help="MiB per nvidia.com/gpu-memory unit; must match the device plugin's")
    p.add_argument("--percentage-of-nodes-to-score", type=_percentage, default=0,
                   help="score this %% of the feasible nodes (0: adaptive, as kube-scheduler; 100: all)")
    p.add_argument("--gate-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="how long a bind waits for the device plugin's ack of a same-shape pod on its node")
    p.add_argument("--bind-workers", type=_positive(int), default=64,
                   help="Bindings (and other writes of the cycle) in flight at once")
    p.add_argument("--event-workers", type=_positive(int), default=16,
                   help="Events and PodScheduled conditions in flight at once, with a limit of their own")
    p.add_argument("--nomination-slack", type=_positive(float), default=60.0, metavar="SECONDS",
                   help="room freed by preemption is held for the preemptor the victims' longest grace "
                        "period plus this")
    p.add_argument("--max-checkpoint-grace", type=_positive(int), default=3600, metavar="SECONDS",
                   help="cap on gpupool.io/checkpoint-grace-seconds: a larger value is clamped (and said in "
                        "the victim's Preempted Event)")
    p.add_argument("--consistency-check-interval", type=_non_negative(float), default=300.0, metavar="SECONDS",
                   help="re-list every watched kind this often and repair what the watch missed (0: only after "
                        "a watch gap; docs/scheduler.md#guarantees-under-faults)")
    p.add_argument("--log-level", default="info", type=log_level, choices=LOG_LEVELS, help="any case")


def _kube_client(kubeconfig: str | None, pool_size: int = 8):
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    from gpupool_common.kubeconfig import KubeconfigError, load_kubeconfig

    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            load_kubeconfig(path)  # also the default kopf logs in with
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            raise UserError("no cluster: give --kubeconfig, set $KUBECONFIG, or run in a pod")
    except KubeconfigError as exc:
        raise UserError(str(exc)) from None
    except ConfigException as exc:
        raise UserError(f"cannot use the in-cluster service account: {' '.join(str(exc).split())}") from None
    configuration = client.Configuration.get_default_copy()
    # kept-alive connections for the reads (writes have their own, apiwriter.py): past maxsize urllib3
    # opens and discards a new one (TLS) per call
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration), configuration.host


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.scheduler.apiwriter import tune_switch_interval
    from gpupool_sched.scheduler.kubeapi import KubeApi
    from gpupool_sched.scheduler.service import SchedulerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gcpolicy.tune()
    tune_switch_interval()
    if not args.retry_period < args.renew_deadline < args.lease_duration:
        raise UserError("need --retry-period < --renew-deadline < --lease-duration")
    api_client, host = _kube_client(args.kubeconfig)
    api = KubeApi(api_client, workers=args.bind_workers, component=args.scheduler_name)
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    urllib3_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        version = api.server_version_sync(timeout_s=5.0)
    except Exception as exc:  # any failure to reach it is the user's to fix, in one line
        raise UserError(f"cannot reach the API server at {host}: {_root_cause(exc)}") from None
    finally:
        urllib3_log.setLevel(level)
    identity = args.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    config = SchedulerConfig(
        scheduler_name=args.scheduler_name,
        policy=args.policy,
        memory_unit_mib=args.memory_unit_mib,
        percentage_of_nodes_to_score=args.percentage_of_nodes_to_score,
        gate_timeout_s=args.gate_timeout,
        bind_workers=args.bind_workers,
        event_workers=args.event_workers,
        leader_elect=args.leader_elect,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name or f"{args.scheduler_name}-scheduler",
        lease_duration_s=args.lease_duration,
        renew_deadline_s=args.renew_deadline,
        retry_period_s=args.retry_period,
        identity=identity,
        nomination_slack_s=args.nomination_slack,
        max_checkpoint_grace_s=args.max_checkpoint_grace,
        consistency_check_s=args.consistency_check_interval,
        freeze_gc=True,
    )
    logging.getLogger(__name__).info("API server %s (%s); scheduler %s, identity %s",
                                     host, version, args.scheduler_name, identity)
    try:
        asyncio.run(_serve(config, api, args.metrics_port, args.metrics_address))
    finally:
        api.close()
    return 0


async def _serve(config: object, api: object, metrics_port: int, metrics_address: str) -> None:
    from gpupool_sched.scheduler.endpoints import start_endpoints
    from gpupool_sched.scheduler.service import SchedulerService
    from gpupool_sched.scheduler.watch import run_operator

    service = SchedulerService(config, api)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    if metrics_port:
        try:
            runner = await start_endpoints(service, metrics_port, metrics_address)
        except OSError as exc:
            raise UserError(f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror or exc}") from None
    try:
        await run_operator(service, stop)
    finally:
        if runner is not None:
            await runner.cleanup()


def _root_cause(exc: BaseException) -> str:
    """The innermost reason of a client error, e.g. `[Errno 111] Connection refused`."""
    while isinstance(reason := getattr(exc, "reason", None), BaseException):
        exc = reason
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    if "[Errno" in text:
        text = text[text.index("[Errno"):].rstrip("')\"")
    return text[:300]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m gpupool_sched", formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(f"gpupool scheduler: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
