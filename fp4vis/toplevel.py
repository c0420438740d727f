"""The repository's top-level folders ``kernels/``, ``pipelines/`` and ``evals/`` install as
``fp4vis.kernels``, ``fp4vis.pipelines`` and ``fp4vis.evals`` (pyproject.toml's ``package-dir``). When
Python runs in the repository root, the root is on ``sys.path`` and each folder is also visible as a
top-level package of its own name: ``kernels``, ``pipelines`` and ``evals`` are distributions on PyPI
(the Hub's ``kernels`` is a dependency of transformers and diffusers), and the folder would hide them.
Each folder's ``__init__`` calls :func:`yield_to_installed` when it is imported under its top-level
name, so that ``import kernels`` gets the installed package, or where there is none what Python gives for a
folder of that name without an ``__init__`` (an empty namespace package), never our folder."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from pathlib import Path


def yield_to_installed(name: str) -> None:
    """Replace the top-level module ``name`` (one of the folders, being imported by mistake) in
    ``sys.modules`` by the package of that name found on ``sys.path`` without the repository root or, where
    none is installed, by an empty namespace package (``_not_installed``)."""
    folder = Path(sys.modules[name].__file__).resolve().parent
    root = folder.parent
    saved = list(sys.path)
    del sys.modules[name]
    try:
        sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
        importlib.import_module(name)  # the import lock is re-entrant: this nested import fills sys.modules[name]
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        sys.modules[name] = _not_installed(name, folder)
    finally:
        sys.path[:] = saved


def _not_installed(name: str, folder: Path) -> types.ModuleType:
    """What Python imports for a folder without an ``__init__``: a namespace package, with no file, no version and
    here nothing in it (``import name.sub`` is a ModuleNotFoundError, ``from name import x`` an ImportError). The
    libraries' probes for an optional package read exactly that as "not installed" (transformers'
    ``_is_package_available`` imports a name it finds no distribution for, and takes a module without
    ``__file__`` for a folder shadowing it), where a ModuleNotFoundError raised from inside the import would
    escape them."""
    module = types.ModuleType(name, f"No package {name!r} is installed (the folder {folder} is fp4vis.{name}).")
    module.__file__ = None
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = []
    return module
