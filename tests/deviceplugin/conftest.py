"""Fixtures for device plugin tests: a kubelet stand-in in a temporary directory and plugin processes."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fixtures import fresh_namespace
from tests.support.kubelet_standin import KubeletStandin
from tests.support.plugin_process import PluginProcess


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes: keep the directory short
    with tempfile.TemporaryDirectory(prefix="gpk-") as d:
        yield Path(d)


@pytest.fixture
def kubelet(kubelet_dir: Path) -> Iterator[KubeletStandin]:
    k = KubeletStandin(kubelet_dir)
    k.start()
    yield k
    k.stop()


@pytest.fixture
def start_plugin(tmp_path: Path, kubelet_dir: Path) -> Iterator[Callable[..., PluginProcess]]:
    started: list[PluginProcess] = []

    def start(profile: str, **kwargs) -> PluginProcess:
        p = PluginProcess(tmp_path, kubelet_dir, profile, **kwargs).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def namespace(kube) -> Iterator[str]:
    """A fresh namespace `dp-...` on the dev cluster, removed afterwards with its pods (tests.support.fixtures)."""
    with fresh_namespace(kube, "dp") as name:
        yield name
