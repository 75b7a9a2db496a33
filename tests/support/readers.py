"""A ServiceAccount that may only read: get and list on every resource of every API group (no watch, no
write), and a kubeconfig with a token of it from the TokenRequest API. Proves a command needs read
verbs only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kubernetes import client

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.kubeconfig import write_kubeconfig

READ_ONLY_RULES = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list"]}]


@contextmanager
def read_only_kubeconfig(kube: ClusterClient, namespace: str, path: Path, role: str) -> Iterator[Path]:
    """`path`: a kubeconfig of ServiceAccount `reader` in `namespace`, bound to ClusterRole `role`
    (READ_ONLY_RULES); the role and its binding are deleted afterwards."""
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    rbac.create_cluster_role({"metadata": {"name": role}, "rules": READ_ONLY_RULES})
    try:
        rbac.create_cluster_role_binding({
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        })
        yield account_kubeconfig(kube, namespace, "reader", path)
    finally:
        for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            with contextlib.suppress(client.ApiException):
                delete(role)


def account_kubeconfig(kube: ClusterClient, namespace: str, account: str, path: Path) -> Path:
    """`path`: a kubeconfig with a fresh token of a new ServiceAccount `account` (no role of its own)."""
    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = str(kube.core.create_namespaced_service_account_token(account, namespace, request).status.token)
    write_kubeconfig(path, server=kube.server, ca_cert=kube.cluster.layout.pki.ca_cert,
                     user=f"system:serviceaccount:{namespace}:{account}", token=token, cluster_name=kube.cluster.name)
    return path
