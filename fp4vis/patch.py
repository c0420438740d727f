"""Per-layer FP4 attention for existing models: ``fp4vis.patch`` / ``fp4vis.unpatch``.

``patch(model_or_pipeline, policy="fast", *, layers=None, guard=None, backend="auto", strict=False)``
finds the attention layers fp4vis knows how to reach, resolves one policy per layer, installs a
per-layer hook through the library's own extension point, and returns a :class:`PatchHandle`
(``handle.remove()``, or use it as a context manager). Nothing global is monkeypatched:

* diffusers Wan2.1/2.2 (``WanAttention``): an attention processor set with ``attn.set_processor``
  (``fp4vis.patchers.wan``); self-attention (``attn1``) by default, cross-attention (``attn2``) when
  asked (``cross_attention=True`` or a name pattern in ``layers``).
* timm (``timm.layers.Attention``, the vision_transformer attention): a per-instance ``forward``
  (``fp4vis.patchers.timm_vit``); the class is untouched.
* transformers ViT / ViTMAE: an ``AttentionInterface`` function selected through the layers'
  ``config._attn_implementation`` (``fp4vis.patchers.hf_vit``); unpatched layers that share the
  config go through the original implementation, bit for bit. MAE: encoder only by default (as in
  the paper), decoder with ``decoder=True`` or a name pattern.

Per-layer policy resolution (first to last, later steps win):

1. every default layer gets ``policy``;
2. ``layers`` entries, in their order: an ``int`` key selects the default layers with that index
   (the block index within its stack), a ``str`` key is an ``fnmatch`` pattern over the layer
   names (``handle.layers`` lists them; a pattern may also select non-default layers such as
   ``"*attn2"``). A key that selects no layer is an error. Values: a policy name, a
   :class:`~fp4vis.policy.Policy`, or ``None`` / ``"exact"`` / ``"bf16"`` for the model's own
   exact attention;
3. the guard plan: each guarded layer whose policy is a Direct-P policy gets the plan's guard policy
   (exact and ``nv_fp8`` layers stay as they are).

A layer whose resolved policy is exact is not touched at all. At call time a patched layer keeps
the model's exact attention, with one :class:`FallbackWarning` naming the layer and the reason,
when fp4vis cannot compute it (attention mask, causal attention, dropout in training mode,
grouped-query attention, a head dim / dtype / device the backend lacks, gradients requested);
``strict=True`` raises :class:`FallbackError` instead.

Patching a layer that is already patched raises ``RuntimeError`` (no double wrap); remove the old
handle (or call ``fp4vis.unpatch``) first.
"""

from __future__ import annotations

import fnmatch
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4vis.policy import Policy, get_policy

__all__ = [
    "FallbackError", "FallbackWarning", "LayerSpec", "LayerState", "PatchHandle", "patch", "unpatch",
    "resolve_policy", "EXACT_NAMES",
]

#: policy values that mean "keep the model's own exact attention"
EXACT_NAMES = ("exact", "bf16", "none")

_STATE_ATTR = "_fp4vis_state"
_SUPPORTED_TEXT = (
    "diffusers WanAttention (WanTransformer3DModel, WanPipeline, WanImageToVideoPipeline), "
    "timm.layers.Attention (timm vision_transformer Block / ResPostBlock / ParallelThingsBlock: ViT, "
    "DeiT, ...), transformers ViTAttention / ViTMAEAttention"
)


class FallbackWarning(UserWarning):
    """A patched layer keeps exact attention for a reason named in the message."""


class FallbackError(RuntimeError):
    """Raised instead of :class:`FallbackWarning` when ``strict=True``."""


# ------------------------------------------------------------------------------------------------
# layer discovery


@dataclass(eq=False)
class LayerSpec:
    """One attention layer a patcher can reach."""

    name: str               # qualified name relative to the object given to patch()
    module: torch.nn.Module
    index: int              # position within its stack (the block index)
    group: str              # "self" | "cross" (Wan), "encoder" | "decoder" (MAE), "attn" (timm, ViT)
    default: bool           # patched by the base policy without being named
    patcher: str            # "wan" | "timm_vit" | "hf_vit"
    num_heads: int
    head_dim: int
    component: str = ""     # pipeline component ("transformer", "transformer_2") or ""
    local_name: str = ""    # name inside its component


