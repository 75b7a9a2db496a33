"""Finding the API server: in-cluster service account, or a kubeconfig file."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class KubeUnavailable(RuntimeError):
    pass


def connect(mode: str, kubeconfig: str | None):
    """A kubernetes ApiClient, or None when mode is `disabled` / `auto` without any configuration."""
    if mode == "disabled":
        return None
    from kubernetes import client, config

    from gpupool_common.kubeconfig import KubeconfigError, load_kubeconfig

    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        cfg = client.Configuration()
        try:
            load_kubeconfig(path, client_configuration=cfg)
        except KubeconfigError as exc:
            raise KubeUnavailable(str(exc)) from None
        return client.ApiClient(cfg)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        from kubernetes.config.config_exception import ConfigException

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except ConfigException as exc:
            raise KubeUnavailable(f"cannot use the in-cluster service account: {' '.join(str(exc).split())}") from None
        return client.ApiClient(cfg)
    if mode == "required":
        raise KubeUnavailable("kubernetes.mode=required but neither in-cluster config nor a kubeconfig is available")
    return None
