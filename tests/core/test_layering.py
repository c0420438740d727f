"""The package's structure (docs/design.md): imports run one way, core <- backends <- patching <- apps,
and no module imports one that imports it back (directly or through others). Read from the source
with ``ast``, function-level imports included, so a lazy import cannot hide a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# source folder -> package it installs as (pyproject.toml's package-dir)
SOURCES = {"fp4vis": "fp4vis", "kernels": "fp4vis.kernels", "pipelines": "fp4vis.pipelines", "evals": "fp4vis.evals"}
LAYERS = {  # module prefix -> layer (lower imports nothing higher)
    "fp4vis.settings": 0, "fp4vis.formats": 0, "fp4vis.scale_range": 0, "fp4vis.policy": 0, "fp4vis.key_positions": 0,
    "fp4vis.reference": 0, "fp4vis.range_report": 0, "fp4vis.metrics": 0, "fp4vis.attention": 0, "fp4vis.files": 0,
    "fp4vis.qk_transform": 0,
    "fp4vis.tracing": 0, "fp4vis.call": 0,
    "fp4vis.toplevel": 0,
    "fp4vis.backends": 1, "fp4vis.kernels": 1,
    "fp4vis.patching": 2,
    # the apps: fp4vis.services.* (what they share, one module per job: usage, runtime, policies, guard_plans,
    # sources, console, environment, outputs, timing), the command line, video generation, the evals, the zoo
    "fp4vis.services": 3, "fp4vis.cli": 3, "fp4vis.pipelines": 3, "fp4vis.evals": 3, "fp4vis.zoo": 3,
}
SERVICES = "fp4vis.services"   # the apps' shared modules: below every other app, and no facade
# the calls upwards the design has: the entry point hands the call to the registry and reads the range record
ALLOWED_UP = {("fp4vis.attention", "fp4vis.backends.registry"), ("fp4vis.attention", "fp4vis.backends.range_record")}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts]) if parts else package] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (the longest known module of each import)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # names that are modules of a package import those modules, not the package's __init__
            targets = subs if all(t in known for t in subs) else [*subs, base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "fp4vis":
                found.add(t)
    return found


def _layer(module: str) -> int:
    return max((lvl for prefix, lvl in LAYERS.items() if module == prefix or module.startswith(prefix + ".")),
               default=-1)


MODULES = _modules()
GRAPH = {m: _imports(m, p, set(MODULES)) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "fp4vis" and _layer(m) < 0] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "fp4vis"))
def test_imports_run_downwards(module):
    up = [t for t in GRAPH[module] if _layer(t) > _layer(module) and (module, t) not in ALLOWED_UP]
    assert up == [], f"{module} (layer {_layer(module)}) imports higher layers: {up}"


def test_no_import_cycle():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


def test_only_apps_import_the_package_root():
    """``import fp4vis`` (the public facade, which imports the patching layer) from a lower layer
    would make every lower module depend on everything."""
    offenders = []
    for m, p in MODULES.items():
        if m == "fp4vis" or _layer(m) >= 3:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "fp4vis" for a in node.names):
                offenders.append(m)
            if (isinstance(node, ast.ImportFrom) and node.module == "fp4vis" and not node.level
                    and any(f"fp4vis.{a.name}" not in MODULES for a in node.names)):
                offenders.append(m)   # `from fp4vis import patch`: a name of the facade, not a module
    assert offenders == []


def test_services_import_no_other_app():
    """The apps' shared modules are the bottom of the apps: none imports the CLI, a pipeline, an eval or the zoo."""
    up = {m: sorted(t for t in GRAPH[m] if _layer(t) == 3 and not _in(t, SERVICES))
          for m in MODULES if _in(m, SERVICES)}
    assert {m: ts for m, ts in up.items() if ts} == {}


def test_services_package_reexports_nothing():
    """``fp4vis/services/__init__.py`` is a docstring listing its modules: each name is imported from the module
    that holds it, never through a facade."""
    body = ast.parse(MODULES[SERVICES].read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


APP_SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")])


@pytest.mark.parametrize("path", sorted([p for m, p in MODULES.items() if _layer(m) == 3] + APP_SCRIPTS),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_apps_import_no_private_name(path):
    """An app, benchmark or script imports no other module's private name (``from m import _name``): what
    another module uses is public there."""
    private = [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and not node.level
               for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
