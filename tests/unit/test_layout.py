"""Package layout: the device plugin and the scheduler never import each other, both import only
`gpupool_common` for what they share, and the plugin runs without the scheduler's extra."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
OURS = ("gpupool_common", "gpupool_deviceplugin", "gpupool_devcluster", "gpupool_sched")
# package -> the packages of ours it must never import (the dev cluster is tooling: it may import all)
FORBIDDEN: dict[str, set[str]] = {
    "gpupool_common": {"gpupool_deviceplugin", "gpupool_devcluster", "gpupool_sched"},
    "gpupool_deviceplugin": {"gpupool_devcluster", "gpupool_sched"},
    "gpupool_sched": {"gpupool_deviceplugin", "gpupool_devcluster"},
}


def imported_packages(source: str) -> set[str]:
    """Top-level package of every import statement, at any depth (functions, TYPE_CHECKING blocks too).
    Relative imports stay inside their own package and are skipped."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_imported_packages_sees_imports_anywhere() -> None:
    source = textwrap.dedent("""
        import os, gpupool_sched.model.cluster as c
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from gpupool_deviceplugin.inventory import NodeInventory
        def late():
            from gpupool_devcluster import cli
        from . import sibling
    """)
    assert imported_packages(source) == {"os", "gpupool_sched", "typing", "gpupool_deviceplugin", "gpupool_devcluster"}


def test_every_package_of_ours_is_checked() -> None:
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(OURS)
    assert set(FORBIDDEN) == packages - {"gpupool_devcluster"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_what_it_must_not(package: str) -> None:
    offending = [
        f"{path.relative_to(ROOT)}: {sorted(bad)}"
        for path in sorted((SRC / package).rglob("*.py"))
        if (bad := imported_packages(path.read_text()) & FORBIDDEN[package])
    ]
    assert not offending, f"{package} imports packages it must not:\n" + "\n".join(offending)


def scheduler_extra_modules() -> list[str]:
    """Import names of the distributions that only the `scheduler` extra installs (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_dist_name(req) for req in project["dependencies"]}

    def expanded(name: str) -> set[str]:  # `gpupool[server]` in an extra means that extra's packages
        found: set[str] = set()
        for req in project["optional-dependencies"][name]:
            if _dist_name(req) == "gpupool":
                for inner in req.split("[", 1)[1].split("]", 1)[0].split(","):
                    found |= expanded(inner.strip())
            else:
                found.add(_dist_name(req))
        return found
    extra = expanded("scheduler") - core
    assert extra, "the scheduler extra adds nothing to the core dependencies"
    modules = [m for m, dists in metadata.packages_distributions().items()
               if {_dist_name(d) for d in dists} & extra]
    assert {"numpy", "kopf", "matplotlib", "rich"} <= set(modules)
    return sorted(modules)


def _dist_name(requirement: str) -> str:
    name = requirement.split(";")[0]
    for stop in "<>=![ ~":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


def test_the_device_plugin_imports_without_the_scheduler_extra() -> None:
    """Every module of the plugin and of gpupool_common imports with the scheduler's packages, the
    scheduler's extra-only dependencies and the dev cluster made unimportable (None in sys.modules)."""
    blocked = ["gpupool_sched", "gpupool_devcluster", *scheduler_extra_modules()]
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        for name in {blocked!r}:
            sys.modules[name] = None
        for package in ("gpupool_common", "gpupool_deviceplugin"):
            root = importlib.import_module(package)
            for info in pkgutil.walk_packages(root.__path__, package + "."):
                importlib.import_module(info.name)
        import gpupool_deviceplugin.cli
        gpupool_deviceplugin.cli.build_parser().format_help()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


MAX_MODULE_LINES = 400  # issue 18's layout rule for the scheduler: one module, one idea


def oversized(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """Modules under `root` longer than `limit` lines (protoc's output aside), with their length."""
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if "_pb2" not in p.name and (n := len(p.read_text(encoding="utf-8").splitlines())) > limit]


def test_no_scheduler_module_is_over_400_lines() -> None:
    assert oversized(SRC / "gpupool_sched") == []


def test_oversized_sees_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path) == [f"pkg/long.py: {MAX_MODULE_LINES + 1} lines"]
