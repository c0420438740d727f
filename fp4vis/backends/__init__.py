"""Attention backends behind ``fp4vis.attention``: the interface (``base``), the reference
(``reference``) and the registry that picks one per call (``registry``)."""

from .base import AUTO, REFERENCE, Backend, device_capability
from .registry import (
                       available_backends,
                       backend_names,
                       get_backend,
                       kernel_backend_name,
                       register_backend,
                       select_backend,
)

__all__ = ["AUTO", "REFERENCE", "Backend", "available_backends", "backend_names",
           "device_capability", "get_backend", "kernel_backend_name", "register_backend", "select_backend"]
