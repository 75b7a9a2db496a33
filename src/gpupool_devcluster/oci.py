"""A small OCI image-layout writer (standard library only) and `ctr images import`.

`write_oci_archive` takes layers (a tar file or a directory each) and an `ImageConfig` and writes one OCI
image layout as a tar (`oci-layout`, `index.json`, `blobs/sha256/...`): what `ctr images import`,
`skopeo copy oci-archive:...` and `docker load` (25+) read. The index names the image twice, as Docker's
`docker save` does: `io.containerd.image.name` (the full reference containerd stores, e.g.
`docker.io/library/gpupool:0.1.0`, what the kubelet resolves `gpupool:0.1.0` to) and
`org.opencontainers.image.ref.name` (its tag). Layers are gzip-compressed with a zero gzip timestamp.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gpupool_devcluster.errors import DevClusterError

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    """One compressed layer blob: its file, sha256 digest, size, diff_id (sha256 of the plain tar) and the
    plain tar's size (what the layer takes uncompressed)."""

    path: Path
    digest: str
    size: int
    diff_id: str
    tar_size: int = 0


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an OCI image config (`config` in the config blob)."""

    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    env: list[str] = field(default_factory=lambda: [f"PATH={DEFAULT_PATH}"])
    user: str = ""
    working_dir: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    architecture: str = "amd64"
    os: str = "linux"


def full_reference(name: str) -> str:
    """The reference containerd and the kubelet use for `name`: `gpupool:0.1.0` ->
    `docker.io/library/gpupool:0.1.0`; `registry.k8s.io/pause:3.10` stays as it is. A tag is required."""
    repo, _, tag = name.rpartition(":")
    if not repo or "/" in tag:
        raise ValueError(f"image name {name!r} has no tag (name:tag)")
    first = repo.split("/", 1)[0]
    if "/" not in repo:
        repo = f"docker.io/library/{repo}"
    elif not ("." in first or ":" in first or first == "localhost"):
        repo = f"docker.io/{repo}"
    return f"{repo}:{tag}"


def _tar_directory(src: Path, out: _HashingWriter, prefix: str = "", skip_contents: Sequence[str] = ()) -> None:
    """A tar of `src` (names under `prefix`), entries sorted, owners by number; the contents of the
    directories named in `skip_contents` (relative paths, e.g. "dev") left out, the directories kept."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        def add(path: Path, name: str) -> None:
            info = tar.gettarinfo(str(path), arcname=name)
            if info is None:  # a socket: nothing a layer can hold
                return
            info.uname = info.gname = ""
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)

        for root, dirs, files in os.walk(src):
            dirs.sort()
            rel = Path(root).relative_to(src).as_posix()
            if rel in skip_contents:
                dirs.clear()
                continue
            for name in sorted(dirs + files):
                path = Path(root, name)
                arc = f"{rel}/{name}" if rel != "." else name
                add(path, f"{prefix}/{arc}" if prefix else arc)


class _HashingWriter:
    """Writes through to `out` while hashing and counting what passes."""

    def __init__(self, out: BinaryIO | gzip.GzipFile) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.size += len(b)
        self.out.write(b)
        return len(b)

    def flush(self) -> None:
        self.out.flush()


def make_layer(src: Path, dest: Path, *, prefix: str = "", skip_contents: Sequence[str] = (),
               compresslevel: int = 6) -> Layer:
    """Compress a layer tar file, or tar and compress a directory (names under `prefix`), into `dest`."""
    with dest.open("wb") as raw:
        outer = _HashingWriter(raw)
        with gzip.GzipFile(fileobj=outer, mode="wb", compresslevel=compresslevel, mtime=0) as gz:
            inner = _HashingWriter(gz)
            if src.is_dir():
                _tar_directory(src, inner, prefix, skip_contents)
            else:
                with src.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        inner.write(chunk)
    return Layer(dest, f"sha256:{outer.sha.hexdigest()}", outer.size, f"sha256:{inner.sha.hexdigest()}", inner.size)


def _json_blob(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media, "digest": f"sha256:{hashlib.sha256(data).hexdigest()}", "size": len(data)}


def write_oci_archive(out: Path, name: str, layers: Sequence[Layer], config: ImageConfig,
                      created: str = "1970-01-01T00:00:00Z") -> str:
    """Write the OCI image layout tar `out` for image `name` (e.g. "gpupool:0.1.0"); returns the manifest digest."""
    ref = full_reference(name)
    runtime: dict[str, object] = {"Env": config.env}
    for key, value in (("Entrypoint", config.entrypoint), ("Cmd", config.cmd), ("User", config.user),
                       ("WorkingDir", config.working_dir), ("Labels", config.labels)):
        if value:
            runtime[key] = value
    config_blob = _json_blob({
        "architecture": config.architecture, "os": config.os, "created": created, "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": f"gpupool_devcluster.oci layer {i}"}
                    for i in range(len(layers))],
    })
    manifest_blob = _json_blob({
        "schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": _descriptor(MEDIA_CONFIG, config_blob),
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer.digest, "size": layer.size} for layer in layers],
    })
    manifest = _descriptor(MEDIA_MANIFEST, manifest_blob)
    manifest["platform"] = {"architecture": config.architecture, "os": config.os}
    manifest["annotations"] = {"io.containerd.image.name": ref,
                               "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}
    index_blob = _json_blob({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [manifest]})

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def add_bytes(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", _json_blob({"imageLayoutVersion": "1.0.0"}))
        seen: set[str] = set()
        for layer in layers:
            if layer.digest not in seen:
                seen.add(layer.digest)
                info = tar.gettarinfo(str(layer.path), arcname=f"blobs/sha256/{layer.digest.split(':', 1)[1]}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                with layer.path.open("rb") as f:
                    tar.addfile(info, f)
        for blob in (config_blob, manifest_blob):
            add_bytes(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", blob)
        add_bytes("index.json", index_blob)
    tmp.replace(out)
    return str(manifest["digest"])


def import_image(archive: Path, address: str, namespace: str = "k8s.io") -> None:
    """`ctr --address ADDRESS -n NAMESPACE images import ARCHIVE`: load an OCI archive written by
    `write_oci_archive` into the containerd at socket ADDRESS (unpacked for its default snapshotter).
    Raises DevClusterError (one line) when ctr is missing or the import fails."""
    ctr = shutil.which("ctr")
    if ctr is None:
        raise DevClusterError(f"cannot import {archive}: `ctr` (containerd's client) is not on PATH; "
                              "install containerd (Debian: apt-get install containerd)")
    if not archive.is_file():
        raise DevClusterError(f"cannot import {archive}: no such file (build it with `make image`)")
    with tempfile.TemporaryFile() as log:
        proc = subprocess.run([ctr, "--address", address, "-n", namespace, "images", "import", str(archive)],
                              stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            log.seek(0)
            detail = " ".join(log.read().decode(errors="replace").split())[-600:]
            raise DevClusterError(f"ctr images import {archive} into {address} (namespace {namespace}) failed "
                                  f"(exit {proc.returncode}): {detail}")
