"""`gpupool-deviceplugin`: the DaemonSet entry point."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pydantic import ValidationError

from gpupool_common.clihelp import LOG_LEVELS, DefaultsHelpFormatter, OneLineParser
from gpupool_deviceplugin.config import ConfigError, IdleConfig, PluginConfig, load_config, read_yaml
from gpupool_deviceplugin.nvml.profile import ProfileError, profile_names

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gpupool")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="gpupool-deviceplugin", formatter_class=DefaultsHelpFormatter,
                                description="gpupool kubelet device plugin: whole GPUs, MIG devices, GPU-memory units")
    p.add_argument("--version", action="version", version=f"gpupool-deviceplugin {version()}")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                   help="this node's name (default: $NODE_NAME, else the host name)")
    p.add_argument("--kubelet-dir", type=Path, default=Path(DEFAULT_KUBELET_DIR),
                   help="the kubelet's device-plugin directory")
    p.add_argument("--config", type=Path, help="plugin config YAML (see docs/deviceplugin.md)")
    p.add_argument("--kubeconfig", help="kubeconfig for running outside the cluster (default: $KUBECONFIG, "
                   "else in-cluster config)")
    p.add_argument("--fake-nvml", metavar="PROFILE",
                   help="use the fake NVML backend with a shipped profile (" + ", ".join(profile_names())
                   + ") or a profile YAML path")
    p.add_argument("--fake-nvml-events", metavar="FILE", default=os.environ.get("GPUPOOL_FAKE_NVML_EVENTS"),
                   help="JSON-lines file the fake NVML backend reads injected health events from")
    p.add_argument("--metrics-port", type=int,
                   help="port of /metrics and /healthz, instead of the config's metrics.port (default 9402); "
                   "0: off (listens on the config's metrics.bindAddress, default 127.0.0.1)")
    p.add_argument("--idle-sample-interval", type=float, metavar="SECONDS",
                   help="sample each GPU's activity every SECONDS for idleness (config idle.sampleIntervalSeconds, "
                   "default 10); 0: off")
    p.add_argument("--idle-window", type=float, metavar="SECONDS",
                   help="a pod is idle after this long without activity (config idle.windowSeconds, default 600)")
    p.add_argument("--idle-threshold", type=float, metavar="PERCENT",
                   help="engine activity below this is no activity (config idle.thresholdPercent, default 1)")
    p.add_argument("--idle-memory-change", type=float, metavar="PERCENT",
                   help="memory used moving by more than this is activity (config idle.memoryChangePercent, "
                   "default 1)")
    p.add_argument("--idle-start-grace", type=float, metavar="SECONDS",
                   help="a pod is never idle in its first SECONDS on a GPU (config idle.startGraceSeconds, "
                   "default 300)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"),
                   help=f"one of {', '.join(LOG_LEVELS)}, any case (default: $LOG_LEVEL, else info)")
    return p


def fail(message: str) -> int:
    """One line on stderr and exit code 2: what every bad input of the plugin gets."""
    print(f"gpupool-deviceplugin: {message}", file=sys.stderr)
    return 2


def check_inputs(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's own values (not the files they name), or None."""
    if args.log_level.strip().lower() not in LOG_LEVELS:
        return (f"unknown log level {args.log_level!r} (--log-level or $LOG_LEVEL): use one of "
                f"{', '.join(LOG_LEVELS)} (any case)")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port must be 0..65535 (0: off), got {args.metrics_port}"
    if not args.kubelet_dir.is_dir():
        what = "is not a directory" if args.kubelet_dir.exists() else "does not exist"
        return (f"kubelet directory {args.kubelet_dir} {what}: give the kubelet's device-plugin directory "
                f"(--kubelet-dir, default {DEFAULT_KUBELET_DIR}); to try the plugin without a kubelet, "
                f"create an empty one first (mkdir -p {args.kubelet_dir})")
    events = Path(args.fake_nvml_events) if args.fake_nvml_events else None
    if events is not None and events.exists() and not events.is_file():
        return f"fake NVML events file {events} is not a regular file"
    return None