def _patcher_modules() -> list[Any]:
    """The patcher modules whose library is already imported (a model of a library that was never
    imported cannot exist, so this never imports diffusers/timm/transformers itself)."""
    mods = []
    if "diffusers" in sys.modules:
        from fp4vis.patchers import wan
        mods.append(wan)
    if "timm" in sys.modules:
        from fp4vis.patchers import timm_vit
        mods.append(timm_vit)
    if "transformers" in sys.modules:
        from fp4vis.patchers import hf_vit
        mods.append(hf_vit)
    return mods


_DENOISER_COMPONENTS = ("transformer", "transformer_2", "unet")


def _roots(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    """(component name, module) pairs to search: a module itself, or a pipeline's denoisers."""
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    comps = getattr(obj, "components", None)
    if isinstance(comps, Mapping):
        roots = [(n, m) for n, m in comps.items() if n in _DENOISER_COMPONENTS and isinstance(m, torch.nn.Module)]
        if roots:
            return roots
        raise TypeError(f"fp4vis.patch: pipeline {type(obj).__name__} has no denoiser component "
                        f"({', '.join(_DENOISER_COMPONENTS)}) holding a torch module")
    raise TypeError(f"fp4vis.patch: expected a torch.nn.Module or a diffusers pipeline, got {type(obj).__name__}")


def _looks_like_attention(module: torch.nn.Module) -> bool:
    n = type(module).__name__
    return (n.endswith(("Attention", "Attn", "SelfAttention")) or "Attention" in n) and not n.endswith(
        ("Processor", "Output", "Pooling"))


def find_layers(obj: Any, *, cross_attention: bool = False, decoder: bool = False) -> tuple[
        list[LayerSpec], list[tuple[str, str]]]:
    """All reachable attention layers of a model or pipeline, and the unsupported attention-like
    modules found next to them as (name, class) pairs."""
    specs: list[LayerSpec] = []
    unsupported: list[tuple[str, str]] = []
    mods = _patcher_modules()
    for comp, root in _roots(obj):
        found: list[LayerSpec] = []
        for pm in mods:
            found.extend(pm.find_layers(root, cross_attention=cross_attention, decoder=decoder))
        reached = {id(s.module) for s in found}
        for s in found:
            s.component = comp
            s.local_name = s.name
            s.name = f"{comp}.{s.name}" if comp else s.name
        specs.extend(found)
        for name, m in root.named_modules():
            if id(m) in reached or not _looks_like_attention(m):
                continue
            if any(id(c) in reached for c in m.modules()):
                continue  # a container of supported layers (e.g. a transformers ViTAttention parent)
            if any(pm.is_known_non_attention(m) for pm in mods):
                continue
            unsupported.append((f"{comp}.{name}" if comp else name, type(m).__qualname__))
    return specs, unsupported


# ------------------------------------------------------------------------------------------------
# policy resolution


def resolve_policy(value: Any) -> Policy | None:
    """A ``layers`` value or base policy -> Policy, or None for the model's own exact attention."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in EXACT_NAMES:
        return None
    pol = get_policy(value)
    return None if pol.method == "exact" else pol


def _select(specs: list[LayerSpec], key: Any) -> list[LayerSpec]:
    if isinstance(key, bool):
        raise TypeError(f"layers: key {key!r} must be a layer index (int) or a name pattern (str)")
    if isinstance(key, int):
        return [s for s in specs if s.default and s.index == key]
    if isinstance(key, str):
        return [s for s in specs if fnmatch.fnmatchcase(s.name, key) or (
            s.local_name != s.name and fnmatch.fnmatchcase(s.local_name, key))]
    raise TypeError(f"layers: key {key!r} must be a layer index (int) or a name pattern (str)")


def resolve_layer_policies(specs: list[LayerSpec], policy: Any, layers: Mapping | None,
                           plan: Any = None) -> dict[str, Policy | None]:
    """name -> Policy | None for every spec (see the module docstring for the order)."""
    base = resolve_policy(policy)
    out: dict[str, Policy | None] = {s.name: (base if s.default else None) for s in specs}
    if layers is not None:
        if not isinstance(layers, Mapping):
            raise TypeError("layers: expected a mapping {layer index or name pattern: policy}, got "
                            f"{type(layers).__name__}")
        for key, value in layers.items():
            chosen = _select(specs, key)
            if not chosen:
                raise ValueError(f"layers: key {key!r} matches no attention layer; layers are "
                                 f"{_names_summary(specs)}")
            pol = resolve_policy(value)
            for s in chosen:
                out[s.name] = pol
    if plan is not None:
        if base is not None and base.name != plan.policy.name:
            warnings.warn(f"guard plan was calibrated for policy {plan.policy.name!r} but the model is patched "
                          f"with {base.name!r}: its decisions may not fit this policy's range "
                          f"(calibrate again with policy={base.name!r})", RuntimeWarning, stacklevel=3)
        for s in plan.match(specs):
            if out[s.name] is not None and out[s.name].is_direct_p:
                out[s.name] = plan.guard_policy
    return out


def _names_summary(specs: list[LayerSpec], limit: int = 12) -> str:
    names = [f"{s.name} (index {s.index}{'' if s.default else ', not default'})" for s in specs]
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "(none)"


# ------------------------------------------------------------------------------------------------
# per-layer runtime state


_UNSET = object()


class LayerState:
    """What a patched layer consults on every call. Patchers call :meth:`select` with the layer's
    q, k, v and then either :meth:`attention` (a Policy came back) or their exact path (None)."""

    def __init__(self, spec: LayerSpec, policy: Policy | None, *, backend: str, range_check: str,
                 strict: bool, handle: PatchHandle):
        self.name = spec.name
        self.index = spec.index
        self.group = spec.group
        self.policy = policy
        self.backend = backend
        self.range_check = range_check
        self.strict = strict
        self.override: Any = _UNSET       # a per-step override: Policy, None (exact) or _UNSET
        self.recorder: Callable | None = None   # calibration: recorder(state, q, k, scale, layout)
        self.auto: Any = None             # guard="auto": an object with .decide(state, q, k, scale, layout)
        self.warned: set[str] = set()
        self.calls = 0                    # FP4 calls (for tests and summaries)
        self.fallbacks = 0
        # a strong reference: the patched module keeps its handle alive, so that unpatch(model)
        # finds it even when the caller dropped the handle
        self.handle = handle

    def active_policy(self) -> Policy | None:
        return self.policy if self.override is _UNSET else self.override

    def needs_qkv(self) -> bool:
        """False when the layer would run the model's exact attention untouched."""
        return self.active_policy() is not None or self.recorder is not None or self.auto is not None

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bhsd",
               scale: float | None = None, mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, extra_reason: str | None = None) -> Policy | None:
        """Record calibration statistics, then return the policy for this call or None (exact)."""
        if self.recorder is not None:
            self.recorder(self, q, k, scale, layout)
        if self.auto is not None:
            self.auto.decide(self, q, k, scale, layout)
        pol = self.active_policy()
        if pol is None:
            return None
        reason = extra_reason or fallback_reason(q, k, v, pol, layout=layout, scale=scale, mask=mask,
                                                 dropout_p=dropout_p, is_causal=is_causal,
                                                 backend=self.backend)
        if reason is not None:
            self.fallback(reason)
            return None
        return pol

    def fallback(self, reason: str) -> None:
        msg = f"fp4vis: layer {self.name!r} keeps exact attention: {reason}"
        if self.strict:
            raise FallbackError(msg + " (strict=True)")
        self.fallbacks += 1
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(msg, FallbackWarning, stacklevel=3)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *,
                  layout: str = "bhsd", scale: float | None = None) -> torch.Tensor:
        from fp4vis.attention import attention as fp4_attention
        self.calls += 1
        return fp4_attention(q, k, v, policy=policy, scale=scale, layout=layout, backend=self.backend,
                             range_check=self.range_check)

    def __repr__(self) -> str:
        pol = self.active_policy()
        return f"LayerState({self.name!r}, index={self.index}, policy={pol.name if pol else 'exact'})"


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


