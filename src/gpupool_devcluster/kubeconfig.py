"""Kubeconfig files for the dev cluster's users and a Python client built from one."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml
from kubernetes import client, config


def write_kubeconfig(path: Path, *, server: str, ca_cert: Path, user: str, token: str, cluster_name: str) -> None:
    """A self-contained kubeconfig (CA embedded) authenticating with a bearer token; mode 0600."""
    cluster = {"server": server, "certificate-authority-data": base64.b64encode(ca_cert.read_bytes()).decode()}
    _write(path, cluster_name, cluster, user, {"token": token})


def write_cert_kubeconfig(
    path: Path, *, server: str, ca_cert: Path, cert: Path, key: Path, user: str, cluster_name: str,
    tls_server_name: str | None = None,
) -> None:
    """A kubeconfig authenticating with a client certificate (files referenced, not embedded), as a
    kubelet's or kube-proxy's; `tls_server_name` checks the serving certificate for that name when the
    address dialled is not in it."""
    cluster = {"server": server, "certificate-authority": str(ca_cert)}
    if tls_server_name:
        cluster["tls-server-name"] = tls_server_name
    _write(path, cluster_name, cluster, user, {"client-certificate": str(cert), "client-key": str(key)})


def _write(path: Path, cluster_name: str, cluster: dict[str, str], user: str, credentials: dict[str, str]) -> None:
    context = f"gpupool-{cluster_name}"
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)


def api_client(kubeconfig: Path, *, pool_size: int = 32) -> client.ApiClient:
    """A `kubernetes` client for `kubeconfig` whose connection pool serves `pool_size` threads at once."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)
