"""Small things a new user trips on: `gpupool --version`, `make help`, a sub-command whose extra is missing."""

from __future__ import annotations

import importlib
import re
import subprocess
import tomllib
import types
from importlib import metadata
from pathlib import Path

import pytest

import gpupool_sched
import gpupool_sched.cli as gpupool_cli
from tests.support.cli_run import run

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_distributions() -> None:
    code, out, _ = run(["--version"])
    assert code == 0
    assert out.strip() == f"gpupool {metadata.version('gpupool')}"
    assert metadata.version("gpupool") == gpupool_sched.__version__  # pyproject and the package agree


@pytest.fixture
def without_dev_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if `pip install gpupool` had run without `[dev]`: the dev cluster's module cannot import."""

    def import_module(name: str) -> types.ModuleType:
        if name == "gpupool_devcluster.cli":
            raise ModuleNotFoundError("No module named 'cryptography'", name="cryptography")
        return importlib.import_module(name)

    monkeypatch.setattr(gpupool_cli, "importlib", types.SimpleNamespace(import_module=import_module))


@pytest.mark.parametrize("argv", [
    ["dev-cluster", "--help"],
    ["dev-cluster", "-h"],
    ["dev-cluster", "up", "--name", "demo"],
    ["dev-cluster"],
])
def test_a_command_whose_extra_is_missing_names_the_extra(without_dev_extras, argv: list[str]) -> None:
    code, _, err = run(argv)
    assert code == 2
    assert err.strip() == ("gpupool dev-cluster: error: needs the 'dev' extra (Python package 'cryptography' is not "
                           "installed): pip install 'gpupool[dev]'")
    assert "unrecognized arguments" not in err


def test_the_missing_extra_shows_in_the_command_list(without_dev_extras) -> None:
    code, out, _ = run(["--help"])
    assert code == 0
    assert "(unavailable: cryptography is not installed; pip install 'gpupool[dev]')" in " ".join(out.split())
    assert "simulate" in out


@pytest.mark.parametrize("missing", ["numpy", "kopf"])
@pytest.mark.parametrize("command", ["simulate", "scheduler"])
def test_without_the_server_extra_its_commands_name_it(monkeypatch: pytest.MonkeyPatch, missing: str,
                                                       command: str) -> None:
    """As after a plain `pip install gpupool` (the device plugin only). kopf is imported only when a command
    runs, so it must be found missing before, not as a traceback mid-run."""
    real = gpupool_cli.find_spec
    monkeypatch.setattr(gpupool_cli, "find_spec", lambda name: None if name == missing else real(name))
    code, _, err = run([command, "--help"])
    assert code == 2
    assert err.strip() == (f"gpupool {command}: error: needs the 'server' extra (Python package {missing!r} is "
                           "not installed): pip install 'gpupool[server]'")


def test_the_scheduler_runs_without_matplotlib_and_only_plots_need_it(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The container image holds the `server` extra, without matplotlib: `gpupool scheduler` must start
    there (it did not: the whole `scheduler` extra was required), and `simulate --plot` names what is
    missing."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    real = gpupool_cli.find_spec
    monkeypatch.setattr(gpupool_cli, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, out, _ = run(["scheduler", "--help"])
    assert code == 0 and "--scheduler-name" in out
    code, _, err = run(["simulate", "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert "needs matplotlib (the 'scheduler' extra): pip install 'gpupool[scheduler]'" in err


def test_every_extra_module_is_in_that_extra_of_pyproject() -> None:
    """The modules the CLI probes for come from distributions pyproject puts in that extra (or one it includes)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(extra: str) -> set[str]:
        found: set[str] = set()
        for requirement in extras[extra]:
            name = re.split(r"[<>=!~;\s\[]", requirement, maxsplit=1)[0].lower()
            found |= names(requirement.split("[")[1].split("]")[0]) if name == "gpupool" else {name}
        return found

    distributions = metadata.packages_distributions()
    for extra, modules in gpupool_cli.EXTRA_MODULES.items():
        for module in modules:
            assert {d.lower() for d in distributions[module]} & names(extra), (module, extra)
    assert set(gpupool_cli.SUBCOMMANDS.values()) <= set(gpupool_cli.EXTRA_MODULES)


def makefile_targets() -> dict[str, str]:
    """Target -> the line that defines it."""
    text = (ROOT / "Makefile").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^([a-zA-Z][a-zA-Z0-9_-]*):(?!=).*$", text, re.MULTILINE)}


def test_every_make_target_has_a_description() -> None:
    targets = makefile_targets()
    assert {"help", "fmt", "clean", "simulate", "test"} <= set(targets)
    assert [t for t, line in targets.items() if "## " not in line] == []


def test_make_help_lists_every_target_with_a_description() -> None:
    out = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    listed = dict(re.findall(r"^  (\S+)\s+(.+)$", out, flags=re.MULTILINE))
    assert list(listed) == list(makefile_targets())
    undescribed = [t for t, d in listed.items() if d == "(no description)"]
    assert not undescribed, f"targets without a `## ` description: {undescribed}"
    phony = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert phony and set(phony.group(1).replace("\\", " ").split()) <= set(listed)