def fallback_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *, layout: str,
                    scale: float | None, mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                    backend: str = "auto") -> str | None:
    """Why fp4vis cannot compute this call (None when it can)."""
    if mask is not None:
        return "attention mask given (fp4vis.attention takes no mask)"
    if is_causal:
        return "causal attention (fp4vis.attention is non-causal)"
    if dropout_p and dropout_p > 0:
        return f"attention dropout p={dropout_p:g} in training mode"
    qb, kb, vb = (_to_bhsd(t, layout) for t in (q, k, v))
    if qb.shape[1] != kb.shape[1] or kb.shape[1] != vb.shape[1]:
        return (f"grouped-query attention ({qb.shape[1]} query heads, {kb.shape[1]} key heads, "
                f"{vb.shape[1]} value heads)")
    if qb.shape[-1] != kb.shape[-1]:
        return f"query and key head dims differ (q {qb.shape[-1]}, k {kb.shape[-1]})"
    if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.dtype != q.dtype for t in (q, k, v)):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (fp4vis takes one of float16, bfloat16, float32)"
    if policy.is_direct_p or policy.method == "nv_fp8":
        return backend_reason(qb, kb, vb, policy, scale, backend)
    return None


def backend_reason(q, k, v, policy, scale, backend: str) -> str | None:
    """Ask the backend registry whether the backend can run these bhsd tensors.

    An explicit backend must support the call. With ``"auto"`` the question goes to the kernel that
    ``fp4vis.dispatch`` would pick for this GPU: when that kernel lacks the call (a head dim, a
    dtype), the layer keeps exact attention rather than dropping to the slow reference emulation.
    Without a kernel for the device (CPU, other GPUs) auto means the reference, which runs anything.
    """
    from fp4vis import dispatch

    if backend == "auto":
        name = dispatch.kernel_backend_name(q.device)
        if name is None or dispatch.get_backend(name) is None:
            return None  # the dispatcher uses the reference and says so
    else:
        name = backend
    try:
        be = dispatch.get_backend(name)
    except Exception as exc:  # noqa: BLE001 - report any lookup problem as the reason
        return f"backend {name!r} unavailable ({exc})"
    if be is None:
        return f"backend {name!r} unavailable"
    try:
        return be.unsupported_reason(q, k, v, policy, scale if scale is not None else q.shape[-1] ** -0.5)
    except Exception as exc:  # noqa: BLE001
        return f"backend {name!r} cannot check these inputs ({exc})"


