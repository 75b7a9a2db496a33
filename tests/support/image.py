"""The image `make image` builds, for the tests that need it (tests/image/, the real-node e2e tests): where
its archive lies, and the one rule for a test that cannot run here: skipped, except where
GPUPOOL_IMAGE_TESTS=required (.ci/run, which builds the image first), where it fails."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ARCHIVE = REPO / "out" / "image" / f"gpupool-{VERSION}.oci.tar"


def require_or_skip(reason: str | None) -> None:
    """Nothing when `reason` is None; else skip with it, or fail where GPUPOOL_IMAGE_TESTS=required."""
    if reason is None:
        return
    if os.environ.get("GPUPOOL_IMAGE_TESTS") == "required":
        pytest.fail(f"GPUPOOL_IMAGE_TESTS=required but the image test {reason}")
    pytest.skip(reason)
