"""Attention baselines: the attention functions fp4vis is timed against (``kernel_bench``, the Wan and
pipeline evals): BF16 forwards, and the 8-bit peers a Hopper user could pick instead.

Each baseline builds an attention function ``fn(q, k, v, scale=None)`` (``scale=None``: 1/sqrt(D)) over
tensors in one layout: ``"bhsd"`` (B, H, S, D: the kernel benchmark's) or ``"bshd"`` (B, S, H, D: the
Wan attention processor's, and flash-attn-4's own, so no transposes there). Its library is imported
when the function is built, so that this module imports everywhere:

* ``fa4``: flash-attn-4 (``flash_attn.cute.flash_attn_func``), BF16 forward, non-causal;
* ``fa3``: FlashAttention-3 (``flash_attn_interface.flash_attn_func``, the ``flash_attn_3`` package built from
  flash-attention's ``hopper/``), BF16 forward, non-causal;
* ``fa3_fp8``: FlashAttention-3's FP8 forward: q, k and v cast to E4M3 with one float32 scale per (batch, head),
  amax / 448 (FA3's ``q_descale`` / ``k_descale`` / ``v_descale``, shape (B, H)), by torch operations (a few
  kernels per tensor, eager; fused where compiled), the output BF16; ``fa3_fp8_parts`` splits the cast from the
  kernel (``kernel_bench``'s ``fa3_fp8_kernel``, the figure to compare kernels by);
* ``sage``: SageAttention (``sageattention.sageattn``, ``tensor_layout`` "HND" / "NHD" for the layout);
* ``sdpa_cudnn`` / ``sdpa_flash``: torch SDPA under ``torch.nn.attention.sdpa_kernel`` with the cuDNN /
  flash backend.

diffusers' own attention backends do not serve as these baselines: its flash-attn-4 backend loads the
kernel from the Hub (``flash_4_hub``) and its ``sage`` backend needs sageattention >= 2.1.1, so fp4vis
calls the libraries itself. ``unavailable(name)`` says why a baseline cannot run here (None: it can);
``select_baselines`` turns the evals' ``baselines`` option (``eval wan``, ``eval pipeline``) into the names to
run and the reasons the others were skipped; ``run_name`` names their runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fp4vis.formats import E4M3_MAX
from fp4vis.services.usage import UsageError

LAYOUTS = ("bhsd", "bshd")
AttentionFn = Callable[..., torch.Tensor]   # fn(q, k, v, scale=None) -> out, in the layout it was built for


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")


_OPS: dict[str, object] = {}


def _one_graph_node(name: str, layout: str, call: AttentionFn, takes_key_mask: bool = False) -> AttentionFn:
    """``call`` itself when eager; under torch.compile the custom op ``fp4vis_baselines::<name>_<layout>``
    around it: the library's launcher (CuTe DSL, Triton) is Python that Dynamo cannot trace, and a graph
    break per layer would cost the speed being measured (diffusers wraps flash-attn-3 the same way).
    ``takes_key_mask``: ``call(q, k, v, scale, key_mask)`` also takes a bool (B, Skv) key-padding mask (None:
    none), and the function says so (``takes_key_mask`` attribute: the patcher then hands it masked calls)."""
    qualname = f"fp4vis_baselines::{name}_{layout}"
    op = _OPS.get(qualname)
    if op is None:
        mask_arg = ", Tensor? key_mask" if takes_key_mask else ""
        op = torch.library.custom_op(qualname, mutates_args=(),
                                     schema=f"(Tensor q, Tensor k, Tensor v, float? scale{mask_arg}) -> Tensor")(
            lambda *args: call(*args).contiguous())
        op.register_fake(lambda q, k, v, *rest: q.new_empty(q.shape[:-1] + v.shape[-1:]))
        _OPS[qualname] = op

    def fn(q, k, v, scale=None, key_mask=None):
        if key_mask is not None and not takes_key_mask:
            raise ValueError(f"key_mask: the {name} baseline takes no mask")
        args = (q, k, v, scale) + ((key_mask,) if takes_key_mask else ())
        return op(*args) if torch.compiler.is_compiling() else call(*args)
    fn.takes_key_mask = takes_key_mask
    return fn


def _fa4(layout: str) -> AttentionFn:
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    from fp4vis.kernels.kept_keys import kept_keys

    def call(q, k, v, scale=None, key_mask=None):
        if key_mask is None:
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=False)
        else:   # each element's kept keys to the front, their count as FA4's seqused_k (no host sync)
            kept = kept_keys(k.transpose(1, 2), v.transpose(1, 2), key_mask)
            out = flash_attn_varlen_func(q, kept.k.transpose(1, 2), kept.v.transpose(1, 2), seqused_k=kept.lengths,
                                         softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out   # some versions also return the LSE

    # the op over FA4's own layout, the transposes around it views in the graph: no copy of the output (a bhsd
    # op's would be one, its fake's strides being contiguous bhsd's), where diffusers' attention wants bshd back
    bshd = _one_graph_node("fa4", "bshd", call, takes_key_mask=True)
    if layout == "bshd":
        return bshd

    def bhsd(q, k, v, scale=None, key_mask=None):
        return bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, key_mask).transpose(1, 2)
    bhsd.takes_key_mask = True
    return bhsd


def _fa3_forward(layout: str, q, k, v, scale=None, **descales):
    """FA3's non-causal forward of ``layout`` tensors (it takes bshd: for bhsd the transposes are views)."""
    from flash_attn_interface import flash_attn_func

    if layout == "bhsd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=False, **descales)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2) if layout == "bhsd" else out