def check_profile(name_or_path: str) -> None:
    """A profile given as a file must be readable YAML text: a directory or a binary file is one clear
    line (ProfileError), not a traceback from deep inside the loader."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            read_yaml(path, "fake NVML profile")
        except ConfigError as exc:
            raise ProfileError(str(exc)) from None


def check_kubeconfig(path: str) -> str | None:
    """What is wrong with the kubeconfig file, before anything starts (one line naming it), or None."""
    from kubernetes import client

    from gpupool_common.kubeconfig import KubeconfigError, load_kubeconfig

    try:
        load_kubeconfig(path, client_configuration=client.Configuration())
    except KubeconfigError as exc:
        return str(exc)
    return None


NVML_LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads (ctypes.CDLL), as NVIDIA's own device plugin does


def nvml_library_problem() -> str | None:
    """Why the real NVML library cannot be loaded, as one paragraph for a person, or None when it loads.
    Its absence is checked before anything starts: in a container it does not appear later (the NVIDIA
    container toolkit injects it when the container is created), so retrying would only hide it."""
    import ctypes

    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        return (f"cannot load NVML: {NVML_LIBRARY}, the NVIDIA driver's management library, is not in this "
                f"container or on its library path ({exc}). On a GPU node the NVIDIA container toolkit injects "
                "it into the container when the container has NVIDIA_VISIBLE_DEVICES=all and "
                "NVIDIA_DRIVER_CAPABILITIES=utility (the chart sets both) and runs under the nvidia runtime: "
                "check that the toolkit is installed and is the node's default runtime (or that the pod's "
                "runtimeClassName selects it), and that the NVIDIA driver is installed. To run the plugin "
                "without a GPU (a dry run), give it a fake NVML profile: --fake-nvml PROFILE "
                "(chart: devicePlugin.fakeNvmlProfile).")
    return None


IDLE_FLAGS = {"idle_sample_interval": "sampleIntervalSeconds", "idle_window": "windowSeconds",
              "idle_threshold": "thresholdPercent", "idle_memory_change": "memoryChangePercent",
              "idle_start_grace": "startGraceSeconds"}


def with_idle_flags(config: PluginConfig, args: argparse.Namespace) -> PluginConfig:
    """The config with the --idle-* flags given applied (validated as the config file's fields are)."""
    given = {field: getattr(args, flag) for flag, field in IDLE_FLAGS.items() if getattr(args, flag) is not None}
    if not given:
        return config
    try:
        idle = IdleConfig.model_validate({**config.idle.model_dump(by_alias=True), **given})
    except ValidationError as exc:
        names = {field: "--" + flag.replace("_", "-") for flag, field in IDLE_FLAGS.items()}
        raise ConfigError("\n".join(f"{names.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}"
                                     for e in exc.errors())) from None
    return config.model_copy(update={"idle": idle})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.kubelet_dir = args.kubelet_dir.absolute()  # gRPC's unix:// target takes no relative path
    problem = check_inputs(args)
    if problem:
        return fail(problem)
    logging.basicConfig(level=args.log_level.strip().upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("gpupool_deviceplugin")
    if args.log_level.strip().lower() != "debug":
        # the client retries each request 3 times and urllib3 warns each time; the plugin's own line (once per
        # state change, kube/retrylog.py) says what failed
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        config = load_config(args.config)
        if args.metrics_port is not None:
            metrics = config.metrics.model_copy(update={"port": args.metrics_port})
            config = config.model_copy(update={"metrics": metrics})
        config = with_idle_flags(config, args)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        return fail(f"invalid configuration: {lines[0]}" if len(lines) == 1
                    else "invalid configuration:\n" + "\n".join(lines))

    kubeconfig = args.kubeconfig or os.environ.get("KUBECONFIG")
    if kubeconfig and config.kubernetes.mode != "disabled":
        problem = check_kubeconfig(kubeconfig)
        if problem:
            return fail(problem)

    from gpupool_deviceplugin.daemon import Daemon, DaemonOptions, StartupError
    from gpupool_deviceplugin.kube.client import KubeUnavailable
    from gpupool_deviceplugin.nvml.session import open_fake, open_real

    try:
        if args.fake_nvml:
            check_profile(args.fake_nvml)
            session = open_fake(args.fake_nvml, seed=args.node_name, events_file=args.fake_nvml_events)
            log.info("using the FAKE NVML backend (profile %s)", args.fake_nvml)
        else:
            problem = nvml_library_problem()
            if problem:
                return fail(problem)
            session = open_real()
    except ProfileError as exc:
        return fail(" ".join(str(exc).split()))

    daemon = Daemon(DaemonOptions(node_name=args.node_name, kubelet_dir=args.kubelet_dir, config=config,
                                  kubeconfig=args.kubeconfig), session)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to stderr
    try:
        return daemon.run()
    except (KubeUnavailable, StartupError) as exc:
        return fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
