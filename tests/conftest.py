"""Fixtures shared by every test folder.

`kube` (session-scoped): a running local control plane (etcd + kube-apiserver + kwok, see
docs/dev-cluster.md) and a client for it. Which cluster:
  * GPUPOOL_E2E_CLUSTER=<name>  use that running dev cluster (error if it is not running);
  * else the `default` cluster, if one is running (`make cluster-up`): reused, never stopped;
  * else (or with GPUPOOL_E2E_FRESH=1) a private cluster `pytest-<pid>` with its own ports and files,
    started once for the session and stopped at its end.
Nodes made with `kube.add_nodes` are deleted at the end of the session when the cluster is not private,
so a developer's cluster keeps only what it had. Every test under tests/e2e/ is marked `e2e`.

`namespace` (per test): a fresh namespace on that cluster, emptied and removed afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gpupool_devcluster.client import ClusterClient

_E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def kube() -> Iterator[ClusterClient]:
    from gpupool_devcluster.client import ClusterClient
    from gpupool_devcluster.cluster import DevCluster
    from gpupool_devcluster.errors import DevClusterError
    from gpupool_devcluster.layout import DEFAULT_CLUSTER

    requested = os.environ.get("GPUPOOL_E2E_CLUSTER")
    fresh = os.environ.get("GPUPOOL_E2E_FRESH") == "1"
    private: DevCluster | None = None
    try:
        if requested:
            cluster = DevCluster(requested)
            cluster.require_running()
        elif not fresh and DevCluster(DEFAULT_CLUSTER).running_state() is not None:
            cluster = DevCluster(DEFAULT_CLUSTER)
        else:
            private = cluster = DevCluster(f"pytest-{os.getpid()}")
            cluster.up()
        handle = ClusterClient.connect(cluster)
    except DevClusterError as exc:
        if private is not None:
            private.down()  # keeps its logs: the error may point at them
        pytest.fail(f"no control plane for the e2e tests: {exc}", pytrace=False)
    try:
        yield handle
    finally:
        try:
            if private is None:
                handle.delete_nodes(handle.created_nodes)
            handle.close()
        finally:
            if private is not None:
                private.down(purge=True)


@pytest.fixture
def namespace(kube: ClusterClient) -> Iterator[str]:
    """A fresh namespace, removed after the test with everything in it.

    The dev cluster runs no namespace controller (no kube-controller-manager by default), so the test's
    pods are deleted here and the namespace's `kubernetes` finalizer is released, as that controller
    would do once the namespace is empty."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    kube.core.delete_namespace(name)
    try:
        kube.core.replace_namespace_finalize(
            name, client.V1Namespace(metadata=client.V1ObjectMeta(name=name),
                                     spec=client.V1NamespaceSpec(finalizers=[])))
    except ApiException as exc:
        if exc.status != 404:  # already gone: a namespace controller was running
            raise