def _fa3(layout: str) -> AttentionFn:
    import flash_attn_interface  # noqa: F401 - unavailable() builds to check the import

    def call(q, k, v, scale=None):
        return _fa3_forward(layout, q, k, v, scale)
    return _one_graph_node("fa3", layout, call)


def e4m3_per_head(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x in E4M3 over one float32 scale per (batch, head), amax / 448 (at least the smallest normal float32, so an
    all-zero head stays zero), and that scale as FA3's descale, shape (B, H)."""
    _check_layout(layout)
    head_dim = 1 if layout == "bhsd" else 2
    reduce_dims = tuple(d for d in (1, 2, 3) if d != head_dim)
    descale = (x.abs().amax(dim=reduce_dims).float() / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    x8 = (x.float() / descale.unsqueeze(reduce_dims[0]).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return x8, descale


def fa3_fp8_parts(layout: str) -> tuple[Callable, Callable]:
    """FlashAttention-3's FP8 forward in two steps: ``cast(q, k, v)`` -> ((q8, descale), (k8, ...), (v8, ...))
    (``e4m3_per_head``) and ``kernel(operands, scale)`` -> the BF16 output."""
    import flash_attn_interface  # noqa: F401 - unavailable() builds to check the import

    def cast(q, k, v):
        return tuple(e4m3_per_head(x, layout) for x in (q, k, v))

    def kernel(operands, scale=None):
        (q8, dq), (k8, dk), (v8, dv) = operands
        return _fa3_forward(layout, q8, k8, v8, scale, q_descale=dq, k_descale=dk, v_descale=dv)
    return cast, kernel


def _fa3_fp8(layout: str) -> AttentionFn:
    cast, kernel = fa3_fp8_parts(layout)

    def call(q, k, v, scale=None):
        return kernel(cast(q, k, v), scale)
    return _one_graph_node("fa3_fp8", layout, call)


def _sage(layout: str) -> AttentionFn:
    from sageattention import sageattn

    tensor_layout = "HND" if layout == "bhsd" else "NHD"

    def call(q, k, v, scale=None):
        return sageattn(q, k, v, tensor_layout=tensor_layout, is_causal=False, sm_scale=scale)
    return _one_graph_node("sage", layout, call)


def _sdpa(kind: str) -> Callable[[str], AttentionFn]:
    def build(layout: str) -> AttentionFn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kind]

        def call(q, k, v, scale=None):
            if layout == "bshd":   # SDPA takes bhsd
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
            return out.transpose(1, 2) if layout == "bshd" else out
        return call
    return build


@dataclass(frozen=True)
class Baseline:
    """A named attention: ``build(layout)`` imports its library and returns the function."""

    name: str
    label: str          # what progress bars call it
    description: str
    build: Callable[[str], AttentionFn]
    needs_cuda: bool = True


BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("fa4", "flash-attn-4", "flash-attn-4 (flash_attn.cute.flash_attn_func)", _fa4),
    Baseline("fa3", "FlashAttention-3", "FlashAttention-3 (flash_attn_interface.flash_attn_func), BF16", _fa3),
    Baseline("fa3_fp8", "FlashAttention-3 FP8", "FlashAttention-3's FP8 forward, E4M3 q/k/v scaled per (batch, head)",
             _fa3_fp8),
    Baseline("sage", "SageAttention", "SageAttention (sageattention.sageattn)", _sage),
    Baseline("sdpa_cudnn", "SDPA cuDNN", "torch SDPA, cuDNN backend", _sdpa("cudnn")),
    Baseline("sdpa_flash", "SDPA flash", "torch SDPA, flash backend", _sdpa("flash")),
)}
# what the evals run by default, where they can: what a user who wants speed switches the attention to
AUTO_BASELINES = ("fa4", "sage")