# ------------------------------------------------------------------------------------------------
# the handle


@dataclass(eq=False)
class _Installed:
    spec: LayerSpec
    state: LayerState
    patcher: Any
    token: Any = None


@dataclass(eq=False)
class PatchHandle:
    """Result of :func:`patch`. ``handle.remove()`` restores every layer (idempotent); usable as a
    context manager. ``handle.layers`` maps every reachable layer name to its LayerState (patched
    layers) or None (left exact)."""

    target: Any
    backend: str
    strict: bool
    range_check: str
    _installed: list[_Installed] = field(default_factory=list)
    specs: list[LayerSpec] = field(default_factory=list)
    guard_plan: Any = None
    removed: bool = False

    @property
    def layers(self) -> dict[str, LayerState | None]:
        by_name = {i.spec.name: i.state for i in self._installed}
        return {s.name: by_name.get(s.name) for s in self.specs}

    @property
    def policies(self) -> dict[str, str | None]:
        """layer name -> policy name of the patched layers (None: exact, not patched)."""
        out = {}
        for name, st in self.layers.items():
            pol = st.active_policy() if st is not None else None
            out[name] = pol.name if pol is not None else None
        return out

    @property
    def states(self) -> list[LayerState]:
        return [i.state for i in self._installed]

    def set_override(self, policy: Any = _UNSET) -> None:
        """Run every patched layer with ``policy`` (None/"exact": the model's exact attention) until
        ``clear_override()``; used by the per-step schedule. Layers left exact stay exact."""
        pol = _UNSET if policy is _UNSET else resolve_policy(policy)
        for st in self.states:
            st.override = pol

    def clear_override(self) -> None:
        self.set_override(_UNSET)

    def remove(self) -> None:
        if self.removed:
            return
        errors = []
        for inst in reversed(self._installed):
            try:
                inst.patcher.uninstall(inst.spec, inst.state, inst.token)
            except Exception as exc:  # noqa: BLE001 - restore the rest, then report
                errors.append(f"{inst.spec.name}: {exc}")
            if getattr(inst.spec.module, _STATE_ATTR, None) is inst.state:
                delattr(inst.spec.module, _STATE_ATTR)
        self._installed.clear()
        self.removed = True
        if errors:
            raise RuntimeError("fp4vis: could not restore " + "; ".join(errors))

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def summary(self) -> str:
        lines = [f"fp4vis patch of {type(self.target).__name__} (backend={self.backend})"]
        for name, pol in self.policies.items():
            lines.append(f"  {name}: {pol or 'exact'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n = sum(p is not None for p in self.policies.values())
        return f"PatchHandle({type(self.target).__name__}, {n}/{len(self.specs)} layers patched" + (
            ", removed)" if self.removed else ")")


def _check_backend(backend: str, strict: bool) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name, got {type(backend).__name__}")
    if backend == "auto":
        return
    from fp4vis import dispatch

    be = dispatch.get_backend(backend)  # unknown names raise ValueError listing the known ones
    if be is None:
        msg = (f"fp4vis.patch: backend {backend!r} is not available here "
               f"({dispatch.available_backends().get(backend)}); patched layers keep exact attention")
        if strict:
            raise FallbackError(msg + " (strict=True)")
        warnings.warn(msg, FallbackWarning, stacklevel=3)


def _check_range_check(range_check: str) -> None:
    if range_check not in ("raise", "warn", "off"):
        raise ValueError(f"range_check: expected 'raise', 'warn' or 'off', got {range_check!r}")


def patch(model_or_pipeline: Any, policy: Any = "fast", *, layers: Mapping | None = None, guard: Any = None,
          backend: str = "auto", strict: bool = False, cross_attention: bool = False, decoder: bool = False,
          range_check: str = "raise", guard_rule: Any = None) -> PatchHandle:
    """Route the attention layers of a model or pipeline through fp4vis, per layer.

    Args:
        model_or_pipeline: a diffusers Wan transformer or pipeline, a timm model, or a transformers
            ViT / ViTMAE model (any ``nn.Module`` holding supported attention layers).
        policy: base policy of the default layers (a name, a Policy, or None/"exact").
        layers: ``{index or name pattern: policy}`` overrides, applied in order (module docstring).
        guard: a :class:`~fp4vis.guard.GuardPlan`, a path to its JSON, or ``"auto"`` (each layer
            calibrates on its first call with ``guard_rule`` and switches to the guard policy when
            the rule says so; ``handle.guard_plan`` collects the result).
        backend: ``"auto"`` | ``"reference"`` | ``"hopper"`` (passed to
            ``fp4vis.attention``).
        strict: raise :class:`FallbackError` where a layer would fall back to exact attention,
            and on unsupported attention modules next to supported ones.
        cross_attention: Wan: patch ``attn2`` with the base policy too (default: exact).
        decoder: ViTMAE: patch the decoder with the base policy too (default: encoder only).
        range_check: passed to ``fp4vis.attention`` ("raise", "warn", "off").
        guard_rule: the :class:`~fp4vis.guard.GuardRule` for ``guard="auto"``.
    """
    _check_backend(backend, strict)
    _check_range_check(range_check)
    specs, unsupported = find_layers(model_or_pipeline, cross_attention=cross_attention, decoder=decoder)
    if not specs:
        found = (f"; found unsupported attention modules: "
                 f"{', '.join(f'{n} ({c})' for n, c in unsupported[:8])}") if unsupported else ""
        raise NotImplementedError(
            f"fp4vis.patch: no supported attention layer in {type(model_or_pipeline).__name__}{found}. "
            f"Supported are: {_SUPPORTED_TEXT}.")
    if unsupported:
        msg = (f"fp4vis.patch: these attention modules are unsupported and keep their own attention: "
               f"{', '.join(f'{n} ({c})' for n, c in unsupported[:8])}"
               f"{' ...' if len(unsupported) > 8 else ''}. Supported are: {_SUPPORTED_TEXT}.")
        if strict:
            raise NotImplementedError(msg)
        warnings.warn(msg, FallbackWarning, stacklevel=2)

    plan = None
    auto = None
    if isinstance(guard, str) and guard == "auto":
        from fp4vis.guard import AutoGuard
        auto = AutoGuard(rule=guard_rule, model_id=_model_id(model_or_pipeline),
                         base_policy=resolve_policy(policy) or "fast")
    elif guard is not None:
        from fp4vis.guard import GuardPlan
        plan = guard if isinstance(guard, GuardPlan) else GuardPlan.load(guard)

    policies = resolve_layer_policies(specs, policy, layers, plan)
    return _install(model_or_pipeline, specs, policies, backend=backend, strict=strict,
                    range_check=range_check, plan=plan, auto=auto)


def _install(target: Any, specs: list[LayerSpec], policies: Mapping[str, Policy | None], *, backend: str,
             strict: bool, range_check: str, plan: Any = None, auto: Any = None,
             recorder: Callable | None = None, record_names: Iterable[str] = ()) -> PatchHandle:
    record_names = set(record_names)
    chosen = [s for s in specs if policies.get(s.name) is not None or s.name in record_names]
    already = [s.name for s in chosen if getattr(s.module, _STATE_ATTR, None) is not None]
    if already:
        raise RuntimeError(f"fp4vis.patch: layers already patched: {', '.join(already[:6])}"
                           f"{' ...' if len(already) > 6 else ''}; call handle.remove() or "
                           "fp4vis.unpatch(model) first")
    handle = PatchHandle(target=target, backend=backend, strict=strict, range_check=range_check,
                         specs=specs, guard_plan=plan)
    mods = {m.__name__.rsplit(".", 1)[-1]: m for m in _patcher_modules()}
    try:
        for s in chosen:
            pol = policies.get(s.name)
            recording = s.name in record_names
            st = LayerState(s, pol, backend=backend, range_check=range_check, strict=strict, handle=handle)
            if recording:
                st.recorder = recorder
            if auto is not None and pol is not None and pol.is_direct_p:
                st.auto = auto
            patcher = mods[s.patcher]
            setattr(s.module, _STATE_ATTR, st)
            inst = _Installed(s, st, patcher)
            handle._installed.append(inst)
            inst.token = patcher.install(s, st)
    except BaseException:
        handle.remove()
        raise
    if auto is not None:
        handle.guard_plan = auto.plan
    return handle


def _model_id(obj: Any) -> str:
    cfg = getattr(obj, "config", None)
    v = cfg.get("_name_or_path") if isinstance(cfg, Mapping) else getattr(cfg, "_name_or_path", None)
    if isinstance(v, str) and v:
        return v
    cfg = getattr(obj, "pretrained_cfg", None)
    if isinstance(cfg, Mapping):
        for key in ("hf_hub_id", "architecture", "file"):
            if cfg.get(key):
                return str(cfg[key])
    return type(obj).__name__


def patched_states(obj: Any) -> list[LayerState]:
    """The LayerStates currently installed anywhere in a model or pipeline."""
    out = []
    for _, root in _roots(obj):
        for m in root.modules():
            st = getattr(m, _STATE_ATTR, None)
            if isinstance(st, LayerState):
                out.append(st)
    return out


def unpatch(model_or_pipeline: Any) -> int:
    """Remove every fp4vis patch from a model or pipeline (whichever handle installed it).
    Returns the number of handles removed."""
    handles = []
    for st in patched_states(model_or_pipeline):
        h = st.handle
        if h is not None and all(h is not x for x in handles):
            handles.append(h)
    for h in handles:
        h.remove()
    return len(handles)
