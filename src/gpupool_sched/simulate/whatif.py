"""`gpupool simulate --from-cluster`: what each policy would do now with the live cluster's pending pods
(and a synthetic continuation drawn from its recent mix), decided by the scheduler service itself on a
copy of the cluster (simulate/dryrun.py). Reads only: get/list, no watch, no write."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

from gpupool_common.clihelp import one_line
from gpupool_sched.errors import OneLineParser, UserError
from gpupool_sched.kube.cli_args import add_kubeconfig, add_memory_unit

NEEDS = ("get/list on nodes, pods, namespaces, priorityclasses, poddisruptionbudgets, podgroups, gpuquotas, "
         "jobs, deployments and horizontalpodautoscalers (configmaps too for --policy current)")
POLICY_CONFIGMAPS = "/api/v1/configmaps"
CHART_SELECTOR = "app.kubernetes.io/name=gpupool,app.kubernetes.io/component=scheduler"
TRACE_FLAGS = ("nodes", "pods", "event_order", "plot", "bound", "sample_percentage")
DEFAULT_CONTINUE = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "what-if on the live cluster",
        "--from-cluster: the scheduler service decides for the cluster's pending pods (and --continue "
        "synthetic ones) on a copy of the cluster, once per --policy ('current': the policy in the Helm "
        "chart's scheduler ConfigMap); nothing is written. --json - prints the JSON on stdout.")
    group.add_argument("--from-cluster", action="store_true",
                       help="what-if on the live cluster instead of a trace (docs/simulator.md)")
    add_kubeconfig(group)  # type: ignore[arg-type]
    group.add_argument("--scheduler-name", default="gpupool", help="the scheduler whose pending pods are decided")
    add_memory_unit(group, help_text="MiB per nvidia.com/gpu-memory unit; the scheduler's --memory-unit-mib")  # type: ignore[arg-type]
    group.add_argument("--continue", dest="continue_pods", type=int, default=DEFAULT_CONTINUE, metavar="N",
                       help=f"then N synthetic pods drawn (--seed) from the recent mix (default {DEFAULT_CONTINUE})")
    group.add_argument("--defrag", choices=("on", "off"), default="on",
                       help="the scheduler's --defrag: may pods move to make room (--from-cluster and --mode "
                            "time; default on, as the scheduler)")
    group.add_argument("--candidate", action="append", default=[], metavar="FLAGS",
                       help="also a candidate configuration: the flags of `gpupool scheduler`, quoted as one "
                            "argument, e.g. --candidate='--policy fgd --defrag off' (repeatable; a row each)")


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.simulate.cli import MAX_SEED, check_output

    given = [f"--{f.replace('_', '-')}" for f in TRACE_FLAGS if getattr(args, f, None) not in (None, False)]
    if given:
        raise UserError(f"--from-cluster reads the cluster, not a trace: drop {', '.join(given)}")
    if args.continue_pods < 0:
        raise UserError(f"--continue must be 0 or more, got {args.continue_pods}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UserError(f"--seed must be in 0..{MAX_SEED}, got {args.seed}")
    to_stdout = args.json is not None and str(args.json) == "-"
    if args.json is not None and not to_stdout:
        check_output("--json", args.json)
    wanted = _policy_items(args.policy)
    candidates = [(f"[{flags.strip()}]", candidate_config(flags, args.scheduler_name)) for flags in args.candidate]

    from gpupool_sched.kube.connection import kube_client, server_version
    from gpupool_sched.simulate.dryrun import DryRunApi

    logging.getLogger("gpupool_sched").setLevel(logging.ERROR)  # the service's own logging is not the answer
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    api_client, host = kube_client(args.kubeconfig)
    api = DryRunApi(api_client)
    try:
        server_version(api, host)
        outcomes = asyncio.run(_what_if(api, args, wanted, candidates, host))
    finally:
        api.close()
        api_client.close()

    from rich.console import Console

    from gpupool_sched.simulate.whatif_report import render_table, report_json

    payload = report_json(outcomes, server=host, scheduler_name=args.scheduler_name, seed=args.seed,
                          continuation=args.continue_pods)
    if to_stdout:
        sys.stdout.write(json.dumps(payload, indent=1) + "\n")
        return 0
    Console(width=None if sys.stdout.isatty() else 160).print(render_table(outcomes))
    for outcome in outcomes:
        if outcome.unsettled:
            print(f"warning: {outcome.policy}: still deciding when the what-if stopped: "
                  f"{', '.join(outcome.unsettled)}", file=sys.stderr)
    if args.json is not None:
        path = Path(args.json)
        try:
            path.write_text(json.dumps(payload, indent=1) + "\n")
        except OSError as exc:
            raise UserError(f"--json {path}: cannot write: {exc.strerror or exc}") from None
        print(f"JSON report: {path}")
    return 0


def _policy_items(value: str) -> list[str]:
    """--policy's names; 'current' stays a name here and is resolved from the cluster."""
    from gpupool_sched.simulate.cli import policy_names

    items = [item.strip() for item in value.split(",")]
    if "none" in items:
        raise UserError("--policy none runs no policy (it goes with --bound, which --from-cluster does not have)")
    out: list[str] = []
    for item in items:
        for name in ["current"] if item == "current" else policy_names(item):
            if name not in out:
                out.append(name)
    return out