def attention_function(name: str, layout: str = "bhsd") -> AttentionFn:
    """The attention function of baseline ``name`` over ``layout`` tensors (imports its library)."""
    _check_layout(layout)
    if name not in BASELINES:
        raise KeyError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    return BASELINES[name].build(layout)


def attention_functions(name: str) -> dict[str, AttentionFn]:
    """Baseline ``name``'s function in each layout, {layout: fn}: what
    ``fp4vis.patching.attention_function.attention_function_applied`` takes to give each layer its own."""
    return {layout: attention_function(name, layout) for layout in LAYOUTS}


def run_name(name: str, layers: str) -> str:
    """The evals' run name of baseline ``name`` in ``layers``: ``attn1=fa4`` (eval wan), ``attn=fa4``."""
    return f"{layers}={name}"


def unavailable(name: str, device: torch.device | str | None = None) -> str | None:
    """Why baseline ``name`` cannot run on ``device`` (default: this machine's CUDA device), or None
    when it can: a CUDA device is there (for the baselines that need one) and its library imports."""
    baseline = BASELINES.get(name)
    if baseline is None:
        return f"unknown baseline {name!r}"
    if baseline.needs_cuda:
        if not torch.cuda.is_available():
            return "no CUDA device"
        if device is not None and torch.device(device).type != "cuda":
            return f"needs a CUDA device (device here: {device})"
    try:
        baseline.build("bhsd")
    except Exception as exc:   # ImportError, or a library that fails at import on this machine
        return f"{type(exc).__name__}: {exc}"
    return None


def _names(spec: str | Sequence[str]) -> list[str]:
    """A comma-separated string or a list -> names, stripped, in order, each once."""
    items = spec.split(",") if isinstance(spec, str) else spec
    return list(dict.fromkeys(n.strip() for n in items if n.strip()))


def select_baselines(spec: str | Sequence[str] | None, device: torch.device | str | None = None
                     ) -> tuple[list[str], dict[str, str]]:
    """The evals' ``baselines`` option -> (names to run, {name: why skipped}). ``"auto"``: each of
    AUTO_BASELINES that can run on ``device``, the others skipped with their reason; ``None``, ``""`` or
    ``"none"``: none; names (a list or a comma-separated string): those, where an unknown name or one
    that cannot run here is a UsageError (before any work)."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "none")):
        return [], {}
    if isinstance(spec, str) and spec.strip() == "auto":
        reasons = {n: unavailable(n, device) for n in AUTO_BASELINES}
        return [n for n, why in reasons.items() if why is None], {n: why for n, why in reasons.items() if why}
    names = _names(spec)
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise UsageError(f"baselines: unknown baseline {unknown[0]!r}; use auto, none, or some of "
                         f"{', '.join(BASELINES)} (comma-separated)")
    for n in names:
        why = unavailable(n, device)
        if why is not None:
            raise UsageError(f"baselines: {n!r} cannot run here: {why}")
    return names, {}
