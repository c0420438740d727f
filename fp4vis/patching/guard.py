"""Guard calibration (docs/numerics.md sections 2 and 4): which layers need the anchored guard policy.

**The statistic.** For every attention layer, on real forwards, fp4vis records the logits in the
log2 domain, ``z·log2(e)`` with ``z = q·k·scale`` (computed in FP32 from the layer's q and k, before
FP4 quantization):

* ``sampled_max_log2``: the largest logit against the *sampled* keys, the docs/numerics.md section 4 anchor
  positions ``round(linspace(0, S-1, n))`` (n = 128, the guard's anchor count; n = the policy's
  own anchor count for anchored base policies), maximised over rows, heads, batch and inputs;
* ``full_max_log2``: the same over all keys (optional, ``full=True``);
* ``anchor_gap_log2``: the largest per-row gap ``max_all_keys − max_sampled_keys`` (recorded with
  ``full=True``; the statistic for anchored base policies).

The range limit, the decision rule (``GuardRule``) and the plan file (``GuardPlan``, its JSON and its checks)
are :mod:`fp4vis.patching.guard_plan`'s; this module records the statistic on real forwards
(``calibrate``, a plan for ``fp4vis.patch(model, guard=plan_or_path)``) or on each layer's first call
(``AutoGuard``, ``patch(..., guard="auto")``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fp4vis.key_positions import anchor_indices
from fp4vis.policy import LOG2E, Policy, get_policy, guard_policy_for_heads

from .discovery import find_layers, select_layers
from .discovery import model_id as discovered_model_id
from .guard_plan import GUARD_ANCHORS, GuardPlan, GuardRule, LayerStats
from .handle import install
from .layer import resolve_policy

_FULL_CHUNK = 1 << 22

__all__ = ["AutoGuard", "calibrate", "logit_stats"]


# ------------------------------------------------------------------------------------------------
# the statistic


def _bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


@torch.no_grad()
def logit_stats(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *, layout: str = "bhsd",
                n_samples: int = GUARD_ANCHORS, full: bool = False) -> dict[str, float]:
    """Logit statistics of one attention call in log2 units (module docstring).

    Returns ``sampled_max_log2`` and, with ``full=True``, ``full_max_log2`` and ``anchor_gap_log2``.
    """

    qb, kb = _bhsd(q, layout).float(), _bhsd(k, layout).float()
    if scale is None:
        scale = qb.shape[-1] ** -0.5
    s = float(scale) * LOG2E
    skv = kb.shape[-2]
    idx = anchor_indices(skv, n_samples, device=kb.device)
    ks = kb.index_select(-2, idx)
    sampled_rows = (qb @ ks.mT).amax(-1) * s                      # (B, H, Sq)
    out = {"sampled_max_log2": float(sampled_rows.max())}
    if full:
        b, h, sq, _ = qb.shape
        step = max(1, _FULL_CHUNK // max(1, b * h * skv))
        full_rows = torch.cat([(qb[:, :, i:i + step] @ kb.mT).amax(-1) for i in range(0, sq, step)], dim=-1) * s
        out["full_max_log2"] = float(full_rows.max())
        out["anchor_gap_log2"] = float((full_rows - sampled_rows).max())
    return out


# ------------------------------------------------------------------------------------------------
# calibration


class _Recorder:
    def __init__(self, policy: Policy, n_samples: int, full: bool):
        self.policy, self.n_samples, self.full = policy, n_samples, full
        self.stats: dict[str, LayerStats] = {}

    def __call__(self, state, q, k, scale, layout) -> None:
        qb = _bhsd(q, layout)
        sc = float(scale) if scale is not None else qb.shape[-1] ** -0.5
        stats = logit_stats(q, k, sc, layout=layout, n_samples=self.n_samples, full=self.full)
        bad = [key for key, value in stats.items() if not math.isfinite(value)]
        if bad:   # max() would drop a NaN and call the layer safe
            raise ValueError(f"fp4vis.calibrate: layer {state.name!r}: the calibration input gives non-finite "
                             f"logits ({', '.join(f'{key} = {stats[key]}' for key in bad)}); check the model and "
                             "its inputs for NaN/Inf")
        st = self.stats.get(state.name)
        if st is None:
            st = self.stats[state.name] = LayerStats(state.name, index=state.index, group=state.group,
                                                     num_heads=qb.shape[1], head_dim=qb.shape[-1], scale=sc)
        st.update(stats)


def _n_samples(policy: Policy) -> int:
    return policy.anchor if policy.anchor > 0 else GUARD_ANCHORS


def _as_inputs(inputs: Any) -> Iterable[Any]:
    if isinstance(inputs, (torch.Tensor, Mapping)):
        return [inputs]
    return inputs  # iterated once, lazily (a DataLoader is fine)


def _run(target: Any, item: Any) -> Any:
    if isinstance(item, Mapping):
        return target(**item)
    if isinstance(item, (tuple, list)):
        return target(*item)
    return target(item)


def calibrate(model: Any, inputs: Any, policy: str | Policy = "fast", *, rule: GuardRule | None = None,
              full: bool | None = None, guard_policy: Policy | str | None = None,
              layers: Mapping | Iterable | None = None, cross_attention: bool = False, decoder: bool = False,
              model_id: str | None = None) -> GuardPlan:
    """Record per-layer logit statistics on real forwards and decide which layers to guard.

    The model runs its own exact attention during calibration (nothing is quantized); every
    attention layer that ``fp4vis.patch`` would reach with the same ``layers`` / ``cross_attention``
    / ``decoder`` options is recorded. ``plan.save(path)`` writes the plan for ``patch(..., guard=path)``.

    Args:
        model: a model or pipeline (as for ``fp4vis.patch``).
        inputs: an iterable of calibration inputs; each item is called as ``model(**item)`` (a dict),
            ``model(*item)`` (a tuple/list) or ``model(item)``. A single dict or tensor is one input.
        policy: the base policy the plan protects (the limit depends on it).
        rule: the decision rule, a :class:`GuardRule` (its ``statistic``, ``fraction``, ``threshold``;
            default ``GuardRule()``), as ``patch``'s ``guard_rule``.
        full: also record the maxima over all keys (default: when the rule needs them).
        guard_policy: the policy of guarded layers (default ``guard_policy_for_heads(heads)``).
        layers: which layers to record besides the default ones: a ``layers`` mapping as for
            ``patch`` (its keys select), or an iterable of indices / name patterns.
        model_id: stored in the plan (default: the model's name_or_path or class name).
    """

    base = get_policy(policy)
    if base.method != "direct_p":
        raise ValueError(f"policy: calibration protects a Direct-P policy, got {base.name!r} ({base.method})")
    if rule is None:
        rule = GuardRule()
    elif not isinstance(rule, GuardRule):
        raise TypeError(f"rule: expected a GuardRule (e.g. GuardRule(threshold=90.0)), got {type(rule).__name__}")
    full = rule.needs_full(base) if full is None else bool(full)
    if rule.needs_full(base) and not full:
        raise ValueError("full=False, but the rule needs the maxima over all keys "
                         f"({rule.describe(base)})")
    specs, _ = find_layers(model, cross_attention=cross_attention, decoder=decoder)
    if not specs:
        raise NotImplementedError(f"fp4vis.calibrate: no supported attention layer in {type(model).__name__}")
    chosen = {s.name for s in specs if s.default}
    if layers is not None:
        keys = layers.keys() if isinstance(layers, Mapping) else layers
        for key in keys:
            sel = select_layers(specs, key)
            if not sel:
                raise ValueError(f"layers: key {key!r} matches no attention layer")
            if isinstance(layers, Mapping) and resolve_policy(layers[key]) is None:
                chosen.difference_update(s.name for s in sel)
            else:
                chosen.update(s.name for s in sel)
    recorder = _Recorder(base, _n_samples(base), full)
    handle = install(model, specs, {}, backend="reference", strict=False, range_check="raise",
                      recorder=recorder, record_names=chosen)
    num_inputs = 0
    try:
        with torch.no_grad():
            for item in _as_inputs(inputs):
                _run(model, item)
                num_inputs += 1
    finally:
        handle.remove()
    if num_inputs == 0:
        raise ValueError("inputs: no calibration inputs were given")
    never = sorted(chosen - set(recorder.stats))
    if never:
        raise RuntimeError(f"fp4vis.calibrate: these layers were never called by the inputs: {', '.join(never[:6])}")
    heads = max((st.num_heads for st in recorder.stats.values()), default=0)
    gp = get_policy(guard_policy) if guard_policy is not None else guard_policy_for_heads(heads)
    ordered = {s.name: recorder.stats[s.name] for s in specs if s.name in recorder.stats}
    plan = GuardPlan(model_id=model_id or discovered_model_id(model), policy=base, guard_policy=gp, rule=rule,
                     stats=ordered, n_samples=_n_samples(base), num_inputs=num_inputs,
                     architecture={s.name: [s.num_heads, s.head_dim] for s in specs})
    plan.decide()
    return plan


class AutoGuard:
    """``patch(..., guard="auto")``: each Direct-P layer records the statistic on its first call,
    the rule decides, and a guarded layer switches to the guard policy for that call and every
    later one. ``plan`` (also ``handle.guard_plan``) collects the statistics and decisions."""

    def __init__(self, rule: GuardRule | None = None, model_id: str = "", base_policy: Any = "fast",
                 guard_policy: Policy | None = None):
        self.rule = rule or GuardRule()
        self.guard_policy = guard_policy
        base = get_policy(base_policy) if base_policy is not None else get_policy("fast")
        self.plan = GuardPlan(model_id=model_id, policy=base, guard_policy=guard_policy or get_policy("guard"),
                              rule=self.rule, n_samples=_n_samples(base))

    def decide(self, state, q, k, scale, layout) -> None:
        base = state.policy
        state.auto = None  # decide once, on the first call
        if base is None or not base.is_direct_p:
            return
        qb = _bhsd(q, layout)
        sc = float(scale) if scale is not None else qb.shape[-1] ** -0.5
        if self.guard_policy is None:
            self.guard_policy = guard_policy_for_heads(qb.shape[1])
            self.plan.guard_policy = self.guard_policy
        st = LayerStats(state.name, index=state.index, group=state.group, num_heads=qb.shape[1],
                        head_dim=qb.shape[-1], scale=sc)
        st.update(logit_stats(q, k, sc, layout=layout, n_samples=_n_samples(base), full=self.rule.needs_full(base)))
        self.plan.stats[state.name] = st
        self.plan.num_inputs = 1
        if self.rule.evaluate(st, base):
            self.plan.guarded.append(state.name)
            state.policy = self.guard_policy
