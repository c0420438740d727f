"""The top-level folders ``kernels/``, ``pipelines/`` and ``evals/`` hide no installed package of the same
name when Python runs in the repository root (``fp4vis/toplevel.py``): all three names are distributions
on PyPI, and the Hub's ``kernels`` is a dependency of transformers and diffusers."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("kernels", "pipelines", "evals")


def _run_in_root(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    # `-c` puts the working directory first on sys.path, as `python -m` and an interactive session do
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_installed_packages_of_the_folders_names_win(tmp_path):
    for name in NAMES:   # stand-in distributions, each a package with a submodule
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'stand-in {name}'\n")
        (tmp_path / name / "sub.py").write_text("VALUE = 7\n")
    code = "\n".join([
        "import importlib, sys",
        f"assert sys.path[0] in ('', {str(ROOT)!r}), sys.path[:2]",
        f"for name in {NAMES!r}:",
        "    top = importlib.import_module(name)",
        "    assert top.WHO == 'stand-in ' + name, (name, top.__file__)",
        "    assert importlib.import_module(name + '.sub').VALUE == 7",
        "    ours = importlib.import_module('fp4vis.' + name)",
        f"    assert ours.__file__ == {str(ROOT)!r} + '/' + name + '/__init__.py', ours.__file__",
        "import fp4vis.kernels.hopper.config, fp4vis.evals.report, fp4vis.pipelines.context_parallel",
        "print('ok')",
    ])
    r = _run_in_root(code, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("name", NAMES)
def test_a_name_not_installed_is_an_empty_namespace_package(name):
    """Where no distribution of the name is installed, ``import name`` gets what a folder without ``__init__``
    gives (no file, nothing inside), which transformers' probe for an optional package reads as not installed
    (transformers 5.17 on the GPU machine probes ``kernels`` so: a ModuleNotFoundError raised inside the import
    escaped it and broke every diffusers model load from the root)."""
    try:
        importlib.metadata.distribution(name)
        pytest.skip(f"a distribution {name!r} is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    code = "\n".join([
        f"import importlib, {name} as top",
        "assert top.__file__ is None and not top.__path__ and not hasattr(top, 'yield_to_installed'), vars(top)",
        "try:",
        f"    importlib.import_module({name!r} + '.hopper' if {name!r} == 'kernels' else {name!r} + '.report')",
        "    raise SystemExit('a submodule of the folder was imported')",
        "except ModuleNotFoundError:",
        "    pass",
        "from transformers.utils.import_utils import _is_package_available",
        f"found = _is_package_available({name!r}, return_version=True)   # the probe is_kernels_available makes",
        "assert found == (False, 'N/A'), found",
        "import fp4vis.kernels.hopper.config, fp4vis.evals.report",
        "print('ok')",
    ])
    r = _run_in_root(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_diffusers_imports_the_hub_kernels_from_the_root():
    """The case that broke a fresh clone: diffusers' PEFT loader does ``from kernels import ...``."""
    pytest.importorskip("kernels")
    r = _run_in_root("import kernels, diffusers.loaders.peft; print(kernels.__file__)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not Path(r.stdout.strip()).resolve().is_relative_to(ROOT / "kernels")
