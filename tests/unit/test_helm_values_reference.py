"""docs/install.md's values reference is generated from the chart's schema and is current, and the
schema's defaults are the values.yaml that helm really uses (so the reference tells no lies)."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import yaml

from gpupool_devcluster.binaries import repo_root

ROOT = repo_root()
CHART = ROOT / "deploy" / "helm" / "gpupool"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_values_reference", ROOT / "hack" / "gen_values_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_in_docs_install_md_is_current() -> None:
    assert _generator().main(["--check"]) == 0, "run: python hack/gen_values_reference.py"


def _leaves(values: Any, path: str = "") -> dict[str, Any]:
    if isinstance(values, dict) and values and path not in _MAPS:
        found: dict[str, Any] = {}
        for key, value in values.items():
            found.update(_leaves(value, f"{path}.{key}" if path else key))
        return found
    return {path: values}


# values whose keys are free (maps of labels, selectors, priority classes): compared whole
_MAPS = {"priorityClasses.classes", "devicePlugin.nodeSelector", "grafanaDashboard.labels",
         "scheduler.resources", "devicePlugin.resources", "extender.resources"}


def test_every_value_is_documented_with_its_real_default() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = {path: (typ, default, description) for path, typ, default, description in _generator().rows(schema)}
    leaves = _leaves(values)
    assert set(leaves) == set(documented), (
        f"in values.yaml only: {sorted(set(leaves) - set(documented))}; "
        f"in the schema only: {sorted(set(documented) - set(leaves))}")
    for path, value in leaves.items():
        _, default, description = documented[path]
        assert description, f"{path}: no description in values.schema.json"
        assert default == f"`{json.dumps(value, separators=(', ', ': '))}`", f"{path}: schema default {default}, " \
                                                                             f"values.yaml {value!r}"
