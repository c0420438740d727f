"""The repository's top-level folders ``kernels/``, ``pipelines/`` and ``evals/`` install as
``fp4vis.kernels``, ``fp4vis.pipelines`` and ``fp4vis.evals`` (pyproject.toml's ``package-dir``). When
Python runs in the repository root, the root is on ``sys.path`` and each folder is also visible as a
top-level package of its own name: ``kernels``, ``pipelines`` and ``evals`` are distributions on PyPI
(the Hub's ``kernels`` is a dependency of transformers and diffusers), and the folder would hide them.
Each folder's ``__init__`` calls :func:`yield_to_installed` when it is imported under its top-level
name, so that ``import kernels`` gets what it would get without the checkout on the path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def yield_to_installed(name: str) -> None:
    """Replace the top-level module ``name`` (one of the folders, being imported by mistake) in
    ``sys.modules`` by the package of that name found on ``sys.path`` without the repository root, or
    raise ``ModuleNotFoundError`` as if the folder were not there."""
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
        raise ModuleNotFoundError(f"No module named {name!r} (the folder {folder} is fp4vis.{name})",
                                  name=name) from None
    finally:
        sys.path[:] = saved
