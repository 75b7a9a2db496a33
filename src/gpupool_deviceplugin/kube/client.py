"""Finding the API server: in-cluster service account, or a kubeconfig file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class KubeUnavailable(RuntimeError):
    pass


def connect(mode: str, kubeconfig: str | None):
    """A kubernetes ApiClient, or None when mode is `disabled` / `auto` without any configuration."""
    if mode == "disabled":
        return None
    from kubernetes import client, config

    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        if not Path(path).is_file():
            raise KubeUnavailable(f"kubeconfig {path} does not exist")
        cfg = client.Configuration()
        config.load_kube_config(config_file=path, client_configuration=cfg)
        return client.ApiClient(cfg)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    if mode == "required":
        raise KubeUnavailable("kubernetes.mode=required but neither in-cluster config nor a kubeconfig is available")
    return None
