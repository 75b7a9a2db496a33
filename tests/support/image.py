"""The images `make image` builds, for the tests that need them (tests/image/, the real-node e2e tests): where
their archives lie, an OCI runtime bundle of one run with runc, and the one rule for a test that cannot run
here: skipped, except where GPUPOOL_IMAGE_TESTS=required (.ci/run, which builds the images first), where it
fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ARCHIVE = REPO / "out" / "image" / f"gpupool-{VERSION}.oci.tar"
RAY_ARCHIVE = REPO / "out" / "image" / f"gpupool-ray-{VERSION}.oci.tar"  # gpupool-ray:<version>


def require_or_skip(reason: str | None) -> None:
    """Nothing when `reason` is None; else skip with it, or fail where GPUPOOL_IMAGE_TESTS=required."""
    if reason is None:
        return
    if os.environ.get("GPUPOOL_IMAGE_TESTS") == "required":
        pytest.fail(f"GPUPOOL_IMAGE_TESTS=required but the image test {reason}")
    pytest.skip(reason)


def missing_for_runc(archive: Path) -> str | None:
    """Why the image in `archive` cannot be run with runc here, or None."""
    if os.geteuid() != 0:
        return "needs root (runc runs the image's root file system)"
    if shutil.which("runc") is None:
        return "needs runc (apt-get install runc)"
    if not archive.is_file():
        return f"needs the image: {archive.relative_to(REPO)} is missing (run `make image` as root)"
    return None


def unpack(archive: Path, dest: Path) -> dict[str, Any]:
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
    config: dict[str, Any] = json.loads((layout / "blobs/sha256" / manifest["config"]["digest"].split(":")[1])
                                        .read_text())
    shutil.rmtree(layout)
    return config


class Bundle:
    """An OCI runtime bundle of the image (read-only rootfs, no network but loopback) run with runc."""

    def __init__(self, path: Path, image: dict[str, Any]) -> None:
        self.path, self.image = path, image
        self.state = path / "runc-state"
        subprocess.run(["runc", "spec", "--bundle", str(path)], check=True)
        self.spec = json.loads((path / "config.json").read_text())
        self.base_mounts = list(self.spec["mounts"])

    def run(self, *args: str, timeout: float = 120, mounts: list[dict[str, Any]] | None = None,
            env: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run args in the image as its user (User of the image config), with its Env (plus `env`) and
        WorkingDir; `mounts`: OCI mounts added to runc's defaults (a tmpfs, a bind of a host directory)."""
        cfg = self.image["config"]
        uid, _, gid = cfg["User"].partition(":")
        process = self.spec["process"]
        process.update(terminal=False, args=list(args), env=cfg["Env"] + (env or []), cwd=cfg.get("WorkingDir") or "/",
                       user={"uid": int(uid), "gid": int(gid or uid)})
        self.spec["root"] = {"path": "rootfs", "readonly": True}
        self.spec["mounts"] = self.base_mounts + (mounts or [])
        (self.path / "config.json").write_text(json.dumps(self.spec))
        cid = f"gpupool-image-test-{uuid.uuid4().hex[:8]}"
        try:
            return subprocess.run(["runc", "--root", str(self.state), "run", "--bundle", str(self.path), cid],
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        finally:
            subprocess.run(["runc", "--root", str(self.state), "delete", "--force", cid], capture_output=True)
