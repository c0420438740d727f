"""Guard plans (docs/numerics.md sections 2 and 4): the range limit, the decision rule and the plan file.

The statistics a plan records and decides on are recorded by :mod:`fp4vis.patching.guard` (``logit_stats``,
``calibrate``, ``AutoGuard``; its docstring defines them).

**The range limit.** With the row reference ``m = 0`` (``fast``, ``wan_fast``) a P block's exponent
``e = floor(g + 1 − log2 1.5)`` is representable up to 127, i.e. a block whose largest logit
``g = z·log2(e)`` reaches about 127 saturates (fp4vis.attention then raises RangeExceededError).
So ``limit = 127``. For an anchored base policy the row reference is the anchor maximum plus the
margin, ``M·scale`` binary exponents in the code's units (``M`` in the paper's), so the limit is
``127 + margin_log2`` and what approaches it is the anchor gap.

**The decision rule** (:class:`GuardRule`, recorded in every plan): guard a layer when its value
(``sampled_max_log2`` by default, ``full_max_log2`` with ``statistic="full"``, ``anchor_gap_log2``
for anchored base policies) reaches ``threshold``, by default ``fraction · limit`` with
``fraction = 0.75`` (95.25 for ``fast``: logits ``z ≥ 66``). Rationale: the sampled maximum is a
lower bound of the true maximum, so the rule keeps a quarter of the range as headroom; the
published reference points are far on either side (Wan2.1-14B's guarded layers reached z ≈ 560–1080
— about 800–1560 in log2 units — while ordinary layers stay below about 60, and ViT / MAE layers
need no guard). Change it with ``threshold=`` (absolute, log2 units), ``fraction=`` or
``statistic=``; ``GuardPlan.redecide(...)`` re-applies another rule to recorded statistics.

**The plan** (:class:`GuardPlan`) is versioned JSON: format, version, model id, base policy, guard
policy (its fields), the rule, per-layer statistics (value, limit, headroom, fraction of the limit)
and the guarded layers. ``fp4vis.patch(model, guard=plan_or_path)`` applies it.

A plan found for a fidelity target (``fp4vis.plan``, ``fp4vis calibrate pipeline --target``; version 2, the
fields a version-1 plan lacks) also keeps layers exact (``exact_layers``: the model's own attention in every
step), denoising steps exact (``exact_steps``: step indices, negative from the end; every layer exact in
them) and layers exact in some steps only (``exact_layer_steps``: layer name -> step indices), the steps through
the handle's ``step_callback()``; and it records what it was chosen for (``fidelity``: the target
against BF16, the measured fidelity and FP4 share of attention time, the prompts' count, the time model).
``GuardPlan.save`` writes it atomically; ``GuardPlan.load`` / ``from_dict`` check it against its saved form
field by field (``GuardPlanError`` naming the field and the reason).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp4vis.files import atomic_write
from fp4vis.policy import Policy

FORMAT = "fp4vis.guard_plan"
VERSION = 2   # 2: exact layers and steps, and the fidelity a searched plan was chosen for
#: largest representable P block exponent relative to the row reference (docs/numerics.md section 2)
EXP_LIMIT = 127.0
GUARD_ANCHORS = 128

__all__ = ["GuardPlan", "GuardPlanError", "GuardRule", "LayerStats", "policy_limit"]


class GuardPlanError(ValueError):
    """A guard plan file that cannot be read, or a plan that does not fit the model it is applied to."""


# ------------------------------------------------------------------------------------------------
# the limit and the recorded statistics


def policy_limit(policy: Policy, scale: float) -> float:
    """Largest tolerable value of the rule's statistic before P blocks saturate."""
    return EXP_LIMIT + policy.margin_log2(scale)


