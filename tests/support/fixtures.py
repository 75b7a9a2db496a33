"""What the shared fixtures do, as context managers: a dev cluster of its own (started, then stopped and
purged) and a fresh namespace (created, then emptied and removed). tests/conftest.py's `kube` and
`namespace` fixtures (and tests/deviceplugin/conftest.py's) are made of these, and so are the fixtures of a
module that needs a cluster of its own (tests/e2e/test_faults.py: its apiserver is restarted and its etcd
compacted, which the session's cluster must not see) or namespaces with labels (tests/e2e/test_quotas.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.errors import DevClusterError


@contextmanager
def private_cluster(name: str, what: str, **up: Any) -> Iterator[ClusterClient]:
    """The dev cluster `name`, started now (`DevCluster.up(**up)`), stopped and purged afterwards. If it
    cannot start, the test fails with "no <what>: <why>" and the cluster's logs are kept."""
    cluster = DevCluster(name)
    try:
        cluster.up(**up)
        handle = ClusterClient.connect(cluster)
    except DevClusterError as exc:
        cluster.down()  # keeps its logs: the error may point at them
        pytest.fail(f"no {what}: {exc}", pytrace=False)
    try:
        yield handle
    finally:
        try:
            handle.close()
        finally:
            cluster.down(purge=True)


def make_namespace(kube: ClusterClient, prefix: str = "e2e", labels: dict[str, str] | None = None) -> str:
    """A new namespace `<prefix>-<8 hex digits>` with `labels`; its name."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    return name


def drop_namespace(kube: ClusterClient, name: str) -> None:
    """Remove a namespace with everything in it. The dev cluster runs no namespace controller (no
    kube-controller-manager by default), so its pods are deleted here and its `kubernetes` finalizer is
    released, as that controller would do once the namespace is empty."""
    kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    kube.core.delete_namespace(name)
    try:
        kube.core.replace_namespace_finalize(
            name, client.V1Namespace(metadata=client.V1ObjectMeta(name=name),
                                     spec=client.V1NamespaceSpec(finalizers=[])))
    except ApiException as exc:
        if exc.status != 404:  # already gone: a namespace controller was running
            raise


@contextmanager
def fresh_namespace(kube: ClusterClient, prefix: str = "e2e", labels: dict[str, str] | None = None) -> Iterator[str]:
    """make_namespace, then drop_namespace afterwards."""
    name = make_namespace(kube, prefix, labels)
    try:
        yield name
    finally:
        drop_namespace(kube, name)
