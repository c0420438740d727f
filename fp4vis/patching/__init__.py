"""Per-layer FP4 attention for existing models (the patching layer, above the backends):

* ``api``: ``patch`` (find the layers, resolve a policy per layer, install) and ``unpatch``;
* ``handle``: ``PatchHandle`` and the installer; ``discovery``: which layers a model has;
* ``layer``: ``LayerSpec`` / ``LayerState`` and the fallback rules;
* ``guard``: the calibration statistic, ``calibrate``, ``AutoGuard``; ``guard_plan``: ``GuardRule``, ``GuardPlan``
  (the plan file: its JSON, load/save and their checks), ``GuardPlanError``;
* ``patchers``: the patcher registry (one module per library patcher, the four functions each implements):
  ``wan`` (diffusers Wan, the fused q/k fast path), ``diffusers_attention`` (every other diffusers attention layer),
  ``timm_attention`` (timm), ``transformers_attention`` (transformers' ``AttentionInterface``); ``masks`` sorts the
  SDPA-form masks they are handed (key-padding or not);
* ``context_parallel``: FP4 attention of the Wan layers under diffusers' context parallelism.
"""

from .api import patch
from .context_parallel import ContextParallelError
from .guard import calibrate
from .guard_plan import GuardPlan, GuardPlanError, GuardRule
from .handle import PatchHandle, unpatch
from .layer import FallbackError, FallbackWarning, LayerSpec, LayerState

__all__ = ["ContextParallelError", "FallbackError", "FallbackWarning", "GuardPlan", "GuardPlanError", "GuardRule",
           "LayerSpec", "LayerState", "PatchHandle", "calibrate", "patch", "unpatch"]