@dataclass
class LayerStats:
    """Recorded statistics of one attention layer (log2 units; None: not recorded)."""

    name: str
    index: int = -1
    group: str = ""
    num_heads: int = 0
    head_dim: int = 0
    scale: float = 0.0
    calls: int = 0
    sampled_max_log2: float = -math.inf
    full_max_log2: float | None = None
    anchor_gap_log2: float | None = None
    # filled by the rule
    value: float | None = None
    limit: float | None = None
    headroom: float | None = None
    fraction_of_limit: float | None = None
    guarded: bool = False

    def update(self, stats: Mapping[str, float]) -> None:
        self.calls += 1
        self.sampled_max_log2 = max(self.sampled_max_log2, stats["sampled_max_log2"])
        for key in ("full_max_log2", "anchor_gap_log2"):
            if key in stats:
                old = getattr(self, key)
                setattr(self, key, stats[key] if old is None else max(old, stats[key]))

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerStats:
        """From ``to_dict``'s form, checked field by field (``GuardPlanError`` naming the field)."""
        where = f"layers[{d.get('name', '?')!r}]" if isinstance(d, Mapping) else "layers[?]"
        return cls(**_checked_layer_stats(d, where))


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else "-inf" if v < 0 else "nan"
    return v


# ------------------------------------------------------------------------------------------------
# the rule


