"""The handle of a patch (``PatchHandle``: which layers, their states, ``remove()``), the one place
that installs layer states through the patchers (``install``), and ``unpatch``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4vis.backends import range_record
from fp4vis.policy import Policy

from .layer import STATE_ATTR, UNSET, LayerSpec, LayerState, resolve_policy
from .patchers import loaded_patchers
from .roots import roots


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
    _hooks: list = field(default_factory=list)
    #: under context parallelism: local sequence length -> the token streams of the joint attention of that
    #: length (fp4vis.patching.diffusers_attention), for the single-stream blocks that attend over it
    joint_streams: dict = field(default_factory=dict)
    _steps_armed: bool = False

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

    def set_override(self, policy: Any = UNSET) -> None:
        """Run every patched layer with ``policy`` (None/"exact": the model's exact attention) until
        ``clear_override()``; used by the per-step schedule. Layers left exact stay exact."""
        pol = UNSET if policy is UNSET else resolve_policy(policy)
        for st in self.states:
            st.override = pol

    def clear_override(self) -> None:
        self.set_override(UNSET)

    def set_layer_override(self, names: Iterable[str], policy: Any = UNSET) -> None:
        """Run the patched layers named (``LayerSpec.name``) with ``policy`` (None: exact), the others as set."""
        pol, names = (UNSET if policy is UNSET else resolve_policy(policy)), set(names)
        for inst in self._installed:
            if inst.spec.name in names:
                inst.state.override = pol

    def step_callback(self, num_inference_steps: int | None = None, extra_steps: Iterable[int] = ()) -> Any:
        """The ``callback_on_step_end`` that runs the guard plan's exact steps (and ``extra_steps``) with every
        layer exact, and its layers exact in some steps only (``exact_layer_steps``) exact there
        (``fp4vis.patching.wan.StepPolicyCallback``); None when there are none. Negative step indices count from
        the end: give ``num_inference_steps`` when one is the first step."""
        plan = self.guard_plan
        steps = [*(plan.exact_steps if plan is not None else ()), *extra_steps]
        per_layer: dict[str, list[int]] = {}
        for name, layer_steps in (plan.exact_layer_steps.items() if plan is not None else ()):
            for spec in plan.match(self.specs, [name]):
                per_layer.setdefault(spec.name, []).extend(int(s) for s in layer_steps)
        self._steps_armed = True
        if not steps and not per_layer:
            return None
        from .wan import StepPolicyCallback

        return StepPolicyCallback(self, {int(s): None for s in steps}, num_inference_steps=num_inference_steps,
                                  layer_steps=per_layer)

    def remove(self) -> None:
        if self.removed:
            return
        if self.guard_plan is not None and self.guard_plan.step_indices() and not self._steps_armed:
            import warnings

            warnings.warn(f"fp4vis: the guard plan keeps denoising steps {self.guard_plan.exact_steps} exact"
                          f"{' (and layers in some steps)' if self.guard_plan.exact_layer_steps else ''}, and "
                          "this patch ran without its step callback: every step ran the plan's layers (pass "
                          "callback_on_step_end=handle.step_callback() to the pipeline call)", RuntimeWarning,
                          stacklevel=2)
        errors = []
        for inst in reversed(self._installed):
            try:
                inst.patcher.uninstall(inst.spec, inst.state, inst.token)
            except Exception as exc:  # noqa: BLE001 - restore the rest, then report
                errors.append(f"{inst.spec.name}: {exc}")
            if getattr(inst.spec.module, STATE_ATTR, None) is inst.state:
                delattr(inst.spec.module, STATE_ATTR)
        self._installed.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
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


def install(target: Any, specs: list[LayerSpec], policies: Mapping[str, Policy | None], *, backend: str,
             strict: bool, range_check: str, plan: Any = None, auto: Any = None,
             recorder: Callable | None = None, record_names: Iterable[str] = ()) -> PatchHandle:
    record_names = set(record_names)
    chosen = [s for s in specs if policies.get(s.name) is not None or s.name in record_names]
    already = [s.name for s in chosen if getattr(s.module, STATE_ATTR, None) is not None]
    if already:
        raise RuntimeError(f"fp4vis.patch: layers already patched: {', '.join(already[:6])}"
                           f"{' ...' if len(already) > 6 else ''}; call handle.remove() or "
                           "fp4vis.unpatch(model) first")
    handle = PatchHandle(target=target, backend=backend, strict=strict, range_check=range_check,
                         specs=specs, guard_plan=plan)
    mods = loaded_patchers()
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
            setattr(s.module, STATE_ATTR, st)
            inst = _Installed(s, st, patcher)
            handle._installed.append(inst)
            inst.token = patcher.install(s, st)
        for name, root in roots(target):
            handle._hooks.append(root.register_forward_hook(RangeCheckHook(name or type(root).__name__)))
    except BaseException:
        handle.remove()
        raise
    if auto is not None:
        handle.guard_plan = auto.plan
    return handle


class RangeCheckHook:
    """The forward hook of a patched model (or pipeline component): the GPU kernels' range record
    (``fp4vis.backends.range_record``) is checked when its forward returns, so that an output whose
    range was exceeded never leaves the model without an error naming the layer. One wait for the
    device per forward, only where kernel calls were recorded."""

    def __init__(self, name: str):
        self.name = name
        self.where = f"the end of {name}'s forward"

    def __call__(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            # traced with the forward: the check becomes an op of the graph, after every output tensor
            range_record.check_after(range_record.CHECK_TOKEN, _tensors(output), self.where)
            return
        range_record.check(self.where)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"fp4vis: {self.name} is patched; copy.deepcopy, pickle and torch.save of a patched model "
                        "are not supported: remove the patch first (handle.remove() or fp4vis.unpatch(model)), "
                        "then copy or save, and patch again")


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output (a tensor, a tuple or list, a dict or a ModelOutput), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def patched_states(obj: Any) -> list[LayerState]:
    """The LayerStates currently installed anywhere in a model or pipeline."""
    out = []
    for _, root in roots(obj):
        for m in root.modules():
            st = getattr(m, STATE_ATTR, None)
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
