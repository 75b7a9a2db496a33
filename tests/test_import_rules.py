"""Import rules over src/, hack/, benchmarks/ and tests/, read with `ast` (nothing is imported; imports at any
depth count: in functions, under TYPE_CHECKING), complementing tests/unit/test_layout.py (which packages of
src/ may import which):

  (a) the pure core, gpupool_sched.placement and gpupool_sched.model, imports no front end and no I/O:
      never gpupool_sched.scheduler, .extender, .status or .simulate;
  (b) the front ends gpupool_sched.scheduler, .extender and .status do not import each other (FRONT_END_ALLOWED
      is empty);
  (c) nothing imports a test module (`test_*`, `conftest`): shared helpers live in tests.support;
  (d) only tests/, hack/ and benchmarks/ import the test support package (or anything under tests/), never
      src/'s product packages;
  (e) of tests/, only tests.support is imported (helpers moved out of the test folders stay out), and only
      as the package `tests` (never `scheduler_harness` or `deviceplugin.x` through sys.path towards tests/);
  (f) what the front ends share (gpupool_sched.kube, .cache, .framework, .writer, .metrics) imports no front
      end and not the simulator;
  (g) one writer: outside gpupool_sched.writer (and kube/kubeapi.py, which defines them) no module of
      gpupool_sched calls a KubeApi write method (`write` and every method that sends through it: Bindings,
      Events, evictions, status patches). The names are read from kubeapi.py; a call counts by its
      attribute name, and a name that other objects' methods also have (a file's `write`,
      `Statement.evict`, the extender's `bind`) counts only on a receiver named like a KubeApi (`api`,
      `self.api`, `kube_api`). The leader's Lease writes (`write_lease_sync`, through the client) are the
      fence itself, not a write it fences: not counted.

`from a import b` counts as an import of module a.b where a.b is a module, else of a; relative imports are
resolved against the importer's package. test_the_rules_catch_violations feeds the checker fabricated
sources that break each rule, so that this test can fail (test_the_writer_rule_catches_writes for (g)).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "hack", "benchmarks", "tests")
CORE = ("gpupool_sched.placement", "gpupool_sched.model")
NOT_FOR_THE_CORE = ("gpupool_sched.scheduler", "gpupool_sched.extender", "gpupool_sched.status",
                    "gpupool_sched.simulate")
FRONT_ENDS = ("gpupool_sched.scheduler", "gpupool_sched.extender", "gpupool_sched.status")
# what the front ends share: they never import a front end (nor the simulator)
SHARED = ("gpupool_sched.kube", "gpupool_sched.cache", "gpupool_sched.framework", "gpupool_sched.writer",
          "gpupool_sched.metrics")
SUPPORT = "tests.support"
MAY_USE_SUPPORT = ("tests", "hack", "benchmarks")  # top-level names of the trees outside src/
# what tests/ holds, by the names a sys.path entry towards tests/ would import it under
BARE = frozenset(p.stem for p in (ROOT / "tests").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()) \
    - {"__init__"}

# (importer, imported) between front ends that are allowed: none since issue 18's layout (what they share lives in
# kube/, cache/, framework/ and writer/). An entry must allow a real import (test_the_allow_list_is_exact).
FRONT_END_ALLOWED: frozenset[tuple[str, str]] = frozenset()
WRITER = "gpupool_sched.writer"
KUBEAPI = "gpupool_sched.kube.kubeapi"


@dataclass(frozen=True)
class Source:
    module: str  # dotted name: src/ stripped, tests/... as the package tests, hack/... as `hack`
    path: str  # for the messages
    text: str
    package: bool = False  # an __init__.py: relative imports resolve against the module itself


@dataclass(frozen=True)
class Import:
    importer: str
    path: str
    line: int
    module: str  # absolute


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "src":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def sources() -> list[Source]:
    return [Source(module_name(p), str(p.relative_to(ROOT)), p.read_text(), p.name == "__init__.py")
            for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]


def imports(source: Source, known: set[str]) -> Iterator[Import]:
    """Every import of `source`, resolved; `known`: the module names that exist (for `from a import b`)."""
    package = source.module.split(".") if source.package else source.module.split(".")[:-1]
    for node in ast.walk(ast.parse(source.text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source.module, source.path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names}
            for target in sorted(targets):
                yield Import(source.module, source.path, node.lineno, target)


def within(module: str, packages: Iterable[str]) -> str | None:
    """The package of `packages` that `module` is or lies in."""
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def is_test_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def violations(found: Iterable[Import], allowed: frozenset[tuple[str, str]] = FRONT_END_ALLOWED,
               bare: frozenset[str] = BARE) -> list[str]:
    out = []
    for imp in found:
        where = f"{imp.path}:{imp.line}: {imp.importer} imports {imp.module}"
        if within(imp.importer, CORE) and within(imp.module, NOT_FOR_THE_CORE):
            out.append(f"{where}: (a) the placement core imports no front end or I/O")
        importer_end, imported_end = within(imp.importer, FRONT_ENDS), within(imp.module, FRONT_ENDS)
        if importer_end and imported_end and importer_end != imported_end \
                and (imp.importer, imp.module) not in allowed:
            out.append(f"{where}: (b) front ends do not import each other")
        if within(imp.importer, SHARED) and within(imp.module, (*FRONT_ENDS, "gpupool_sched.simulate")):
            out.append(f"{where}: (f) the shared layers import no front end")
        if is_test_module(imp.module):
            out.append(f"{where}: (c) a test module is imported; move what is shared to {SUPPORT}")
        if within(imp.module, ("tests",)) and not within(imp.importer, MAY_USE_SUPPORT):
            out.append(f"{where}: (d) only tests/, hack/ and benchmarks/ use the test support package")
        if within(imp.module, ("tests",)) and not within(imp.module, (SUPPORT,)) and not is_test_module(imp.module):
            out.append(f"{where}: (e) of tests/, only {SUPPORT} is imported")
        if imp.module.split(".")[0] in bare:
            out.append(f"{where}: (e) tests/ imported through sys.path, not as the package tests")
    return out


def check(fabricated: list[Source], known: set[str] | None = None) -> list[str]:
    names = {s.module for s in fabricated} | (known or set())
    return violations(i for s in fabricated for i in imports(s, names))


def write_methods(kubeapi: str) -> frozenset[str]:
    """KubeApi's write methods: `write` and every method of the class that calls `self.write`."""
    cls = next(n for n in ast.parse(kubeapi).body if isinstance(n, ast.ClassDef) and n.name == "KubeApi")
    found = {"write"}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "write"
                and isinstance(c.func.value, ast.Name) and c.func.value.id == "self" for c in ast.walk(fn)):
            found.add(fn.name)
    return frozenset(found)


