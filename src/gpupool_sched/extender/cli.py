"""`gpupool extender`: serve kube-scheduler's extender verbs with gpupool's placement core."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from gpupool_sched.errors import UserError
from gpupool_sched.kube import cli_args

SUMMARY = "serve kube-scheduler's extender verbs (filter, prioritize, bind, preempt) with gpupool's core"
DESCRIPTION = ("An HTTP kube-scheduler extender: kube-scheduler keeps its queue and plugins, gpupool filters and "
               "scores nodes for GPU pods, and binds them with the GPU assignment the device plugin hands out "
               "(docs/extender.md).")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extender", help=SUMMARY, description=DESCRIPTION)
    p.add_argument("--port", type=cli_args.port_number, required=True,
                   help="port of the extender verbs (and /metrics, /healthz)")
    p.add_argument("--address", default=cli_args.LISTEN_ADDRESS,
                   help="address --port and --metrics-port listen on (0.0.0.0 in a pod, as the Helm chart sets)")
    cli_args.add_kubeconfig(p)
    p.add_argument("--scheduler-name", default="default-scheduler",
                   help="kube-scheduler's profile whose pods come to the extender (their pending pods are cached)")
    cli_args.add_policy(p)
    p.add_argument("--metrics-port", type=cli_args.port_number, default=0,
                   help="a port of its own for /metrics, /healthz and /readyz; 0: off (--port serves them anyway)")
    cli_args.add_memory_unit(p)
    cli_args.add_gate_timeout(p)
    p.add_argument("--bind-timeout", type=cli_args.positive(float), default=25.0, metavar="SECONDS",
                   help="answer bind with an error after this long (keep it under the extender's httpTimeout)")
    cli_args.add_consistency_check(p)
    cli_args.add_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.extender.core import ExtenderConfig
    from gpupool_sched.kube.connection import connect

    cli_args.start_server_process(args.log_level)
    api, _, _ = connect(args.kubeconfig, component="gpupool-extender")
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
    from gpupool_sched.kube.watch import run_operator

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
