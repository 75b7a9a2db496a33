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

from gpupool_deviceplugin.config import ConfigError, load_config
from gpupool_deviceplugin.nvml.profile import ProfileError

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool-deviceplugin",
                                description="gpupool kubelet device plugin: whole GPUs, MIG devices, GPU-memory units")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                   help="this node's name (default: $NODE_NAME, else the host name)")
    p.add_argument("--kubelet-dir", type=Path, default=Path(DEFAULT_KUBELET_DIR),
                   help=f"the kubelet's device-plugin directory (default {DEFAULT_KUBELET_DIR})")
    p.add_argument("--config", type=Path, help="plugin config YAML (see docs/deviceplugin.md)")
    p.add_argument("--kubeconfig", help="kubeconfig for running outside the cluster (default: $KUBECONFIG, "
                   "else in-cluster config)")
    p.add_argument("--fake-nvml", metavar="PROFILE",
                   help="use the fake NVML backend with a shipped profile name or a profile YAML path")
    p.add_argument("--fake-nvml-events", metavar="FILE", default=os.environ.get("GPUPOOL_FAKE_NVML_EVENTS"),
                   help="JSON-lines file the fake NVML backend reads injected health events from")
    p.add_argument("--metrics-port", type=int, help="override metrics.port from the config (0: any free port)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("gpupool_deviceplugin")
    try:
        config = load_config(args.config)
        if args.metrics_port is not None:
            metrics = config.metrics.model_copy(update={"port": args.metrics_port})
            config = config.model_copy(update={"metrics": metrics})
    except ConfigError as exc:
        print(f"gpupool-deviceplugin: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    if not args.kubelet_dir.is_dir():
        print(f"gpupool-deviceplugin: kubelet directory {args.kubelet_dir} does not exist", file=sys.stderr)
        return 2

    from gpupool_deviceplugin.daemon import Daemon, DaemonOptions
    from gpupool_deviceplugin.kube.client import KubeUnavailable
    from gpupool_deviceplugin.nvml.session import open_fake, open_real

    try:
        if args.fake_nvml:
            session = open_fake(args.fake_nvml, seed=args.node_name, events_file=args.fake_nvml_events)
            log.info("using the FAKE NVML backend (profile %s)", args.fake_nvml)
        else:
            session = open_real()
    except ProfileError as exc:
        print(f"gpupool-deviceplugin: {exc}", file=sys.stderr)
        return 2

    daemon = Daemon(DaemonOptions(node_name=args.node_name, kubelet_dir=args.kubelet_dir, config=config,
                                  kubeconfig=args.kubeconfig), session)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to stderr
    try:
        return daemon.run()
    except KubeUnavailable as exc:
        print(f"gpupool-deviceplugin: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
