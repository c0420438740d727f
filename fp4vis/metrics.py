"""Error metrics used across tests, evals and benchmarks. All are computed in float64 over the
flattened tensors, so the result does not depend on dtype or shape."""

from __future__ import annotations

import torch


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).double()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity ``<a, b> / (||a|| ||b||)`` of the flattened tensors; 1.0 when both are
    zero, 0.0 when exactly one is."""
    a, b = _flat(a), _flat(b)
    na, nb = a.norm(), b.norm()
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a.dot(b) / (na * nb))


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``||a - ref|| / ||ref||`` (Frobenius norms of the flattened tensors);
    ``||a||`` itself when ref is zero."""
    a, ref = _flat(a), _flat(ref)
    denom = ref.norm()
    diff = (a - ref).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Root-mean-square error ``sqrt(mean((a - ref)**2))``."""
    a, ref = _flat(a), _flat(ref)
    return float(((a - ref) ** 2).mean().sqrt()) if a.numel() else 0.0
