"""Kernel backends of fp4vis, one subpackage each (``hopper``: sm_90a, CuTe DSL; ``blackwell``:
sm_100a / sm_103a / sm_120a, Triton on the block-scaled FP4 MMAs). The backend
registry (``fp4vis.backends.registry``) loads a subpackage's ``backend`` module on first use."""