@dataclass(frozen=True)
class GuardRule:
    """Guard a layer when ``value >= threshold`` (module docstring).

    Attributes:
        statistic: ``"sampled"`` (the largest sampled logit, the published statistic) or ``"full"``
            (the largest logit over all keys; calibration then computes every logit). Anchored base
            policies always use the anchor gap (which needs the full logits).
        fraction: threshold as a fraction of the policy's limit (used when ``threshold`` is None).
        threshold: absolute threshold in log2 units (``z·log2(e)``), overriding ``fraction``.
    """

    statistic: str = "sampled"
    fraction: float = 0.75
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.statistic not in ("sampled", "full"):
            raise ValueError(f"statistic: expected 'sampled' or 'full', got {self.statistic!r}")
        if not (0 < self.fraction <= 1.5):
            raise ValueError(f"fraction: expected a number in (0, 1.5], got {self.fraction!r}")
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ValueError(f"threshold: expected a finite number, got {self.threshold!r}")

    def needs_full(self, policy: Policy) -> bool:
        return self.statistic == "full" or policy.anchor > 0

    def evaluate(self, st: LayerStats, policy: Policy) -> bool:
        """Fill value/limit/headroom/fraction_of_limit/guarded of ``st``; return guarded."""
        limit = policy_limit(policy, st.scale)
        if policy.anchor > 0:
            value = st.anchor_gap_log2
        elif self.statistic == "full":
            value = st.full_max_log2
        else:
            value = st.sampled_max_log2
        if value is None:
            raise ValueError(f"layer {st.name!r}: the rule needs {self.describe(policy)!r} statistics that "
                             "were not recorded (calibrate with full=True)")
        threshold = self.threshold if self.threshold is not None else self.fraction * limit
        st.value, st.limit = value, limit
        st.headroom = limit - value
        st.fraction_of_limit = value / limit
        st.guarded = bool(value >= threshold)
        return st.guarded

    def threshold_for(self, policy: Policy, scale: float) -> float:
        return self.threshold if self.threshold is not None else self.fraction * policy_limit(policy, scale)

    def describe(self, policy: Policy) -> str:
        stat = ("anchor_gap_log2" if policy.anchor > 0 else
                "full_max_log2" if self.statistic == "full" else "sampled_max_log2")
        thr = (f"{self.threshold:g}" if self.threshold is not None
               else f"{self.fraction:g} * limit")
        lim = "127" if policy.anchor == 0 else "127 + margin_log2 (M*scale in code units, M in paper units)"
        return f"guard when {stat} >= {thr}, limit = {lim}"

    def to_dict(self, policy: Policy) -> dict[str, Any]:
        return {"statistic": self.statistic, "fraction": self.fraction, "threshold": self.threshold,
                "limit_log2": EXP_LIMIT if policy.anchor == 0 else None,
                "description": self.describe(policy)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardRule:
        """From ``to_dict``'s form, checked field by field (``GuardPlanError`` naming the field)."""
        d = _check_fields("rule", d, required=("statistic", "fraction", "threshold"),
                          optional=("limit_log2", "description"))
        statistic = _check_str("rule.statistic", d["statistic"])
        if statistic not in ("sampled", "full"):
            raise GuardPlanError(f"rule.statistic: expected 'sampled' or 'full', got {statistic!r}")
        fraction = _check_number("rule.fraction", d["fraction"])
        if not 0 < fraction <= 1.5:
            raise GuardPlanError(f"rule.fraction: expected a number in (0, 1.5], got {fraction!r}")
        _check_number("rule.limit_log2", d.get("limit_log2"), optional=True)
        _check_str("rule.description", d.get("description", ""))
        return cls(statistic=statistic, fraction=fraction,
                   threshold=_check_number("rule.threshold", d["threshold"], optional=True))


def make_rule(rule: GuardRule | None, threshold: float | None, fraction: float | None,
               statistic: str | None) -> GuardRule:
    rule = rule or GuardRule()
    changes = {k: v for k, v in (("threshold", threshold), ("fraction", fraction), ("statistic", statistic))
               if v is not None}
    return dataclasses.replace(rule, **changes) if changes else rule


# ------------------------------------------------------------------------------------------------
# the plan


def check_plan_path(path: Any, what: str) -> None:
    """A plan's file is named by a path (str or os.PathLike): ``open`` takes an int, and a bool, as a file
    descriptor (``open(False)`` reads stdin and closes it), so anything else is a TypeError."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: expected a path (str or os.PathLike), got {type(path).__name__}")


# The saved form (GuardPlan.to_dict): every field it writes, checked on reading. Fields a plan written by an
# earlier fp4vis may lack are optional (architecture: plans before fingerprints); any other field is unknown.
_PLAN_REQUIRED = ("format", "version", "model_id", "policy", "guard_policy", "rule", "layers", "guarded")
_PLAN_OPTIONAL = ("created", "n_samples", "num_inputs", "statistic_units", "architecture")
_PLAN_SEARCHED = ("exact_layers", "exact_steps", "exact_layer_steps", "fidelity")   # version 2
# a searched plan's ``fidelity`` record: its fields, and those of its target
_FIDELITY_FIELDS = ("target", "measured", "num_prompts", "fp4_share", "time_model")
_FIDELITY_OPTIONAL = ("predicted_attention_time", "steps", "candidates", "runs", "method")
TARGET_METRICS = ("latent_cosine", "psnr_db", "ssim")
TARGET_STATISTICS = ("mean", "worst", "lower")   # lower: the lower end of the mean's 95 % interval


def _json_type(v: Any) -> str:
    """How a JSON value is named in an error."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f"the string {v!r}"
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, (list, tuple)):
        text = json.dumps(v, default=str)
        return f"the list {text}" if len(text) <= 60 else "a list"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return f"{v} (a number out of range, as JSON reads 1e999)"
    return repr(v)


def _check_fields(where: str, d: Any, *, required: Iterable[str], optional: Iterable[str]) -> Mapping[str, Any]:
    """An object with every ``required`` field and no field outside ``required`` and ``optional``
    (``where``: the object's place in the plan, "" for the plan itself)."""
    at = f"{where}: " if where else ""
    if not isinstance(d, Mapping):
        raise GuardPlanError(f"{at}expected an object, got {_json_type(d)}")
    required, known = tuple(required), (*required, *optional)
    missing = [k for k in required if k not in d]
    if missing:
        raise GuardPlanError(f"{at}missing field {', '.join(map(repr, missing))}")
    unknown = [k for k in d if k not in known]
    if unknown:
        raise GuardPlanError(f"{at}unknown field {', '.join(map(repr, unknown))} (the fields are "
                             f"{', '.join(known)})")
    return d


