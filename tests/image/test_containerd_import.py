"""`import_image` against a real containerd: a private one (its own root, state and socket under a temporary
directory, the CRI plugin off) takes the pause and workload archives written by hack/image/build.py, and
the gpupool and gpupool-ray images when `make image` built them, under the names the kubelet asks for.
Needs root and containerd; skipped without them, except where GPUPOOL_IMAGE_TESTS=required (.ci/run): then it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.oci import import_image
from tests.support.image import ARCHIVE, RAY_ARCHIVE, REPO, VERSION, require_or_skip


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (containerd)"
    for tool in ("containerd", "ctr", "gcc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install containerd gcc)"
    return None


@pytest.fixture(scope="module")
def containerd() -> Iterator[str]:
    require_or_skip(_missing())
    top = Path(tempfile.mkdtemp(prefix="gpc-", dir="/tmp"))  # short: a unix socket path has 108 bytes
    sock = top / "containerd.sock"
    config = top / "config.toml"
    config.write_text(f"""version = 2
root = "{top}/root"
state = "{top}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[debug]
  address = ""
[metrics]
  address = ""
""")
    log = (top / "containerd.log").open("wb")
    proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", str(sock), "version"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"private containerd did not start: {(top / 'containerd.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield str(sock)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        subprocess.run(["umount", "-R", str(top / "root")], capture_output=True)  # any snapshot mount left
        shutil.rmtree(top, ignore_errors=True)


def _images(sock: str) -> set[str]:
    done = subprocess.run(["ctr", "--address", sock, "-n", "k8s.io", "images", "ls", "-q"],
                          capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_node_images_and_gpupool_image_import(containerd: str, tmp_path: Path) -> None:
    out = tmp_path / "image"
    subprocess.run([sys.executable, str(REPO / "hack/image/build.py"), "--node-images-only", "--no-import",
                    "--out", str(out)], check=True)
    archives = [out / "pause-3.10.oci.tar", out / f"gpupool-workload-{VERSION}.oci.tar"]
    expected = {"registry.k8s.io/pause:3.10", f"docker.io/library/gpupool-workload:{VERSION}"}
    for archive, name in ((ARCHIVE, "gpupool"), (RAY_ARCHIVE, "gpupool-ray")):
        if archive.is_file():
            archives.append(archive)
            expected.add(f"docker.io/library/{name}:{VERSION}")
    for archive in archives:
        import_image(archive, containerd)
    assert expected <= _images(containerd)
    # imported and unpacked: every image is complete in the content store and has its snapshot
    check = subprocess.run(["ctr", "--address", containerd, "-n", "k8s.io", "images", "check"],
                           capture_output=True, text=True, check=True)
    for name in expected:
        [row] = [line for line in check.stdout.splitlines() if line.startswith(name + " ")]
        assert "complete" in row and row.split()[-1] == "true", row  # the last column: UNPACKED


def test_import_into_a_socket_without_containerd_is_one_line(tmp_path: Path) -> None:
    require_or_skip(_missing())
    archive = tmp_path / "x.oci.tar"
    archive.write_bytes(b"")
    with pytest.raises(DevClusterError, match=r"ctr images import .* failed") as err:
        import_image(archive, str(tmp_path / "nothing.sock"))
    assert "\n" not in str(err.value)
