"""`gpupool scheduler` (also `python -m gpupool_sched`): run the GPU scheduler against a cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import uuid
from typing import TYPE_CHECKING

from gpupool_common.clihelp import DefaultsHelpFormatter
from gpupool_sched.errors import OneLineParser, UserError
from gpupool_sched.kube import cli_args
from gpupool_sched.placement.candidates import MIN_CANDIDATE_NODES_ABSOLUTE, MIN_CANDIDATE_NODES_PERCENTAGE

if TYPE_CHECKING:
    from gpupool_sched.scheduler.service import SchedulerConfig


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


def _percentage(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..100")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli_args.add_kubeconfig(p)
    p.add_argument("--scheduler-name", default="gpupool", help="pods with this spec.schedulerName are ours")
    cli_args.add_policy(p)
    p.add_argument("--metrics-port", type=cli_args.port_number, default=10251,
                   help="port of /metrics, /healthz and /readyz; 0: off")
    p.add_argument("--metrics-address", default=cli_args.LISTEN_ADDRESS,
                   help="address the metrics port listens on (0.0.0.0 in a pod, as the Helm chart sets)")
    p.add_argument("--leader-elect", action="store_true", help="run as one of several replicas; only the leader binds")
    p.add_argument("--lease-namespace", default="kube-system", help="namespace of the leader-election Lease")
    p.add_argument("--lease-name", default=None, help="Lease name (default: <scheduler-name>-scheduler)")
    p.add_argument("--lease-duration", type=cli_args.positive(float), default=15.0, metavar="SECONDS",
                   help="with --leader-elect: how long a Lease not renewed keeps other replicas from taking it")
    p.add_argument("--renew-deadline", type=cli_args.positive(float), default=10.0, metavar="SECONDS",
                   help="with --leader-elect: the leader stops binding when it could not renew for this long "
                        "(less than --lease-duration)")
    p.add_argument("--retry-period", type=cli_args.positive(float), default=2.0, metavar="SECONDS",
                   help="with --leader-elect: how often replicas try to take or renew the Lease "
                        "(less than --renew-deadline)")
    p.add_argument("--identity", default=None, help="this replica's name in the Lease (default: hostname_random)")
    cli_args.add_memory_unit(p)
    p.add_argument("--percentage-of-nodes-to-score", type=_percentage, default=0,
                   help="score this %% of the feasible nodes (0: adaptive, as kube-scheduler; 100: all)")
    cli_args.add_gate_timeout(p)
    p.add_argument("--bind-workers", type=cli_args.positive(int), default=64,
                   help="Bindings (and other writes of the cycle) in flight at once")
    p.add_argument("--event-workers", type=cli_args.positive(int), default=16,
                   help="Events and PodScheduled conditions in flight at once, with a limit of their own")
    p.add_argument("--scheduled-events", choices=("best-effort", "all"), default="best-effort",
                   help="best-effort: a Scheduled Event that finds the Event queue full is dropped (counted), as "
                        "kube-scheduler's broadcaster drops; all: it waits at the lowest priority and is posted "
                        "later, so every bound pod gets one")
    p.add_argument("--nomination-slack", type=cli_args.positive(float), default=60.0, metavar="SECONDS",
                   help="room freed by preemption is held for the preemptor the victims' longest grace "
                        "period plus this")
    p.add_argument("--max-checkpoint-grace", type=cli_args.positive(int), default=3600, metavar="SECONDS",
                   help="cap on gpupool.io/checkpoint-grace-seconds: a larger value is clamped (and said in "
                        "the victim's Preempted Event)")
    p.add_argument("--preemption-min-candidate-nodes-percentage", type=_percentage,
                   default=MIN_CANDIDATE_NODES_PERCENTAGE, metavar="PERCENT",
                   help="a preemption search stops once it has found this %% of the nodes it could try as "
                        "candidates (kube-scheduler's minCandidateNodesPercentage; docs/preemption.md)")
    p.add_argument("--preemption-min-candidate-nodes-absolute", type=cli_args.non_negative(int),
                   default=MIN_CANDIDATE_NODES_ABSOLUTE, metavar="NODES",
                   help="... but not before it has found this many (minCandidateNodesAbsolute); both 0 is an error")
    p.add_argument("--preemption-search-budget-ms", type=cli_args.positive(float), default=None, metavar="MS",
                   help="a preemption search also stops after this long once it has found one candidate "
                        "(default: no time limit)")
    p.add_argument("--defrag", choices=("on", "off"), default="on",
                   help="move running pods (Deployment/StatefulSet-owned or gpupool.io/movable) so that a pod that "
                        "fits nowhere fits, before preempting anything (docs/defragmentation.md)")
    p.add_argument("--defrag-after", type=cli_args.non_negative(float), default=60.0, metavar="SECONDS",
                   help="a pod waits this long before pods move for it")
    p.add_argument("--defrag-min-runtime", type=cli_args.non_negative(float), default=600.0, metavar="SECONDS",
                   help="pods running for less than this never move")
    p.add_argument("--defrag-max-movers", type=cli_args.positive(int), default=16, metavar="PODS",
                   help="at most this many pods move for one pod")
    p.add_argument("--defrag-budget", type=cli_args.non_negative(int), default=None, metavar="MOVES",
                   help="moves per hour, cluster-wide (default: 1%% of the running GPU pods, at least 1)")
    p.add_argument("--defrag-cooldown", type=cli_args.non_negative(float), default=3600.0, metavar="SECONDS",
                   help="a pod (or its replacement) never moves twice within this")
    p.add_argument("--defrag-surge-timeout", type=cli_args.positive(float), default=300.0, metavar="SECONDS",
                   help="a pod of a Deployment annotated gpupool.io/migrate=surge moves make-before-break: the "
                        "new replica must be Ready within this, else the surge is rolled back")
    p.add_argument("--defrag-background", choices=("off", "idle", "window"), default="off",
                   help="background consolidation: with no pod waiting for GPUs, move movable shared tenants so "
                        "that whole GPUs (then whole nodes) come free, one migration at a time, within the same "
                        "budgets; idle: once no GPU pod has waited for --defrag-background-quiet; window: inside "
                        "--defrag-background-window (docs/defragmentation.md#background-consolidation)")
    p.add_argument("--defrag-background-window", type=_window, default=None, metavar="HH:MM-HH:MM",
                   help="UTC; may wrap midnight (22:00-06:00); equal ends: all day")
    p.add_argument("--defrag-background-quiet", type=cli_args.non_negative(float), default=600.0,
                   metavar="SECONDS", help="idle: no GPU pod has waited for this long")
    p.add_argument("--elastic", choices=("on", "off"), default="on",
                   help="elastic inference: Deployments annotated gpupool.io/elastic-min/-max borrow free GPUs "
                        "and give them back (docs/idle-and-elastic.md#elastic-inference); needs to list and watch "
                        "Deployments and HorizontalPodAutoscalers")
    p.add_argument("--elastic-no-flap", type=cli_args.non_negative(float), default=300.0, metavar="SECONDS",
                   help="a Deployment that gave replicas back is not lent one again within this")
    p.add_argument("--idle-reclaim-action", choices=("none", "report", "reclaimWhenNeeded", "reclaim"),
                   default="none",
                   help="the default idle policy of pods no GpuQuota's spec.idleReclaim governs: none (nothing "
                        "happens), report (an Event), reclaimWhenNeeded (evicted for a pending pod within its "
                        "guarantee or of higher priority), reclaim (evicted once idle past --idle-after) "
                        "(docs/idle-and-elastic.md)")
    p.add_argument("--idle-after", type=_duration, default=3600.0, metavar="DURATION",
                   help="a pod counts as idle too long once its device plugin has listed it idle this long "
                        "(seconds, or like 1h, 30m)")
    p.add_argument("--idle-start-grace", type=cli_args.non_negative(float), default=300.0, metavar="SECONDS",
                   help="a pod started less than this ago is never reclaimed for being idle (as the device "
                        "plugin's --idle-start-grace)")
    p.add_argument("--idle-reclaim-budget", type=cli_args.non_negative(int), default=10, metavar="PODS",
                   help="idle pods reclaimed per hour across the cluster, at most (0: none)")
    cli_args.add_consistency_check(p, see="; docs/scheduler.md#guarantees-under-faults")
    cli_args.add_log_level(p)


def _duration(text: str) -> float:
    from gpupool_sched.framework.plugins.idle import parse_duration

    try:
        return parse_duration(int(text) if text.strip().isdigit() else text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _window(text: str) -> tuple[int, int]:
    from gpupool_sched.framework.plugins.defrag_config import parse_window

    try:
        return parse_window(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.kube.connection import connect

    cli_args.start_server_process(args.log_level)
    identity = args.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    config = scheduler_config(args, identity)  # every flag checked before connecting
    api, host, version = connect(args.kubeconfig, component=args.scheduler_name, workers=args.bind_workers)
    logging.getLogger(__name__).info("API server %s (%s); scheduler %s, identity %s",
                                     host, version, args.scheduler_name, identity)
    try:
        asyncio.run(_serve(config, api, args.metrics_port, args.metrics_address))
    finally:
        api.close()
    return 0


def scheduler_config(args: argparse.Namespace, identity: str) -> SchedulerConfig:
    """The service's configuration from the scheduler's flags (UserError: flags that do not go together).
    `gpupool simulate --from-cluster --candidate` builds its candidate configurations with it too."""
    from gpupool_sched.framework.plugins.defrag_config import DefragConfig
    from gpupool_sched.framework.plugins.idle import IdleReclaimConfig
    from gpupool_sched.scheduler.elastic import ElasticConfig
    from gpupool_sched.scheduler.service import SchedulerConfig

    if not args.retry_period < args.renew_deadline < args.lease_duration:
        raise UserError("need --retry-period < --renew-deadline < --lease-duration")
    if args.preemption_min_candidate_nodes_percentage == 0 and args.preemption_min_candidate_nodes_absolute == 0:
        raise UserError("--preemption-min-candidate-nodes-percentage and -absolute cannot both be 0")
    try:
        defrag = DefragConfig(enabled=args.defrag == "on", after_s=args.defrag_after,
                              min_runtime_s=args.defrag_min_runtime, max_movers=args.defrag_max_movers,
                              per_hour=args.defrag_budget, cooldown_s=args.defrag_cooldown,
                              surge_timeout_s=args.defrag_surge_timeout, background=args.defrag_background,
                              background_window=args.defrag_background_window,
                              background_quiet_s=args.defrag_background_quiet)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return SchedulerConfig(
        scheduler_name=args.scheduler_name,
        policy=args.policy,
        memory_unit_mib=args.memory_unit_mib,
        percentage_of_nodes_to_score=args.percentage_of_nodes_to_score,
        gate_timeout_s=args.gate_timeout,
        event_workers=args.event_workers,
        scheduled_events=args.scheduled_events,
        leader_elect=args.leader_elect,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name or f"{args.scheduler_name}-scheduler",
        lease_duration_s=args.lease_duration,
        renew_deadline_s=args.renew_deadline,
        retry_period_s=args.retry_period,
        identity=identity,
        nomination_slack_s=args.nomination_slack,
        max_checkpoint_grace_s=args.max_checkpoint_grace,
        preemption_min_candidate_nodes_percentage=args.preemption_min_candidate_nodes_percentage,
        preemption_min_candidate_nodes_absolute=args.preemption_min_candidate_nodes_absolute,
        preemption_search_budget_s=(None if args.preemption_search_budget_ms is None
                                    else args.preemption_search_budget_ms / 1000),
        consistency_check_s=args.consistency_check_interval,
        defrag=defrag,
        idle=IdleReclaimConfig(action=args.idle_reclaim_action, idle_after_s=args.idle_after,
                               budget_per_hour=args.idle_reclaim_budget, start_grace_s=args.idle_start_grace),
        freeze_gc=True,
        elastic=ElasticConfig(enabled=args.elastic == "on", no_flap_s=args.elastic_no_flap),
    )


async def _serve(config: object, api: object, metrics_port: int, metrics_address: str) -> None:
    from gpupool_sched.kube.endpoints import start_endpoints
    from gpupool_sched.kube.watch import run_operator
    from gpupool_sched.scheduler.service import SchedulerService

    service = SchedulerService(config, api)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    if metrics_port:
        try:
            runner = await start_endpoints(service.metrics.registry, service.readiness, metrics_port, metrics_address)
        except OSError as exc:
            raise UserError(f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror or exc}") from None
    try:
        await run_operator(service, stop)
    finally:
        if runner is not None:
            await runner.cleanup()


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