async def _what_if(api: Any, args: argparse.Namespace, wanted: list[str], candidates: list[tuple[str, Any]],
                   host: str) -> list[Any]:
    from gpupool_sched.framework.plugins.defrag_config import DefragConfig
    from gpupool_sched.kube.connection import root_cause
    from gpupool_sched.kube.kubeapi import ApiError
    from gpupool_sched.scheduler.service import SchedulerConfig
    from gpupool_sched.simulate.continuation import draw, recent_mix
    from gpupool_sched.simulate.dryrun import PODS, run_what_if

    names = [await current_policy(api) if name == "current" else name for name in wanted]
    names = list(dict.fromkeys(names))
    outcomes = []
    continuation: list[dict[str, Any]] | None = None
    runs = [(name, SchedulerConfig(scheduler_name=args.scheduler_name, policy=name,
                                   memory_unit_mib=args.memory_unit_mib,
                                   defrag=DefragConfig(enabled=args.defrag == "on"))) for name in names]
    for label, config in [*runs, *candidates]:
        try:
            if continuation is None:  # drawn once from the first LIST: every policy gets the same pods
                async for _ in api.list_pages(PODS):
                    pass
                continuation = draw(recent_mix(api.listed(PODS), args.scheduler_name), args.continue_pods, args.seed)
            outcomes.append(await run_what_if(api, config, continuation, label=label))
        except ApiError as exc:
            hint = f"; the what-if needs {NEEDS}" if exc.status in (401, 403) else ""
            what = f"from {host}: {exc.message}" if exc.status == 0 else f": {exc}"
            raise UserError(f"reading the cluster failed{what}{hint}") from None
        except OSError as exc:
            raise UserError(f"reading the cluster from {host} failed: {root_cause(exc)}") from None
    return outcomes


async def current_policy(api: Any) -> str:
    """The policy in the scheduler ConfigMap of the Helm chart (labels `CHART_SELECTOR`, key `policy`)."""
    from gpupool_sched.kube.kubeapi import ApiError
    from gpupool_sched.placement.registry import POLICIES

    try:
        maps, _ = await api.call(api.list_raw_sync, POLICY_CONFIGMAPS, params=(("labelSelector", CHART_SELECTOR),))
    except ApiError as exc:
        raise UserError(f"--policy current: listing ConfigMaps failed: {exc}; name the policy instead "
                        f"(one of {', '.join(POLICIES)})") from None
    return policy_of(maps)


def policy_of(configmaps: list[dict[str, Any]]) -> str:
    """The one policy the chart's scheduler ConfigMaps name (UserError: none, several, an unknown one)."""
    from gpupool_sched.placement.registry import POLICIES

    found = {f"{(m.get('metadata') or {}).get('namespace')}/{(m.get('metadata') or {}).get('name')}":
             str((m.get("data") or {}).get("policy", "")) for m in configmaps if "policy" in (m.get("data") or {})}
    if not found:
        raise UserError(f"--policy current: no scheduler ConfigMap with a 'policy' key ({CHART_SELECTOR}); "
                        f"name the policy instead (one of {', '.join(POLICIES)})")
    policies = set(found.values())
    if len(policies) > 1:
        raise UserError("--policy current: the scheduler ConfigMaps disagree: "
                        + ", ".join(f"{k} says {v!r}" for k, v in sorted(found.items())))
    policy = policies.pop()
    if policy not in POLICIES:
        raise UserError(f"--policy current: {', '.join(sorted(found))} names an unknown policy {policy!r}")
    return policy


class _CandidateParser(OneLineParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(f"--candidate {self.prog!r}: {one_line(message)}")


def candidate_config(flags: str, scheduler_name: str) -> Any:
    """A SchedulerConfig from `gpupool scheduler` flags, as the scheduler builds its own (scheduler/cli.py);
    its scheduler name is the what-if's, and it never elects a leader (it decides alone)."""
    from gpupool_sched.scheduler import cli as scheduler_cli

    try:
        words = shlex.split(flags)
    except ValueError as exc:
        raise UserError(f"--candidate {flags!r}: {exc}") from None
    parser = _CandidateParser(prog=flags.strip(), add_help=False)
    scheduler_cli.add_arguments(parser)
    parsed = parser.parse_args(words)
    config = scheduler_cli.scheduler_config(parsed, identity="whatif")
    return dataclasses.replace(config, scheduler_name=scheduler_name, leader_elect=False, freeze_gc=False)