def _check_object(where: str, v: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise GuardPlanError(f"{where}: expected an object {what}, got {_json_type(v)}")
    return v


def _check_str(where: str, v: Any) -> str:
    if not isinstance(v, str):
        raise GuardPlanError(f"{where}: expected a string, got {_json_type(v)}")
    return v


def _check_int(where: str, v: Any, *, minimum: int) -> int:
    if type(v) is not int or v < minimum:
        raise GuardPlanError(f"{where}: expected an integer >= {minimum}, got {_json_type(v)}")
    return v


def _check_number(where: str, v: Any, *, optional: bool = False) -> float | None:
    """A finite number (JSON reads 1e999 as inf: refused), or null where ``optional``."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise GuardPlanError(f"{where}: expected a finite number{' or null' if optional else ''}, "
                             f"got {_json_type(v)}")
    return v


def _check_names(where: str, v: Any) -> list[str]:
    if not isinstance(v, list):
        raise GuardPlanError(f"{where}: expected a list of layer names, got {_json_type(v)}"
                             + (" (one name is a list of one)" if isinstance(v, str) else ""))
    for i, name in enumerate(v):
        _check_str(f"{where}[{i}]", name)
    return list(v)


def _checked_layer_stats(d: Any, where: str) -> dict[str, Any]:
    """LayerStats' keyword arguments from its saved form (``LayerStats.to_dict``)."""
    names = [f.name for f in dataclasses.fields(LayerStats)]
    d = _check_fields(where, d, required=("sampled_max_log2",), optional=[n for n in names if n != "sampled_max_log2"])
    out: dict[str, Any] = {}
    for key, v in d.items():
        at = f"{where}.{key}"
        if key in ("name", "group"):
            out[key] = _check_str(at, v)
        elif key in ("index", "num_heads", "head_dim", "calls"):
            out[key] = _check_int(at, v, minimum=-1 if key == "index" else 0)
        elif key == "guarded":
            if not isinstance(v, bool):
                raise GuardPlanError(f"{at}: expected true or false, got {_json_type(v)}")
            out[key] = v
        elif key == "sampled_max_log2" and v == "-inf":   # the writer's form of "never recorded"
            out[key] = -math.inf
        elif key == "scale":
            out[key] = _check_number(at, v)
        else:
            out[key] = _check_number(at, v, optional=key != "sampled_max_log2")
    return out


def _check_architecture(v: Any) -> dict[str, list[int]]:
    arch = _check_object("architecture", v, "{layer name: [heads, head dim]}")
    for name, shape in arch.items():
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(type(x) is int and x > 0 for x in shape)):
            raise GuardPlanError(f"architecture[{name!r}]: expected [heads, head dim], two positive integers, "
                                 f"got {_json_type(shape)}")
    return {str(k): list(v) for k, v in arch.items()}


