"""deploy/ray/sweep-rayjob.yaml against KubeRay's RayJob CRD (tests/data/kuberay/, vendored) on the real
kube-apiserver: the CRD is installed, the manifest's objects are created with dryRun=All (the server
validates them against the CRD's OpenAPI schema and stores nothing), and a manifest with a field of the
wrong type is refused, which shows the schema is in force. The head and workers run gpupool-ray (the image
tests/image/test_image_ray.py runs a head and the sweep in) with their own probes, which KubeRay then does
not replace with its exec probes (wget, which the image lacks), and rayVersion is the image's Ray."""

from __future__ import annotations

import copy
import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "ray" / "sweep-rayjob.yaml"
CRD = REPO / "tests" / "data" / "kuberay" / "ray.io_rayjobs.yaml.gz"
CRD_NAME = "rayjobs.ray.io"
RAY_LOCK = REPO / "hack" / "image" / "requirements-ray.lock"


@pytest.fixture(scope="module")
def rayjob_crd(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    ext = client.ApiextensionsV1Api(kube.api_client)
    try:
        ext.read_custom_resource_definition(CRD_NAME)
        existed = True
    except ApiException as exc:
        if exc.status != 404:
            raise
        existed = False
    folder = tmp_path_factory.mktemp("kuberay")
    (folder / "ray.io_rayjobs.yaml").write_bytes(gzip.decompress(CRD.read_bytes()))
    install_crds(kube.api_client, folder)
    try:
        yield
    finally:
        if not existed:
            ext.delete_custom_resource_definition(CRD_NAME)


def documents() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


def create_rayjob(kube: ClusterClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    api = client.CustomObjectsApi(kube.api_client)
    created: dict[str, Any] = api.create_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", body, dry_run="All")
    return created


def test_the_sweep_rayjob_passes_the_crd_schema(kube: ClusterClient, namespace: str, rayjob_crd: None) -> None:
    docs = documents()
    assert set(docs) == {"ConfigMap", "RayJob"}
    client.CoreV1Api(kube.api_client).create_namespaced_config_map(namespace, docs["ConfigMap"], dry_run="All")
    created = create_rayjob(kube, namespace, docs["RayJob"])
    spec = created["spec"]
    assert spec["entrypoint"].startswith("gpupool simulate sweep --grid /etc/gpupool-sweep/grid.yaml")
    assert spec["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 4
    assert f"\nray=={spec['rayClusterSpec']['rayVersion']} " in RAY_LOCK.read_text()
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    worker = spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    version = REPO.joinpath("pyproject.toml").read_text().split('version = "', 1)[1].split('"', 1)[0]
    for pod in (head, worker):
        container = pod["containers"][0]
        assert container["image"] == f"gpupool-ray:{version}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/api/healthz", "port": 52365}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    # dry run: nothing was stored
    listed = client.CustomObjectsApi(kube.api_client).list_namespaced_custom_object("ray.io", "v1", namespace,
                                                                                     "rayjobs")
    assert listed["items"] == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "replicas"), "four"),  # integer field
        (("spec", "shutdownAfterJobFinishes"), "yes"),  # boolean field
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers"), "gpupool"),  # a list
    ],
)
def test_a_broken_rayjob_is_refused(kube: ClusterClient, namespace: str, rayjob_crd: None,
                                    path: tuple[str | int, ...], value: object) -> None:
    body = copy.deepcopy(documents()["RayJob"])
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(ApiException) as refused:
        create_rayjob(kube, namespace, body)
    assert refused.value.status == 422, refused.value.body
    assert str(path[-1]) in str(refused.value.body)
