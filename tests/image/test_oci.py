"""The OCI image-layout writer (gpupool_devcluster.oci): what it writes is a valid layout whose digests,
sizes and diff_ids are those of the blobs, and the image is named the way containerd and the kubelet name it."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
from pathlib import Path

import pytest

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.oci import ImageConfig, full_reference, import_image, make_layer, write_oci_archive


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _read_layout(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_full_reference() -> None:
    assert full_reference("gpupool:0.1.0") == "docker.io/library/gpupool:0.1.0"
    assert full_reference("me/gpupool:1") == "docker.io/me/gpupool:1"
    assert full_reference("registry.k8s.io/pause:3.10") == "registry.k8s.io/pause:3.10"
    assert full_reference("localhost:5000/gpupool:0.1.0") == "localhost:5000/gpupool:0.1.0"
    with pytest.raises(ValueError, match="no tag"):
        full_reference("localhost:5000/gpupool")


def test_layout_digests_and_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n")
    (root / "bin" / "tool").chmod(0o755)
    os.link(root / "bin" / "tool", root / "bin" / "same")
    (root / "bin" / "alias").symlink_to("tool")
    (root / "dev").mkdir()
    (root / "dev" / "skipped").write_text("x")
    plain = tmp_path / "extra.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(root / "bin" / "tool", arcname="etc/motd")

    dir_layer = make_layer(root, tmp_path / "l1.tar.gz", skip_contents=("dev",))
    tar_layer = make_layer(plain, tmp_path / "l2.tar.gz")
    config = ImageConfig(cmd=["tool"], user="65532:65532", working_dir="/", env=["PATH=/bin"], labels={"a": "b"})
    archive = tmp_path / "img.oci.tar"
    manifest_digest = write_oci_archive(archive, "gpupool:0.1.0", [dir_layer, tar_layer], config)

    blobs = _read_layout(archive)
    assert json.loads(blobs["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in blobs.items():  # every blob is named by its digest
        if name.startswith("blobs/sha256/"):
            assert _sha(data) == "sha256:" + name.rsplit("/", 1)[1]
    index = json.loads(blobs["index.json"])
    assert index["schemaVersion"] == 2
    [entry] = index["manifests"]
    assert entry["digest"] == manifest_digest
    assert entry["annotations"] == {"io.containerd.image.name": "docker.io/library/gpupool:0.1.0",
                                    "org.opencontainers.image.ref.name": "0.1.0"}
    manifest_bytes = blobs[f"blobs/sha256/{manifest_digest.split(':')[1]}"]
    assert entry["size"] == len(manifest_bytes)
    manifest = json.loads(manifest_bytes)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    config_bytes = blobs[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"]
    assert manifest["config"]["size"] == len(config_bytes)
    image = json.loads(config_bytes)
    assert image["config"] == {"Cmd": ["tool"], "User": "65532:65532", "WorkingDir": "/", "Env": ["PATH=/bin"],
                               "Labels": {"a": "b"}}
    assert (image["os"], image["architecture"]) == ("linux", "amd64")

    diff_ids = []
    for desc in manifest["layers"]:
        compressed = blobs[f"blobs/sha256/{desc['digest'].split(':')[1]}"]
        assert desc["size"] == len(compressed)
        assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        diff_ids.append(_sha(gzip.decompress(compressed)))
    assert image["rootfs"] == {"type": "layers", "diff_ids": diff_ids}
    assert diff_ids == [dir_layer.diff_id, tar_layer.diff_id]
    assert diff_ids[1] == _sha(plain.read_bytes())  # a tar file's layer is that tar, compressed

    with tarfile.open(dir_layer.path) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["bin", "bin/alias", "bin/same", "bin/tool", "dev"]  # dev/'s contents left out
    assert members["bin/alias"].issym() and members["bin/alias"].linkname == "tool"
    assert members["bin/same"].islnk() or members["bin/tool"].islnk()
    assert members["bin/tool"].mode & 0o777 == 0o755


def test_layer_under_prefix_and_reproducible(tmp_path: Path) -> None:
    src = tmp_path / "venv"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "python").write_text("x")
    a = make_layer(src, tmp_path / "a.tar.gz", prefix="opt/gpupool")
    b = make_layer(src, tmp_path / "b.tar.gz", prefix="opt/gpupool")
    assert (a.digest, a.diff_id) == (b.digest, b.diff_id)
    with tarfile.open(a.path) as tar:
        assert tar.getnames() == ["opt/gpupool/bin", "opt/gpupool/bin/python"]


def test_import_image_without_ctr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DevClusterError, match=r"`ctr` .* is not on PATH"):
        import_image(tmp_path / "x.oci.tar", "/run/nothing.sock")


def test_import_image_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctr = tmp_path / "ctr"
    ctr.write_text("#!/bin/sh\necho \"ctr: failed to dial \\\"$2\\\": no such file\" >&2\nexit 1\n")
    ctr.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    archive = tmp_path / "x.oci.tar"
    archive.write_bytes(b"")
    with pytest.raises(DevClusterError, match=r"failed \(exit 1\): ctr: failed to dial \"/run/x.sock\"") as err:
        import_image(archive, "/run/x.sock", namespace="k8s.io")
    assert "\n" not in str(err.value)
