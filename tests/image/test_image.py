"""The gpupool image `make image` built (out/image/gpupool-<version>.oci.tar), run with runc as its
default user: both entry points answer --help, the server-side dependencies import, the device plugin
without NVML exits with its one-paragraph message. Needs root, runc and the built image; skipped without
them, except where GPUPOOL_IMAGE_TESTS=required (.ci/run, which runs `make image` first): then they fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.image import ARCHIVE, REPO, require_or_skip


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (runc runs the image's root file system)"
    if shutil.which("runc") is None:
        return "needs runc (apt-get install runc)"
    if not ARCHIVE.is_file():
        return f"needs the image: {ARCHIVE.relative_to(REPO)} is missing (run `make image` as root)"
    return None


def unpack(archive: Path, dest: Path) -> dict:
    """Extract the image's layers in order into dest; returns the image config blob."""
    layout = dest.parent / "layout"
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="data")
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]).read_text())
    dest.mkdir()
    for layer in manifest["layers"]:  # as root, tar keeps owners, modes, links (the layers have no whiteouts)
        subprocess.run(["tar", "-xzf", str(layout / "blobs/sha256" / layer["digest"].split(":")[1]), "-C", str(dest)],
                       check=True)
    config = json.loads((layout / "blobs/sha256" / manifest["config"]["digest"].split(":")[1]).read_text())
    shutil.rmtree(layout)
    return config


class Bundle:
    """An OCI runtime bundle of the image (read-only rootfs, no network but loopback) run with runc."""

    def __init__(self, path: Path, image: dict) -> None:
        self.path, self.image = path, image
        self.state = path / "runc-state"
        subprocess.run(["runc", "spec", "--bundle", str(path)], check=True)
        self.spec = json.loads((path / "config.json").read_text())

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run args in the image as its user (User of the image config), with its Env and WorkingDir."""
        cfg = self.image["config"]
        uid, _, gid = cfg["User"].partition(":")
        process = self.spec["process"]
        process.update(terminal=False, args=list(args), env=cfg["Env"], cwd=cfg.get("WorkingDir") or "/",
                       user={"uid": int(uid), "gid": int(gid or uid)})
        self.spec["root"] = {"path": "rootfs", "readonly": True}
        (self.path / "config.json").write_text(json.dumps(self.spec))
        cid = f"gpupool-image-test-{uuid.uuid4().hex[:8]}"
        try:
            return subprocess.run(["runc", "--root", str(self.state), "run", "--bundle", str(self.path), cid],
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        finally:
            subprocess.run(["runc", "--root", str(self.state), "delete", "--force", cid], capture_output=True)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    require_or_skip(_missing())
    path = tmp_path_factory.mktemp("bundle")
    image = unpack(ARCHIVE, path / "rootfs")
    yield Bundle(path, image)


def test_image_config(bundle: Bundle) -> None:
    cfg = bundle.image["config"]
    assert cfg["User"] == "65532:65532"
    assert any(e.startswith("PATH=/opt/gpupool/bin:") for e in cfg["Env"])
    assert (bundle.path / "rootfs/opt/gpupool/bin/gpupool-deviceplugin").is_file()


def test_entry_points_run_as_nonroot(bundle: Bundle) -> None:
    who = bundle.run("id")
    assert who.returncode == 0, who.stderr
    assert who.stdout.startswith("uid=65532(nonroot) gid=65532(nonroot)")
    for command, expect in (("gpupool", "usage: gpupool"), ("gpupool-deviceplugin", "usage: gpupool-deviceplugin"),
                            ("kubectl-gpupool", "usage: kubectl")):
        done = bundle.run(command, "--help")
        assert done.returncode == 0, f"{command} --help: {done.stderr}"
        assert done.stdout.startswith(expect), done.stdout[:300]
        assert done.stderr == ""


def test_server_dependencies_import(bundle: Bundle) -> None:
    code = ("import ssl, asyncio, sqlite3, ctypes, json, zoneinfo, lzma, bz2;"
            "import numpy, grpc, kopf, aiohttp, kubernetes.client, pydantic, yaml, pynvml, prometheus_client, watchdog;"
            "import gpupool_sched.kube.watch, gpupool_sched.scheduler.service, gpupool_sched.extender.core;"
            "import gpupool_deviceplugin.daemon;"
            "import importlib.util as u; print(ssl.OPENSSL_VERSION, numpy.__version__,"
            " u.find_spec('matplotlib'), u.find_spec('pip'), u.find_spec('setuptools'))")
    done = bundle.run("python", "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("None None None"), done.stdout  # no matplotlib, pip or setuptools
    compilers = bundle.run("sh", "-c", "command -v gcc cc g++ clang; true")
    assert compilers.stdout == ""


def test_deviceplugin_without_nvml_says_what_is_missing(bundle: Bundle) -> None:
    done = bundle.run("gpupool-deviceplugin", "--kubelet-dir=/home/nonroot", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("gpupool-deviceplugin: cannot load NVML: libnvidia-ml.so.1")
    assert "NVIDIA container toolkit" in line and "--fake-nvml" in line and "devicePlugin.fakeNvmlProfile" in line
