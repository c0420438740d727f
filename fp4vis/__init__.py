"""fp4vis: Direct-P FP4 attention for video and vision diffusion models.

Layers, imports running one way (docs/design.md):

* core: ``attention`` (validation, layout, range check), ``policy``, ``formats``, ``key_positions`` (key
  blocks and tiles, anchors, native positions), ``reference`` (the exact emulation of docs/numerics.md),
  ``range_report``, ``metrics``, ``settings`` (the ``FP4VIS_*`` variables);
* backends: ``fp4vis.backends`` (the registry, the reference backend) and the kernels in
  ``fp4vis.kernels.<name>``;
* patching: ``fp4vis.patching`` (``patch``, guard plans, one module per model library);
* apps: ``fp4vis.cli``, ``fp4vis.pipelines``, ``fp4vis.evals`` on ``fp4vis.services``.

Follow a call: ``fp4vis.attention`` builds the typed call (``fp4vis.call.validated_call`` ->
``AttentionCall``) -> ``fp4vis.backends.registry.select_backend`` -> ``fp4vis.attention.run_call`` -> a backend's
``run`` (``fp4vis.backends.reference``, ``fp4vis.kernels.hopper.backend`` or ``fp4vis.kernels.blackwell.backend``)
-> its kernel; a patched layer builds the same call once and enters at ``run_call``.
"""

from fp4vis.attention import RangeExceededError, attention, check_range
from fp4vis.backends import available_backends
from fp4vis.metrics import cosine, rel_l2, rmse
from fp4vis.patching import (
                             FallbackError,
                             FallbackWarning,
                             GuardPlan,
                             GuardPlanError,
                             GuardRule,
                             PatchHandle,
                             calibrate,
                             patch,
                             unpatch,
)
from fp4vis.policy import POLICIES, Policy, get_policy, guard_policy, guard_policy_for_heads
from fp4vis.range_report import RangeReport

__version__ = "0.1.0"


def plan(pipe, prompts, policy="fast", target=None, **options):
    """The plan that meets a fidelity ``target`` against BF16 on ``prompts`` with the most attention time in FP4:
    which denoising steps and layers stay exact (a ``GuardPlan`` for ``fp4vis.patch(..., guard=plan)``). An app
    service that runs the pipeline (``fp4vis.evals.plan_search.plan``, imported on the first call: ``import
    fp4vis`` loads no pipeline library); ``options``: its ``settings``, ``budget``, ``guard``."""
    from fp4vis.evals.plan_search import plan as search

    return search(pipe, prompts, policy, target, **options)


__all__ = [
    "FallbackError",
    "FallbackWarning",
    "GuardPlan",
    "GuardPlanError",
    "GuardRule",
    "POLICIES",
    "PatchHandle",
    "Policy",
    "RangeExceededError",
    "RangeReport",
    "attention",
    "available_backends",
    "calibrate",
    "check_range",
    "cosine",
    "get_policy",
    "guard_policy",
    "guard_policy_for_heads",
    "patch",
    "plan",
    "rel_l2",
    "rmse",
    "unpatch",
]
