"""User errors: ``UsageError`` (a bad option, a missing path, a GPU-only option without a GPU; the CLI prints
its message as one line and exits with status 2) and ``require``, the check of an optional dependency."""

from __future__ import annotations


class UsageError(ValueError):
    """A user-facing error (bad option, missing path, GPU-only option without a GPU). The CLI prints
    its message without a traceback and exits with status 2."""


def require(module: str, pip_name: str | None = None, what: str = "this command") -> None:
    """Import check with an install hint (optional dependencies: torchvision, matplotlib, skimage)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{what} needs {pip_name or module}: pip install {pip_name or module}") from None
