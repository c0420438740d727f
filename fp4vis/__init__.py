"""fp4vis: Direct-P FP4 attention for video and vision diffusion models.

Follow a call: ``fp4vis.attention`` (attention.py: validation, layout) -> ``fp4vis.dispatch``
(which backend) -> ``fp4vis.reference`` (the exact emulation of SPEC.md) or a kernel in
``fp4vis.kernels``. Formats live in ``fp4vis.formats``, policies in ``fp4vis.policy``.
"""

from fp4vis.attention import RangeExceededError, attention
from fp4vis.dispatch import available_backends
from fp4vis.guard import GuardPlan, GuardRule, calibrate
from fp4vis.metrics import cosine, rel_l2, rmse
from fp4vis.patch import FallbackError, FallbackWarning, PatchHandle, patch, unpatch
from fp4vis.policy import POLICIES, Policy, get_policy, guard_policy, guard_policy_for_heads
from fp4vis.reference import RangeReport

__version__ = "0.1.0"

__all__ = [
    "FallbackError",
    "FallbackWarning",
    "GuardPlan",
    "GuardRule",
    "POLICIES",
    "PatchHandle",
    "Policy",
    "RangeExceededError",
    "RangeReport",
    "attention",
    "available_backends",
    "calibrate",
    "cosine",
    "get_policy",
    "guard_policy",
    "guard_policy_for_heads",
    "patch",
    "rel_l2",
    "rmse",
    "unpatch",
]
