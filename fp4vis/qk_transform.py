"""What a layer does to its q and k projections before attention, as data: ``QKTransform``.

diffusers' Wan layers RMS-normalise q and k across all heads (``norm_q`` / ``norm_k``) and apply a
rotary embedding; a patched layer hands ``fp4vis.attention`` the raw projections plus this
description, so that a kernel backend can fold the two into its pre-pass (one read of each
projection, no BF16 normed/rotated q and k in memory). Every other path calls :meth:`QKTransform.apply`
first and gets the ordinary q and k, computed exactly as diffusers computes them.

The arithmetic, stated once (``apply``; a fused kernel must give the same bits):

* RMS norm per token over its H*D values, ``torch.nn.functional.rms_norm`` with the module's
  weight and eps (input dtype out).
* Rotary embedding on the normed values in diffusers' Wan form: pairs (x[2i], x[2i+1]),
  ``x[2i] cos[2i] - x[2i+1] sin[2i+1]`` and ``x[2i] sin[2i+1] + x[2i+1] cos[2i]``, in the promoted
  dtype of the values and the tables (float32 tables: float32 products and sum, one rounding to the
  value dtype at the end), cos/sin shaped (1, S, 1, D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rms_eps(norm: torch.nn.Module) -> float:
    """The eps ``torch.nn.RMSNorm`` uses: its own, or float32's machine epsilon where it is None (as
    ``torch.nn.functional.rms_norm`` takes it for BF16/FP16/float32 inputs)."""
    eps = getattr(norm, "eps", None)
    return float(torch.finfo(torch.float32).eps) if eps is None else float(eps)


def apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary embedding of (B, S, H, D) x (as ``WanAttnProcessor`` computes it)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@dataclass(frozen=True, eq=False)
class QKTransform:
    """RMS norms of q and k across heads (weights of H*D values, or None for no norm of that tensor)
    and an optional rotary embedding (cos, sin), applied to (B, S, H, D) projections."""

    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    q_eps: float = 1e-6
    k_eps: float = 1e-6
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_norms(cls, norm_q: torch.nn.Module, norm_k: torch.nn.Module,
                   rope: tuple[torch.Tensor, torch.Tensor] | None) -> QKTransform | None:
        """The transform of a layer whose norms are ``torch.nn.RMSNorm`` over one dimension (with weights)
        or identities; None where a norm is of another kind, subclasses included (the layer then computes
        q and k itself)."""
        weights, eps = [], []
        for norm in (norm_q, norm_k):
            if isinstance(norm, torch.nn.Identity):
                weights.append(None)
                eps.append(0.0)
            elif (type(norm) is torch.nn.RMSNorm and norm.weight is not None
                  and tuple(norm.normalized_shape) == (norm.weight.numel(),)):
                weights.append(norm.weight)
                eps.append(rms_eps(norm))
            else:
                return None
        return cls(weights[0], weights[1], eps[0], eps[1], rope)

    def apply(self, q: torch.Tensor, k: torch.Tensor, layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) normed and rotated as the unpatched layer makes them, in ``layout`` ("bshd": (B, S, H, D),
        or "bhsd": (B, H, S, D) views, returned as such)."""
        if layout == "bhsd":
            qn, kn = self.apply(q.transpose(1, 2), k.transpose(1, 2))
            return qn.transpose(1, 2), kn.transpose(1, 2)
        return self.apply_one(q, self.q_weight, self.q_eps), self.apply_one(k, self.k_weight, self.k_eps)

    def apply_one(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is not None:
            x = torch.nn.functional.rms_norm(x.flatten(2), (weight.numel(),), weight, eps).unflatten(2, x.shape[2:])
        if self.rope is not None:
            x = apply_rotary_emb(x, *self.rope)
        return x
