"""`gpupool extender`: serve kube-scheduler's extender verbs with gpupool's placement core."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from gpupool_common.clihelp import LOG_LEVELS, log_level
from gpupool_sched.errors import UserError
from gpupool_sched.scheduler import gcpolicy
from gpupool_sched.scheduler.cli import (
    LISTEN_ADDRESS,
    _kube_client,
    _non_negative,
    _port,
    _positive,
    _root_cause,
)


def register(sub: argparse._SubParsersAction) -> None:
    from gpupool_sched.placement.registry import POLICIES

    p = sub.add_parser(
        "extender",
        help="serve kube-scheduler's extender verbs (filter, prioritize, bind, preempt) with gpupool's core",
        description="An HTTP kube-scheduler extender: kube-scheduler keeps its queue and plugins, gpupool "
        "filters and scores nodes for GPU pods, and binds them with the GPU assignment the device plugin "
        "hands out (docs/extender.md).",
    )
    p.add_argument("--port", type=_port, required=True, help="port of the extender verbs (and /metrics, /healthz)")
    p.add_argument("--address", default=LISTEN_ADDRESS,
                   help="address --port and --metrics-port listen on (0.0.0.0 in a pod, as the Helm chart sets)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")
    p.add_argument("--scheduler-name", default="default-scheduler",
                   help="kube-scheduler's profile whose pods come to the extender (their pending pods are cached)")
    p.add_argument("--policy", default="gpupool", choices=sorted(POLICIES), help="placement policy")
    p.add_argument("--metrics-port", type=_port, default=0,
                   help="a port of its own for /metrics, /healthz and /readyz; 0: off (--port serves them anyway)")
    p.add_argument("--memory-unit-mib", type=_positive(int), default=1024,
                   help="MiB per nvidia.com/gpu-memory unit; must match the device plugin's")
    p.add_argument("--gate-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="how long a bind waits for the device plugin's ack of a same-shape pod on its node")
    p.add_argument("--bind-timeout", type=_positive(float), default=25.0, metavar="SECONDS",
                   help="answer bind with an error after this long (keep it under the extender's httpTimeout)")
    p.add_argument("--consistency-check-interval", type=_non_negative(float), default=300.0, metavar="SECONDS",
                   help="re-list every watched kind this often and repair what the watch missed (0: only after "
                        "a watch gap)")
    p.add_argument("--log-level", default="info", type=log_level, choices=LOG_LEVELS, help="any case")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.extender.core import ExtenderConfig
    from gpupool_sched.scheduler.apiwriter import tune_switch_interval
    from gpupool_sched.scheduler.kubeapi import KubeApi

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gcpolicy.tune()
    tune_switch_interval()
    api_client, host = _kube_client(args.kubeconfig)
    api = KubeApi(api_client, component="gpupool-extender")
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    urllib3_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        api.server_version_sync(timeout_s=5.0)
    except Exception as exc:
        raise UserError(f"cannot reach the API server at {host}: {_root_cause(exc)}") from None
    finally:
        urllib3_log.setLevel(level)
    config = ExtenderConfig(scheduler_name=args.scheduler_name, policy=args.policy,
                            memory_unit_mib=args.memory_unit_mib, gate_timeout_s=args.gate_timeout,
                            bind_timeout_s=args.bind_timeout, consistency_check_s=args.consistency_check_interval,
                            freeze_gc=True)
    try:
        asyncio.run(_serve(config, api, args.address, args.port, args.metrics_port))
    finally:
        api.close()
    return 0


async def _serve(config: object, api: object, address: str, port: int, metrics_port: int) -> None:
    from gpupool_sched.extender.core import Extender
    from gpupool_sched.extender.server import build_app, observability_app, serve
    from gpupool_sched.extender.watch import run_operator

    extender = Extender(config, api)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    apps = [(build_app(extender), port)]
    if metrics_port:
        apps.append((observability_app(extender), metrics_port))
    runners = []
    try:
        for app, p in apps:
            try:
                runners.append(await serve(app, address, p))
            except OSError as exc:
                raise UserError(f"cannot listen on {address}:{p}: {exc.strerror or exc}") from None
        logging.getLogger(__name__).info("extender verbs on http://%s:%d", address, port)
        await run_operator(extender, stop)
    finally:
        for runner in runners:
            await runner.cleanup()
