"""The gpupool image `make image` built (out/image/gpupool-<version>.oci.tar), run with runc as its
default user: both entry points answer --help, the server-side dependencies import, the device plugin
without NVML exits with its one-paragraph message. Needs root, runc and the built image; skipped without
them, except where GPUPOOL_IMAGE_TESTS=required (.ci/run, which runs `make image` first): then they fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.image import ARCHIVE, Bundle, missing_for_runc, require_or_skip, unpack


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    require_or_skip(missing_for_runc(ARCHIVE))
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
