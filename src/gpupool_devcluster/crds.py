"""The project's CustomResourceDefinitions (deploy/crds/*.yaml) on a dev cluster: created, or replaced
when they exist (so a schema change reaches a reused cluster), then waited for until Established."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.binaries import repo_root
from gpupool_devcluster.errors import DevClusterError

ESTABLISH_TIMEOUT_S = 30.0


def crd_directory() -> Path:
    return repo_root() / "deploy" / "crds"


def crd_manifests(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition in `directory` (default deploy/crds), by file name."""
    folder = directory or crd_directory()
    found: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                raise DevClusterError(f"{path}: expected CustomResourceDefinition documents only")
            found.append(doc)
    return found


def install_crds(
    api: client.ApiClient,
    directory: Path | None = None,
    *,
    timeout_s: float = ESTABLISH_TIMEOUT_S,
    log: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Apply every CRD of `directory` and wait until each is Established; returns their names."""
    ext = client.ApiextensionsV1Api(api)
    names: list[str] = []
    for manifest in crd_manifests(directory):
        name = str(manifest["metadata"]["name"])
        try:
            current = ext.read_custom_resource_definition(name)
        except ApiException as exc:
            if exc.status != 404:
                raise DevClusterError(f"reading CRD {name}: {exc.status} {exc.reason}") from None
            current = None
        try:
            if current is None:
                ext.create_custom_resource_definition(manifest)
            else:
                body = {**manifest, "metadata": {**manifest["metadata"],
                                                 "resourceVersion": current.metadata.resource_version}}
                ext.replace_custom_resource_definition(name, body)
        except ApiException as exc:
            raise DevClusterError(f"applying CRD {name}: {exc.status} {exc.reason}: {exc.body}") from None
        log(f"CRD {name}")
        names.append(name)
    deadline = time.monotonic() + timeout_s
    for name in names:
        while not _established(ext, name):
            if time.monotonic() > deadline:
                raise DevClusterError(f"CRD {name} not Established after {timeout_s:.0f}s")
            time.sleep(0.1)
    return names


def _established(ext: client.ApiextensionsV1Api, name: str) -> bool:
    crd = ext.read_custom_resource_definition(name)
    conditions = (crd.status.conditions if crd.status else None) or ()
    return any(c.type == "Established" and c.status == "True" for c in conditions)