def _check_steps(where: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise GuardPlanError(f"{where}: expected a list of step indices (integers, negative from the end), got "
                             f"{_json_type(v)}")
    return list(v)


def check_target(where: str, v: Any) -> dict[str, Any]:
    """A fidelity target's saved form: ``{"metric", "statistic", "value"}`` (``GuardPlanError`` naming the field)."""
    d = _check_fields(where, v, required=("metric", "statistic", "value"), optional=())
    for key, known in (("metric", TARGET_METRICS), ("statistic", TARGET_STATISTICS)):
        if d[key] not in known:
            raise GuardPlanError(f"{where}.{key}: expected one of {', '.join(known)}, got {_json_type(d[key])}")
    return {"metric": d["metric"], "statistic": d["statistic"], "value": _check_number(f"{where}.value", d["value"])}


def _check_fidelity(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    d = _check_fields("fidelity", v, required=_FIDELITY_FIELDS, optional=_FIDELITY_OPTIONAL)
    check_target("fidelity.target", d["target"])
    for name, x in _check_object("fidelity.measured", d["measured"], "{metric: value}").items():
        _check_number(f"fidelity.measured[{name!r}]", x)
    _check_int("fidelity.num_prompts", d["num_prompts"], minimum=1)
    share = _check_number("fidelity.fp4_share", d["fp4_share"])
    if not 0 <= share <= 1:
        raise GuardPlanError(f"fidelity.fp4_share: expected a fraction in [0, 1], got {share!r}")
    _check_str("fidelity.time_model", d["time_model"])
    return dict(d)


def _policy_to_dict(p: Policy) -> dict[str, Any]:
    return dataclasses.asdict(p)


def _policy_from_dict(d: Any, where: str = "policy") -> Policy:
    """A policy from its saved form, the object of its fields (``_policy_to_dict``); fields a plan written
    before they existed lacks take their defaults."""
    if isinstance(d, str):
        raise GuardPlanError(f"{where}: expected the policy's fields as an object (as fp4vis writes it, e.g. "
                             f'{{"name": "fast", "method": "direct_p", ...}}), got the string {d!r}')
    names = [f.name for f in dataclasses.fields(Policy)]
    d = _check_fields(where, d, required=("name",), optional=names[1:])
    try:
        return Policy(**d)
    except (TypeError, ValueError) as exc:   # Policy names the field and the reason
        raise GuardPlanError(f"{where}: {exc}") from None


@dataclass
class GuardPlan:
    """A static per-layer guard plan (versioned JSON; module docstring)."""

    model_id: str
    policy: Policy
    guard_policy: Policy
    rule: GuardRule = field(default_factory=GuardRule)
    stats: dict[str, LayerStats] = field(default_factory=dict)
    guarded: list[str] = field(default_factory=list)
    n_samples: int = GUARD_ANCHORS
    num_inputs: int = 0
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"))
    version: int = 1   # written as VERSION when the plan is a searched one (to_dict)
    # the fingerprint of the model it was calibrated on: every reachable attention layer -> [heads, head dim]
    architecture: dict[str, list[int]] = field(default_factory=dict)
    # a plan found for a fidelity target (module docstring): layers and steps kept exact, what it was chosen for
    exact_layers: list[str] = field(default_factory=list)
    exact_steps: list[int] = field(default_factory=list)
    exact_layer_steps: dict[str, list[int]] = field(default_factory=dict)   # a layer exact in these steps only
    fidelity: dict[str, Any] | None = None

    @property
    def searched(self) -> bool:
        """Whether the plan keeps layers or steps exact or records a fidelity target (a version-2 plan)."""
        return bool(self.exact_layers or self.exact_steps or self.exact_layer_steps or self.fidelity)

    def step_indices(self) -> list[int]:
        """Every step index the plan names (``exact_steps`` and each layer's), for a check against a run's steps."""
        return [*self.exact_steps, *(i for steps in self.exact_layer_steps.values() for i in steps)]

    # -- decisions -------------------------------------------------------------------------------
    def decide(self) -> list[str]:
        """(Re)apply the rule to every layer's statistics; returns the guarded layer names."""
        self.guarded = [name for name, st in self.stats.items() if self.rule.evaluate(st, self.policy)]
        return list(self.guarded)

    def redecide(self, rule: GuardRule | None = None, *, threshold: float | None = None,
                 fraction: float | None = None, statistic: str | None = None) -> GuardPlan:
        """A copy with another rule applied to the same statistics."""
        new = GuardPlan.from_dict(self.to_dict())
        new.rule = make_rule(rule or self.rule, threshold, fraction, statistic)
        new.decide()
        return new

    def match(self, specs: Iterable[Any], names: Iterable[str] | None = None) -> list[Any]:
        """The layer specs (fp4vis.patching.layer.LayerSpec) this plan guards (``names``: those it names
        otherwise, e.g. ``exact_layers``); unknown names raise."""
        specs = list(specs)
        chosen, missing = [], []
        for name in self.guarded if names is None else names:
            hits = [s for s in specs if name in (s.name, s.local_name) or (
                s.component == "" and name.split(".", 1)[-1] == s.name and "." in name)]
            if not hits:
                missing.append(name)
            chosen.extend(h for h in hits if h not in chosen)
        if missing:
            raise GuardPlanError(f"guard plan for {self.model_id!r} names layers this model does not have: "
                             f"{', '.join(missing[:6])}; its layers are "
                             f"{', '.join(s.name for s in specs[:8])}{' ...' if len(specs) > 8 else ''}")
        return chosen

    def check_model(self, specs: Iterable[Any], model_id: str) -> None:
        """Refuse a plan made on another architecture. The plan's fingerprint lists every attention
        layer of the calibrated model with its heads and head dim; the model's must be the same
        (a deeper model would keep unguarded layers the plan never saw). A plan without one (written
        before fingerprints) is checked on the layers it recorded. A different model id alone only
        warns (a local copy of the same checkpoint has another path)."""
        specs = list(specs)
        problems = []
        if self.architecture:
            # a plan of a pipeline names "transformer.blocks.0.attn1"; applied to its transformer (or the
            # other way round) the layers are the same without the component prefix
            plan_views = [self.architecture, {n.split(".", 1)[-1]: v for n, v in self.architecture.items()}]
            model_views = [{s.name: [s.num_heads, s.head_dim] for s in specs},
                           {s.local_name: [s.num_heads, s.head_dim] for s in specs}]
            plan, here = max(((p, m) for p in plan_views for m in model_views),
                             key=lambda pm: (set(pm[0]) == set(pm[1]), len(set(pm[0]) & set(pm[1]))))
            for name, shape in plan.items():
                if name not in here:
                    problems.append(f"{name} is not a layer of this model")
                elif here[name] != list(shape):
                    problems.append(f"{name} has {here[name][0]} heads of dim {here[name][1]} here, "
                                    f"{shape[0]} of dim {shape[1]} in the plan")
            problems += [f"{name} is not in the plan" for name in here if name not in plan]
        else:
            by_name = {}
            for s in specs:
                by_name.setdefault(s.name, s)
                by_name.setdefault(s.local_name, s)
            for name, st in self.stats.items():
                spec = by_name.get(name) or (by_name.get(name.split(".", 1)[-1]) if "." in name else None)
                if spec is None:
                    problems.append(f"{name} is not a layer of this model")
                elif st.num_heads and (spec.num_heads, spec.head_dim) != (st.num_heads, st.head_dim):
                    problems.append(f"{name} has {spec.num_heads} heads of dim {spec.head_dim} here, "
                                    f"{st.num_heads} of dim {st.head_dim} in the plan")
        if problems:
            raise GuardPlanError(f"guard plan for {self.model_id!r} does not fit this model: "
                                 f"{'; '.join(problems[:4])}{' ...' if len(problems) > 4 else ''} "
                                 "(calibrate it on this model)")
        if model_id and self.model_id and model_id != self.model_id:
            warnings.warn(f"guard plan was calibrated on {self.model_id!r}, applied to {model_id!r} (its layers "
                          "match)", RuntimeWarning, stacklevel=3)

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "model_id": self.model_id,
            "created": self.created,
            "policy": _policy_to_dict(self.policy),
            "guard_policy": _policy_to_dict(self.guard_policy),
            "rule": self.rule.to_dict(self.policy),
            "n_samples": self.n_samples,
            "num_inputs": self.num_inputs,
            "statistic_units": "log2: z*log2(e), z = q.k*scale, FP32 from the layer's q and k",
            "layers": {name: st.to_dict() for name, st in self.stats.items()},
            "guarded": list(self.guarded),
            "architecture": {name: list(shape) for name, shape in self.architecture.items()},
        } | ({"version": VERSION, "exact_layers": list(self.exact_layers), "exact_steps": list(self.exact_steps),
              "exact_layer_steps": {n: list(v) for n, v in self.exact_layer_steps.items()},
              "fidelity": self.fidelity} if self.searched else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardPlan:
        """From ``to_dict``'s form, checked against it field by field: types, finite statistics, required and
        unknown fields. A field that does not fit raises ``GuardPlanError`` naming it and the reason."""
        if not isinstance(d, Mapping):
            raise GuardPlanError(f"expected a JSON object, got {_json_type(d)}")
        if d.get("format") != FORMAT:
            raise GuardPlanError(f"not an fp4vis guard plan (format {d.get('format')!r}, expected {FORMAT!r})")
        version = d.get("version")
        if type(version) is not int or version > VERSION or version < 1:
            raise GuardPlanError(f"guard plan version {version!r} is not supported (this fp4vis reads "
                                 f"versions 1..{VERSION})")
        d = _check_fields("", d, required=_PLAN_REQUIRED,
                          optional=_PLAN_OPTIONAL + (_PLAN_SEARCHED if version >= 2 else ()))
        _check_str("statistic_units", d.get("statistic_units", ""))
        layers = _check_object("layers", d["layers"], "{layer name: statistics}")
        stats = {}
        for name, st in layers.items():
            checked = _checked_layer_stats(st, f"layers[{name!r}]")
            if checked.setdefault("name", name) != name:
                raise GuardPlanError(f"layers[{name!r}].name: expected the layer's key {name!r}, "
                                     f"got {checked['name']!r}")
            stats[name] = LayerStats(**checked)
        return cls(model_id=_check_str("model_id", d["model_id"]),
                   policy=_policy_from_dict(d["policy"], "policy"),
                   guard_policy=_policy_from_dict(d["guard_policy"], "guard_policy"),
                   rule=GuardRule.from_dict(d["rule"]), stats=stats,
                   guarded=_check_names("guarded", d["guarded"]),
                   n_samples=_check_int("n_samples", d.get("n_samples", GUARD_ANCHORS), minimum=1),
                   num_inputs=_check_int("num_inputs", d.get("num_inputs", 0), minimum=0),
                   created=_check_str("created", d.get("created", "")), version=version,
                   architecture=_check_architecture(d.get("architecture", {})),
                   exact_layers=_check_names("exact_layers", d.get("exact_layers", [])),
                   exact_steps=_check_steps("exact_steps", d.get("exact_steps", [])),
                   exact_layer_steps={name: _check_steps(f"exact_layer_steps[{name!r}]", steps) for name, steps in
                                      _check_object("exact_layer_steps", d.get("exact_layer_steps", {}),
                                                    "{layer name: step indices}").items()},
                   fidelity=_check_fidelity(d.get("fidelity")))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a failed write never replaces a good plan)."""
        check_plan_path(path, "GuardPlan.save: path")
        atomic_write(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> GuardPlan:
        """Read a plan; a file that is not a readable plan of a supported version raises
        ``GuardPlanError`` naming the file and the reason; a ``path`` that is not a path (a file descriptor,
        a bool) raises ``TypeError``: ``open`` would read or close that descriptor."""
        check_plan_path(path, "GuardPlan.load: path")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return cls.from_dict(data)
        except (OSError, UnicodeDecodeError, ValueError) as exc:   # JSONDecodeError, GuardPlanError: ValueErrors
            raise GuardPlanError(f"guard plan {str(path)!r}: {exc}") from None

    def summary(self) -> str:
        lines = [f"guard plan for {self.model_id} (policy {self.policy.name}, guard {self.guard_policy.name}; "
                 f"{self.rule.describe(self.policy)})"]
        if self.searched:
            lines.append(f"  exact layers: {', '.join(self.exact_layers) or 'none'}; exact steps: "
                         f"{', '.join(map(str, self.exact_steps)) or 'none'}"
                         + "".join(f"; {n} exact in steps {', '.join(map(str, v))}"
                                   for n, v in self.exact_layer_steps.items()))
        for name, st in self.stats.items():
            lines.append(f"  {name}: value {st.value:.1f} / limit {st.limit:.1f}"
                         f"{'  GUARDED' if st.guarded else ''}" if st.value is not None else f"  {name}: -")
        return "\n".join(lines)
