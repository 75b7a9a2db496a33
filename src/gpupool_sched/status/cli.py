"""`gpupool status` and `kubectl gpupool status` (the `kubectl-gpupool` executable kubectl's plugin
mechanism finds on $PATH): one read of nodes, pods and PriorityClasses (get/list only: no watch, no
lease, no write), printed as a table or as JSON."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from gpupool_sched.errors import OneLineParser, UserError
from gpupool_sched.kube.cli_args import add_kubeconfig, add_memory_unit

NEEDS = "get/list on nodes, pods and priorityclasses.scheduling.k8s.io"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="what every GPU holds, pending pods by priority, fragmentation (read-only)",
        description="Per node and GPU: model, whole / shared / free, memory units, MIG layout, health; "
        "pending GPU pods by priority; the cluster's GPU fragmentation (docs/status.md). Needs only " + NEEDS + ".",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_kubeconfig(p)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="table (80 columns) or json")
    p.add_argument("--node", metavar="NAME", help="also list this node's GPUs one per line (pods, units, MIG)")
    p.add_argument("--wide", action="store_true", help="list every node's GPUs; never shorten names")
    p.add_argument("-l", "--selector", metavar="LABELS",
                   help="only nodes matching this label selector (e.g. pool=train); figures cover those nodes")
    p.add_argument("--scheduler-name", default="gpupool",
                   help="pending pods with this spec.schedulerName count (besides any asking for a GPU)")
    add_memory_unit(p, help_text="MiB per nvidia.com/gpu-memory unit; the scheduler's --memory-unit-mib")


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.status.collect import collect
    from gpupool_sched.status.render import render_table

    listing, server = read_cluster(args.kubeconfig, args.selector)
    status = collect(listing, scheduler_name=args.scheduler_name, memory_unit_mib=args.memory_unit_mib,
                     server=server, selector=args.selector)
    if args.node and all(n.name != args.node for n in status.nodes):
        scope = f" matching {args.selector!r}" if args.selector else ""
        raise UserError(f"no node {args.node!r}{scope}")
    if args.output == "json":
        sys.stdout.write(status.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(render_table(status, node=args.node, wide=args.wide))
    return 0


def read_cluster(kubeconfig: str | None, selector: str | None) -> tuple[Any, str]:
    """One LIST each of PriorityClasses, nodes and pods; any failure becomes one UserError line."""
    from kubernetes.client.exceptions import ApiException

    from gpupool_sched.kube.connection import kube_client, root_cause, server_version
    from gpupool_sched.kube.kubeapi import ApiError, KubeApi
    from gpupool_sched.status.collect import Listing

    logging.getLogger("gpupool_sched").setLevel(logging.ERROR)  # what the state would log is in the report
    api_client, host = kube_client(kubeconfig)
    api = KubeApi(api_client, workers=1, component="gpupool-status")
    urllib3_log = logging.getLogger("urllib3")
    urllib3_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line we print
    try:
        server_version(api, host)
        objects: dict[str, list[dict[str, Any]]] = {}
        for what, path, params in (
            ("priorityclasses", "/apis/scheduling.k8s.io/v1/priorityclasses", ()),
            ("nodes", "/api/v1/nodes", (("labelSelector", selector),) if selector else ()),
            ("pods", "/api/v1/pods", ()),
        ):
            try:
                objects[what], _ = api.list_raw_sync(path, params=params)
            except ApiException as exc:
                error = ApiError.from_exception(exc)
                hint = f"; gpupool status needs {NEEDS}" if error.status in (401, 403) else ""
                raise UserError(f"listing {what} failed: {error}{hint}") from None
            except Exception as exc:
                raise UserError(f"listing {what} from {host} failed: {root_cause(exc)}") from None
    finally:
        api.close()
        api_client.close()
    return Listing(objects["nodes"], objects["pods"], objects["priorityclasses"]), host


def kubectl_main(argv: list[str] | None = None) -> int:
    """`kubectl gpupool status ...`: kubectl runs `kubectl-gpupool status ...`."""
    from gpupool_sched.cli import finish_parsers, parse, version

    parser = OneLineParser(prog="kubectl gpupool", description="gpupool, as a kubectl plugin")
    parser.add_argument("--version", action="version", version=f"gpupool {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    finish_parsers(parser)
    args = parse(parser, argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"kubectl gpupool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("gpupool"):
            raise
        print(f"kubectl gpupool {args.command}: error: needs the 'server' extra (Python package "
              f"{exc.name!r} is not installed): pip install 'gpupool[server]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
