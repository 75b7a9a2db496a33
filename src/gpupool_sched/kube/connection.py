"""The connection to the API server that `gpupool scheduler`, `gpupool extender` and `gpupool status`
make: a kubernetes client from a kubeconfig or the in-cluster service account, checked with a first
request, any failure to reach the server said in one line (a UserError)."""

from __future__ import annotations

import logging
import os
from typing import Any

from gpupool_sched.errors import UserError
from gpupool_sched.kube.kubeapi import DEFAULT_WORKERS, KubeApi


def kube_client(kubeconfig: str | None, pool_size: int = 8) -> tuple[Any, str]:
    """A kubernetes ApiClient and its server's address: `kubeconfig`, else $KUBECONFIG, else the
    in-cluster service account."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    from gpupool_common.kubeconfig import KubeconfigError, load_kubeconfig

    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            load_kubeconfig(path)  # also the default kopf logs in with
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            raise UserError("no cluster: give --kubeconfig, set $KUBECONFIG, or run in a pod")
    except KubeconfigError as exc:
        raise UserError(str(exc)) from None
    except ConfigException as exc:
        raise UserError(f"cannot use the in-cluster service account: {' '.join(str(exc).split())}") from None
    configuration = client.Configuration.get_default_copy()
    # kept-alive connections for the reads (writes have their own, apiwriter.py): past maxsize urllib3
    # opens and discards a new one (TLS) per call
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration), configuration.host


def root_cause(exc: BaseException) -> str:
    """The innermost reason of a client error, e.g. `[Errno 111] Connection refused`."""
    while isinstance(reason := getattr(exc, "reason", None), BaseException):
        exc = reason
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    if "[Errno" in text:
        text = text[text.index("[Errno"):].rstrip("')\"")
    return text[:300]


def server_version(api: KubeApi, host: str) -> str:
    """The API server's version; any failure to reach it is the user's to fix, in one line."""
    try:
        return api.server_version_sync(timeout_s=5.0)
    except Exception as exc:
        raise UserError(f"cannot reach the API server at {host}: {root_cause(exc)}") from None


def connect(kubeconfig: str | None, *, component: str, workers: int = DEFAULT_WORKERS) -> tuple[KubeApi, str, str]:
    """A KubeApi on the cluster, its server's address and version, once the server has answered."""
    api_client, host = kube_client(kubeconfig)
    api = KubeApi(api_client, workers=workers, component=component)
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    urllib3_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        version = server_version(api, host)
    finally:
        urllib3_log.setLevel(level)
    return api, host, version