def generic_names(found: Iterable[Source], methods: frozenset[str]) -> frozenset[str]:
    """Write methods' names that other objects' methods have too: a file's `write`, and any defined in
    src/ outside kubeapi.py."""
    defined = {n.name for s in found if s.module.startswith("gpupool_sched.") and s.module != KUBEAPI
               for n in ast.walk(ast.parse(s.text)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return frozenset(methods & (defined | {"write"}))


def names_a_kube_api(node: ast.expr) -> bool:
    """`api`, `self.api`, `self._api`, `kube_api`, `reports_api`..."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "api" in name.lower().split("_")


def write_violations(found: Iterable[Source], methods: frozenset[str], generic: frozenset[str]) -> list[str]:
    """(g): calls of KubeApi write methods outside the writer package."""
    out = []
    for source in found:
        if not source.module.startswith("gpupool_sched.") or within(source.module, (WRITER, KUBEAPI)):
            continue
        for node in ast.walk(ast.parse(source.text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods \
                    and (node.func.attr not in generic or names_a_kube_api(node.func.value)):
                out.append(f"{source.path}:{node.lineno}: {source.module} calls KubeApi.{node.func.attr}: "
                           f"(g) API writes go through {WRITER}")
    return out


# ---- the rules hold ---------------------------------------------------------------------------------------
def test_the_trees_are_read() -> None:
    modules = {s.module for s in sources()}
    for expected in ("gpupool_sched.placement.decide", "gpupool_sched.extender.core", "hack.demo",
                     "benchmarks.bench_deviceplugin", "tests.support.objects", "tests.conftest",
                     "tests.e2e.test_faults"):
        assert expected in modules, expected


def test_the_import_rules_hold() -> None:
    found = sources()
    known = {s.module for s in found}
    assert violations(i for s in found for i in imports(s, known)) == []


def test_the_allow_list_is_exact() -> None:
    """Every allowed front-end import exists: the list shrinks as the front ends stop importing each other."""
    found = sources()
    known = {s.module for s in found}
    seen = {(i.importer, i.module) for s in found for i in imports(s, known)}
    assert sorted(FRONT_END_ALLOWED - seen) == [], "allowed, but no longer imported: remove from FRONT_END_ALLOWED"


def test_only_the_writer_writes() -> None:
    found = sources()
    methods = write_methods((ROOT / "src/gpupool_sched/kube/kubeapi.py").read_text())
    assert {"write", "bind", "evict", "post_event", "patch_custom_status", "patch_cluster_custom_status"} <= methods
    assert write_violations(found, methods, generic_names(found, methods)) == []


# ---- the checker can fail -----------------------------------------------------------------------------------
def test_the_rules_catch_violations() -> None:
    fake = [
        Source("gpupool_sched.placement.fake", "a.py", "from gpupool_sched.scheduler.service import SchedulerService"),
        Source("gpupool_sched.model.fake", "b.py", "def late():\n    import gpupool_sched.simulate.run\n"),
        Source("gpupool_sched.status.fake", "c.py", "from gpupool_sched.extender import core"),
        Source("gpupool_sched.cache.fake", "f.py", "from gpupool_sched.scheduler.service import SchedulerService"),
        Source("gpupool_sched.scheduler.fake", "d.py",
               "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..status import render\n"),
        Source("tests.unit.test_fake", "e.py", "from tests.unit.test_gang import assert_same"),
        Source("benchmarks.fake", "f.py", "from test_scheduler_fullpath import NodeKubelet"),
        Source("tests.scheduler.test_other", "g.py", "from .test_cli import kubeconfig"),
        Source("gpupool_sched.scheduler.other", "h.py", "from tests.support.objects import pod_obj"),
        Source("tests.e2e.test_fake", "i.py", "from tests.e2e import helpers"),
        Source("hack.fake", "j.py", "def agent():\n    from deviceplugin.kubelet_standin import KubeletStandin\n"),
    ]
    known = {"gpupool_sched.extender.core", "gpupool_sched.status.render", "tests.unit.test_gang",
             "tests.scheduler.test_cli", "tests.support.objects", "tests.e2e.helpers"}
    found = check(fake, known)
    for path, rule in (("a.py", "(a)"), ("b.py", "(a)"), ("c.py", "(b)"), ("d.py", "(b)"), ("e.py", "(c)"),
                       ("f.py", "(c)"), ("g.py", "(c)"), ("h.py", "(d)"), ("i.py", "(e)"),
                       ("j.py", "(e)")):
        assert any(v.startswith(f"{path}:") and rule in v for v in found), (path, rule, found)
    assert any(v.startswith("d.py:3: gpupool_sched.scheduler.fake imports gpupool_sched.status.render:") for v in found)


def test_what_the_rules_allow() -> None:
    fine = [
        Source("gpupool_sched.extender.core", "a.py", "from gpupool_sched.cache.state import ClusterState"),
        Source("gpupool_sched.placement.fake", "b.py", "from gpupool_sched.model.request import PodRequest"),
        Source("tests.unit.test_fake", "c.py", "from tests.support.clusters import gpu_node"),
        Source("hack.fake", "d.py", "def agent():\n    from tests.support.chart import CHART\n"),
        Source("tests.support", "tests/support/__init__.py", "from . import objects", package=True),
        Source("tests.support.fake", "e.py", "from .objects import pod_obj"),
    ]
    assert check(fine, {"tests.support.objects", "tests.support.clusters", "tests.support.chart"}) == []


def test_the_writer_rule_catches_writes() -> None:
    kubeapi = ("class KubeApi:\n    async def write(self, m, p, b): ...\n"
               "    async def evict(self, ns, n):\n        await self.write('POST', ns, n)\n"
               "    async def patch_custom_status(self, ns, n, s):\n        await self.write('PATCH', ns, s)\n"
               "    def read_lease_sync(self, ns, n): ...\n")
    methods = write_methods(kubeapi)
    assert methods == {"write", "evict", "patch_custom_status"}
    fake = [
        Source("gpupool_sched.scheduler.fake", "a.py", "async def f(self):\n    await self.api.evict('ns', 'p')\n"),
        Source("gpupool_sched.framework.fake", "b.py", "async def f(x):\n    await x.patch_custom_status(1, 2, 3)\n"),
        Source("gpupool_sched.extender.fake", "c.py", "async def f(kube_api):\n    await kube_api.write('P', 1, 2)\n"),
        Source("gpupool_sched.statement", "d.py", "class Statement:\n    def evict(self): ...\n"),
        Source("gpupool_sched.writer.fake", "e.py", "async def f(self):\n    await self.api.evict('ns', 'p')\n"),
        Source("gpupool_sched.status.fake", "f.py", "import sys\nsys.stdout.write('x')\nstatement.evict(1)\n"
               "api.read_lease_sync('ns', 'l')\n"),
        Source("tests.scheduler.test_fake", "g.py", "async def f(api):\n    await api.evict('ns', 'p')\n"),
    ]
    generic = generic_names(fake, methods)
    assert generic == {"write", "evict"}
    found = write_violations(fake, methods, generic)
    assert [v.split(":")[0] for v in found] == ["a.py", "b.py", "c.py"], found
    assert all("(g)" in v for v in found)
