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
    from tests.support.fixtures import private_cluster

    requested = os.environ.get("GPUPOOL_E2E_CLUSTER")
    fresh = os.environ.get("GPUPOOL_E2E_FRESH") == "1"
    shared: DevCluster | None = None
    try:
        if requested:
            shared = DevCluster(requested)
            shared.require_running()
        elif not fresh and DevCluster(DEFAULT_CLUSTER).running_state() is not None:
            shared = DevCluster(DEFAULT_CLUSTER)
        handle = ClusterClient.connect(shared) if shared is not None else None
    except DevClusterError as exc:
        pytest.fail(f"no control plane for the e2e tests: {exc}", pytrace=False)
    if handle is None:
        with private_cluster(f"pytest-{os.getpid()}", "control plane for the e2e tests") as private:
            yield private
        return
    try:
        yield handle
    finally:
        handle.delete_nodes(handle.created_nodes)
        handle.close()


@pytest.fixture
def namespace(kube: ClusterClient) -> Iterator[str]:
    """A fresh namespace, removed after the test with everything in it (tests.support.fixtures)."""
    from tests.support.fixtures import fresh_namespace

    with fresh_namespace(kube) as name:
        yield name


@pytest.fixture(scope="module")
def controller_manager(kube: ClusterClient) -> Iterator[None]:
    """kube-controller-manager on the session's cluster for the module asking for it (its Deployment,
    ReplicaSet and disruption controllers); stopped afterwards if this started it, so later modules see
    the cluster as they expect it."""
    started = kube.cluster.up(optional=["kube-controller-manager"]).started
    yield
    if "kube-controller-manager" in started:
        kube.cluster.stop_optional("kube-controller-manager")
